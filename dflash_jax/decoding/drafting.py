"""The drafter's side of the decode loop, one small protocol per kind of drafter.

`Decoder.step` is propose -> verify -> accept -> commit whatever drafts; what differs between
drafters is what they keep of the target (their context) and how they propose. A kind of
drafter implements:

  taps(dec)                        the target layers whose outputs it reads (the verify taps)
  init_context(dec, b, capacity)   its context cache for a decode of `capacity` positions
  write_context(dec, ctx, taps, ids, positions, lengths, starts)
                                   the committed positions (their taps [B, T, F] and token
                                   ids [B, T]) into that cache
  propose(dec, state, x_last, start, key) -> Proposal
                                   the tokens to verify: x_last and the drafts (a chain, or a
                                   tree with its mask), with, where the drafts were sampled,
                                   their proposal distribution q (exact rejection sampling)
  samples_drafts(dec)              whether `propose` needs a random key

and `kind_of(dmod)` picks the kind from the drafter module: autoregressive decoding is the
kind that drafts nothing (no context, the proposal is x_last alone); prompt lookup keeps the
token ids and drafts what followed an earlier occurrence of the last n-gram
(`drafters.prompt_lookup`); DFlash and DFlash 2 keep
per-layer K/V of the tapped features (`Decoder.write_context`, a ring when every layer
slides) and draft a block in one pass (DFlash: a chain, a tree or K denoising passes over
the same pass's log-probabilities; DFlash 2: its candidate selector's chain). The next kind
(EAGLE-3: its own feature of the last position, drafted token by token) comes in as another
class here, the loop unchanged. The building blocks stay `Decoder` methods (`draft_block`,
`draft_logprobs`, `select_block`, `write_context`), which tests replace by oracles.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax.numpy as jnp

from dflash_jax.decoding.tree import Tree, build_tree
from dflash_jax.drafters import prompt_lookup as lookup_lib
from dflash_jax.models.transformer import KVCache


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
    # candidates ([B, bs-1, K] token ids and probabilities; DFlash 2 at T > 0): verified by
    # rejection sampling against it (`Decoder.rejection_tokens`). None: drafts verified as
    # one-hot proposals (a draft is accepted iff the target's own sample names it).
    q_ids: Optional[jnp.ndarray] = None
    q_probs: Optional[jnp.ndarray] = None


class Autoregressive:
    """Drafts nothing: each step verifies x_last alone and commits the target's next token."""

    name = "autoregressive"

    def taps(self, dec):
        return ()

    def init_context(self, dec, b, capacity):
        return None

    def write_context(self, dec, ctx, taps, ids, positions, lengths, starts=None):
        return ctx

    def samples_drafts(self, dec) -> bool:
        return False

    def propose(self, dec, state, x_last, start, key=None):
        b = x_last.shape[0]
        return Proposal(tokens=x_last[:, None], depths=jnp.zeros((b, 1), jnp.int32))


class DFlash:
    """The DFlash drafter: KV injection of the tapped features, one block per pass."""

    name = "dflash"

    def taps(self, dec):
        return dec.dmod.cfg.target_layer_ids

    def init_context(self, dec, b, capacity):
        cfg = dec.dmod.cfg
        return KVCache.create(cfg, b, cfg.context_capacity(capacity))

    def write_context(self, dec, ctx, taps, ids, positions, lengths, starts=None):
        return dec.write_context(ctx, taps, positions, lengths, starts)

    def samples_drafts(self, dec) -> bool:
        return False

    def chain(self, dec, ctx, x_last, start, key):
        """(drafts [B, bs-1], confidence [B, bs-1], q_ids, q_probs): a greedy chain, verified
        as one-hot proposals (q None)."""
        drafts, conf = dec.draft_block(ctx, x_last, start)
        return drafts, conf, None, None

    def propose(self, dec, state, x_last, start, key=None):
        b = x_last.shape[0]
        if dec.plan.tree_budget:
            logp = dec.draft_logprobs(state.ctx, x_last, start)
            tree = build_tree(x_last, logp, dec.plan.tree_budget)
            return Proposal(tokens=tree.tokens, depths=tree.depths, tree=tree)
        drafts, conf, q_ids, q_probs = self.chain(dec, state.ctx, x_last, start, key)
        bs = dec.plan.block_size
        depths = jnp.broadcast_to(jnp.arange(bs, dtype=jnp.int32)[None], (b, bs))
        tokens = jnp.concatenate([x_last[:, None], drafts], axis=1)
        return Proposal(
            tokens=tokens, depths=depths, drafts=drafts, conf=conf, q_ids=q_ids, q_probs=q_probs
        )


class DFlash2(DFlash):
    """DFlash 2: the DFlash context and pass, then the candidate selector's walk: greedy at
    T = 0; at T > 0 sampled, with its proposal q for rejection sampling."""

    name = "dflash2"

    def samples_drafts(self, dec) -> bool:
        return dec.plan.temperature > 0

    def chain(self, dec, ctx, x_last, start, key):
        if not self.samples_drafts(dec):
            drafts, conf = dec.draft_block(ctx, x_last, start)
            return drafts, conf, None, None
        return dec.select_block(ctx, x_last, start, key)


class PromptLookup:
    """Prompt lookup: the context is the token ids by position; the drafts continue the most
    useful earlier occurrence of the last n-gram (`drafters.prompt_lookup.lookup`), with
    confidence 1 where looked up and 0 where not (a confidence threshold then narrows the
    verify to them)."""

    name = "prompt_lookup"

    def taps(self, dec):
        return ()

    def init_context(self, dec, b, capacity):
        return lookup_lib.TokenHistory.create(b, capacity)

    def write_context(self, dec, ctx, taps, ids, positions, lengths, starts=None):
        return ctx.write(ids, positions, lengths)

    def samples_drafts(self, dec) -> bool:
        return False

    def propose(self, dec, state, x_last, start, key=None):
        cfg = dec.dmod.cfg
        bs = dec.plan.block_size
        drafts, conf = lookup_lib.lookup(
            state.ctx.tokens, x_last, start, bs - 1, cfg.min_ngram, cfg.max_ngram
        )
        b = x_last.shape[0]
        depths = jnp.broadcast_to(jnp.arange(bs, dtype=jnp.int32)[None], (b, bs))
        tokens = jnp.concatenate([x_last[:, None], drafts], axis=1)
        return Proposal(tokens=tokens, depths=depths, drafts=drafts, conf=conf)


AUTOREGRESSIVE, DFLASH, DFLASH2 = Autoregressive(), DFlash(), DFlash2()
PROMPT_LOOKUP = PromptLookup()


def kind_of(dmod):
    """The kind of drafter module `dmod` (None: autoregressive decoding)."""
    if dmod is None:
        return AUTOREGRESSIVE
    if isinstance(dmod, lookup_lib.PromptLookupModule):
        return PROMPT_LOOKUP
    return DFLASH2 if dmod.cfg.dflash2 else DFLASH
