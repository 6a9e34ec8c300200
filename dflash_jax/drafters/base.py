"""What a kind of drafter is (`DrafterKind`): everything the rest of the library asks of a
drafter, host side and inside the compiled loop, so that the loop, the batch runner, the
trainer, the checks and the dry run ask the kind and never test for it. Each kind is defined
beside its drafter (`dflash`, `eagle3`, `prompt_lookup`) and listed in `registry`.

Inside the loop (`decoding.step.Decoder` asks `registry.loop_of(dmod)`, the kind of its drafter
module; `AUTOREGRESSIVE` when there is none):

  taps(dec)                        the target layers whose outputs it reads (the verify taps)
  init_context(dec, b, capacity)   its context for a decode of `capacity` positions
  write_context(dec, ctx, taps, ids, positions, lengths, starts)
                                   the committed positions (their taps [B, T, F] and token
                                   ids [B, T]) into that context
  propose(dec, state, x_last, start, key) -> Proposal
                                   the tokens to verify: x_last and the drafts (a chain, or a
                                   tree with its mask), with, where the drafts were sampled,
                                   their proposal distribution q (exact rejection sampling)
  samples_drafts(dec)              whether `propose` needs a random key
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from dflash_jax.drafters.tree import Tree


@flax.struct.dataclass
class Proposal:
    """What one step gives the target to verify: T tokens at positions start + depths (the
    last committed token x_last first, at depth 0), and how they were drafted."""

    tokens: jnp.ndarray  # [B, T]
    depths: jnp.ndarray  # [B, T]
    drafts: Optional[jnp.ndarray] = None  # [B, bs-1] a chain's drafts (None: AR or a tree)
    conf: Optional[jnp.ndarray] = None  # [B, bs-1] their confidence
    tree: Optional[Tree] = None  # a draft tree (its mask is the verify's), None: a chain
    # The proposal distribution of each sampled draft given the drafts before it, over its
    # candidates ([B, bs-1, K] token ids and probabilities; DFlash 2 and EAGLE-3 at T > 0), or
    # with q_ids None over the whole vocabulary in id order (q_probs [B, bs-1, V]; DFlash's
    # sampled drafts): verified by rejection sampling against it (`Decoder.rejection_tokens`).
    # q_probs None: drafts verified as one-hot proposals (a draft is accepted iff the target's
    # own sample names it).
    q_ids: Optional[jnp.ndarray] = None
    q_probs: Optional[jnp.ndarray] = None


def chain_proposal(x_last, drafts, conf, q_ids=None, q_probs=None) -> Proposal:
    """A chain: x_last then the drafts [B, bs-1], at depths 0 .. bs-1."""
    b, k = drafts.shape
    depths = jnp.broadcast_to(jnp.arange(k + 1, dtype=jnp.int32)[None], (b, k + 1))
    tokens = jnp.concatenate([x_last[:, None], drafts], axis=1)
    return Proposal(
        tokens=tokens, depths=depths, drafts=drafts, conf=conf, q_ids=q_ids, q_probs=q_probs
    )


# How a drafter drafts at T > 0 (`Plan.draft_sampling`, `generate(draft_sampling=...)`):
# "sample": each draft sampled from the drafter's distribution (under the request's
# temperature, top-k, top-p for DFlash; DFlash 2's selector and EAGLE-3 their own), verified
# by rejection sampling against it (the reference implementations' rule); "argmax": the
# drafter's most probable drafts, verified as one-hot proposals. Both lossless. At T = 0 every
# drafter drafts its argmax. A kind's default is its `Limits.default_draft_sampling`
# ("sample" for every model drafter: for DFlash it gave the higher tau at T = 1,
# docs/generation.md: bundled pair 1.44 vs 1.14, SmolLM2 1.22 vs 1.12;
# benchmarks/experiments/draft_sampling/draft_sampling_tau.py).
DRAFT_SAMPLING = ("argmax", "sample")


def draft_sampling(dec) -> str:
    """The draft rule this plan asks of the decoder's drafter ("argmax" or "sample")."""
    return dec.plan.draft_sampling or dec.kind.default_draft_sampling


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a request may ask of a drafter (`Request.build` checks it).

    default_block_size: the verify block when none is asked for.
    trained_block_size: a block the drafter was trained at bounds the request's
      (`checks.block_size_for`); None: any block in the library's range.
    chain_only: why denoising passes, trees and remasking are refused ("... is not
      implemented for <chain_only>"); None: they are supported.
    sample_refusal: why draft_sampling='sample' is refused; None: it is supported."""

    default_block_size: int
    trained_block_size: Optional[int] = None
    chain_only: Optional[str] = None
    sample_refusal: Optional[str] = None


class DrafterKind:
    """A kind of drafter: its host side (reading, checking, loading, saving, limits) and its
    side of the decode loop (the protocol in the module docstring). The defaults are those of
    a drafter that drafts nothing; each kind overrides what it has."""

    name = "autoregressive"
    default_draft_sampling = "argmax"
    # The types this kind answers for (`registry.of`): its config, its user object, and the
    # module the decode programs hold (part of their jit key).
    config_type: tuple = ()
    drafter_type: tuple = ()
    module_type: tuple = ()
    # Its --drafter spec names files (a directory or hub id, fetched when not here), not a
    # built-in drafter (prompt lookup's "prompt_lookup[:N-M]").
    reads_files = True
    # The draft vocabulary the dry run gives a drafter of this kind (`for_target`'s
    # draft_vocab_size) when none is asked for; None: the kind drafts over the whole vocabulary.
    draft_vocab_default: Optional[int] = None

    # ---- host side
    def claims(self, spec) -> bool:
        """Whether infer.py's --drafter=`spec` (a directory, hub id or name) is of this kind."""
        return False

    def read_config(self, spec, target_config, dtype: str = "float32"):
        """The drafter config `spec` names, from its files alone (no weights), checked."""
        raise NotImplementedError(self.name)

    def check_pair(self, config, target_config) -> None:
        """ValueError (one line) when a drafter of `config` cannot serve the target."""

    def check_loaded(self, drafter, target_config) -> None:
        """The loaded drafter checked against the target: its config's `check_pair` and what
        only the loaded drafter shows (e.g. its own embedding). ValueError (one line)."""
        if drafter is not None:
            self.check_pair(drafter.config, target_config)

    def limits(self, config) -> Limits:
        raise NotImplementedError(self.name)

    def load(self, spec, target, **options):
        """The drafter `spec` names, checked against `target` (options: the kind's loader's,
        e.g. param_dtype)."""
        raise NotImplementedError(self.name)

    def save(self, drafter, path: str, dtype: Optional[str] = None) -> None:
        raise ValueError(f"a {self.name} drafter has no files to save")

    def tap_layers(self, config, num_target_layers: int):
        """The target layers a drafter of `config` reads, on a target this deep."""
        return ()

    def from_trained(self, config, params, vocab=None):
        """The user object of a drafter trained to `params` (vocab: its draft vocabulary as
        training chose it, the kind's own form; None: the whole vocabulary)."""
        raise NotImplementedError(self.name)

    def decode_params(self, drafter):
        """What the decode programs take as its parameters (`Decoder.dparams`)."""
        return drafter.params

    # ---- new drafters (training) and compiling without weights (the dry run)
    def new_config(self, target_config, **options):
        """A new drafter config of this kind matched to a target (`options`: the kind's)."""
        raise NotImplementedError(self.name)

    def init_params(self, config, seed: int = 0):
        """Fresh parameters of a drafter of `config` (as its trainer starts it)."""
        raise NotImplementedError(self.name)

    def for_target(self, target_config, block_size: int, **options):
        """The dry run's drafter of this kind for a target, verifying `block_size` tokens."""
        return self.new_config(target_config, block_size=block_size, **options)

    def module(self, config):
        """The decode module the programs hold for a drafter of `config`."""
        raise NotImplementedError(self.name)

    def head_dim(self, config) -> Optional[int]:
        """The head width its parameters' partition rules split attention projections by
        (`sharding.param_shardings`); None: it has no attention."""
        return None

    def abstract_params(self, config):
        """Its decode parameters as ShapeDtypeStructs (`decode_params`' shapes), or None."""
        return None

    def passes(self, config, block_size: int, denoise_steps: int = 1):
        """(drafter passes, passes of the target's LM head over drafter rows) per step: the
        HBM model's count of what one proposal reads. None: one per drafter pass."""
        return 0, 0

    def loop(self, config) -> "DrafterKind":
        """The kind that drafts in the loop for `config` (a variant may draft otherwise:
        DFlash 2's selector)."""
        return self

    # ---- the decode loop
    def taps(self, dec):
        """The verify taps: `tap_layers` of the drafter on the loop's target."""
        return tuple(self.tap_layers(dec.dmod.cfg, dec.tmod.cfg.num_layers)) if dec.dmod else ()

    def init_context(self, dec, b, capacity):
        return None

    def write_context(self, dec, ctx, taps, ids, positions, lengths, starts=None):
        return ctx

    def samples_drafts(self, dec) -> bool:
        return False

    def propose(self, dec, state, x_last, start, key=None):
        """Autoregressive decoding: x_last alone, the target's next token committed."""
        b = x_last.shape[0]
        return Proposal(tokens=x_last[:, None], depths=jnp.zeros((b, 1), jnp.int32))


AUTOREGRESSIVE = DrafterKind()


def hf_initialized(params, key, initializer_range: float):
    """`params` as Hugging Face initialises a new model: every weight matrix ("kernel")
    ~ N(0, initializer_range), biases zero, the rest (RMSNorm scales: ones) as they are."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, (path, x) in zip(keys, leaves):
        name = getattr(path[-1], "key", None)
        if name == "kernel":
            x = (initializer_range * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
        elif name == "bias":
            x = jnp.zeros_like(x)
        out.append(x)
    return jax.tree_util.tree_unflatten(tree, out)
