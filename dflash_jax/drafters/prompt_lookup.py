"""Prompt lookup (n-gram) drafting: no parameters, no model. The drafts are what followed an
earlier occurrence of the sequence's last n tokens (the prompt and the generated text alike).

The rule, per sequence, with S the tokens at positions 0 .. L (L the position of x_last, the
last committed token) and K = block_size - 1 drafts wanted:

  for n from max_ngram down to min_ngram (n <= L): the matches are the j with
      S[j .. j+n-1] == S[L-n+1 .. L] and j + n <= L  (an earlier occurrence, followed by a
      known token);
  the first n with a match decides: its most recent match whose continuation fills the block
      (j + n + K - 1 <= L), or, when none does, its earliest (the longest continuation);
  drafts = S[j+n .. j+n+K-1], the positions past L (unknown yet) left out.

Drafts that are left out, or every draft when nothing matches, carry confidence 0 (the others
1): with `generate(confidence_threshold=...)` the verify then narrows to the looked-up drafts
(`Decoder.verify`), so a step with no match costs about one autoregressive step. The drafts are
a deterministic function of the committed tokens, so verification is the one-hot rule
(lossless at T = 0, exact at T > 0). Everything is a few [B, capacity] comparisons inside the
compiled loop: no host step.

    dj.generate(target, dj.PromptLookup(block_size=8, max_ngram=3), prompts, 256)
"""

from __future__ import annotations

import dataclasses
import os

import flax.struct
import jax.numpy as jnp

from dflash_jax.drafters import base
from dflash_jax.support import checks

MAX_NGRAM = 16


@dataclasses.dataclass(frozen=True)
class PromptLookupConfig:
    """block_size: x_last + block_size - 1 drafts per step; n-grams of min_ngram .. max_ngram
    tokens are looked up, the longest first."""

    block_size: int = 8
    min_ngram: int = 1
    max_ngram: int = 3

    def __post_init__(self):
        checks.int_param(
            "block_size", self.block_size, lo=checks.BLOCK_SIZE_MIN, hi=checks.BLOCK_SIZE_MAX
        )
        lo = checks.int_param("min_ngram", self.min_ngram, lo=1, hi=MAX_NGRAM)
        checks.int_param("max_ngram", self.max_ngram, lo=lo, hi=MAX_NGRAM)


@dataclasses.dataclass(frozen=True)
class PromptLookupModule:
    """The decode programs' handle on a prompt-lookup drafter (hashable: part of the jit key,
    like a drafter's Flax module)."""

    cfg: PromptLookupConfig


@dataclasses.dataclass
class PromptLookup:
    """A prompt-lookup drafter for `dj.generate` (in place of a loaded `Drafter`)."""

    config: PromptLookupConfig
    params: None = None
    path: None = None

    def __init__(self, block_size: int = 8, min_ngram: int = 1, max_ngram: int = 3):
        self.config = PromptLookupConfig(block_size, min_ngram, max_ngram)
        self.params = None
        self.path = None

    @property
    def module(self) -> PromptLookupModule:
        return PromptLookupModule(self.config)


SPEC = "prompt_lookup"


def from_spec(spec):
    """infer.py's --drafter=prompt_lookup[:N | :MIN-MAX] (n-gram sizes; default 1-3) as a
    `PromptLookup`; None for anything else (a drafter directory or hub id: what drafter it
    holds, its config.json says, whatever its name). A bad range is one line (ValueError), and
    so is a spec that is also the name of a path here (./prompt_lookup names the path)."""
    if not isinstance(spec, str) or not (spec == SPEC or spec.startswith(SPEC + ":")):
        return None
    if os.path.exists(spec):
        raise ValueError(
            f"--drafter={spec} names prompt lookup, but {spec} is also a path here: pass "
            f"./{spec} for the drafter it holds, or rename it"
        )
    sizes = spec[len(SPEC) + 1 :]
    if not sizes:
        return PromptLookup()
    lo, _, hi = sizes.partition("-")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(
            f"--drafter={spec}: n-gram sizes must be N or MIN-MAX (e.g. prompt_lookup:2-4)"
        ) from None
    return PromptLookup(min_ngram=lo, max_ngram=hi)


@flax.struct.dataclass
class TokenHistory:
    """The drafter's context: every sequence's tokens by position ([B, capacity]; positions at
    or past `lengths` are stale or unwritten) and the committed count [B]."""

    tokens: jnp.ndarray
    lengths: jnp.ndarray

    @classmethod
    def create(cls, batch: int, capacity: int) -> "TokenHistory":
        return cls(
            tokens=jnp.zeros((batch, capacity), jnp.int32),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    def write(self, ids, positions, lengths) -> "TokenHistory":
        """ids [B, T] at positions [B, T] (past the capacity: dropped); lengths [B]."""
        b = ids.shape[0]
        tokens = self.tokens.at[jnp.arange(b)[:, None], positions].set(
            ids.astype(jnp.int32), mode="drop"
        )
        return self.replace(tokens=tokens, lengths=lengths)


def lookup(tokens, x_last, last, k: int, min_ngram: int, max_ngram: int):
    """The module docstring's rule. tokens [B, C] (positions < last valid), x_last [B] (the
    token at position last [B]), k drafts. Returns (drafts [B, k] int32, confidence [B, k]:
    1.0 for a looked-up draft, 0.0 where there is none; such drafts are x_last)."""
    b, c = tokens.shape
    bidx = jnp.arange(b)
    seq = jnp.concatenate([tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)  # room for x_last
    seq = seq.at[bidx, last].set(x_last)
    width = c + 1
    pad = jnp.concatenate([seq, jnp.full((b, max_ngram), -1, jnp.int32)], axis=1)
    j = jnp.arange(width, dtype=jnp.int32)[None]  # candidate match starts
    found = jnp.zeros((b,), bool)
    start = jnp.zeros((b,), jnp.int32)  # the continuation's first position
    for n in range(max_ngram, min_ngram - 1, -1):
        match = (j + n <= last[:, None]) & (last[:, None] >= n)
        for i in range(n):
            want = jnp.take_along_axis(seq, (last - n + 1 + i)[:, None].clip(0, c), axis=1)
            match &= pad[:, i : i + width] == want
        full = match & (j + n + k - 1 <= last[:, None])
        recent = jnp.max(jnp.where(full, j, -1), axis=1)
        earliest = jnp.min(jnp.where(match, j, width), axis=1)
        pick = jnp.where(recent >= 0, recent, earliest)
        here = ~found & jnp.any(match, axis=1)
        start = jnp.where(here, pick + n, start)
        found |= here
    pos = start[:, None] + jnp.arange(k, dtype=jnp.int32)[None]
    ok = found[:, None] & (pos <= last[:, None])
    drafts = jnp.take_along_axis(seq, pos.clip(0, c), axis=1)
    drafts = jnp.where(ok, drafts, x_last[:, None])
    return drafts.astype(jnp.int32), ok.astype(jnp.float32)


class PromptLookupKind(base.DrafterKind):
    """Prompt lookup: the context is the token ids by position; the drafts continue the most
    useful earlier occurrence of the last n-gram (`lookup`), with confidence 1 where looked up
    and 0 where not (a confidence threshold then narrows the verify to them)."""

    name = "prompt_lookup"
    config_type = (PromptLookupConfig,)
    drafter_type = (PromptLookup,)
    module_type = (PromptLookupModule,)
    reads_files = False

    def claims(self, spec) -> bool:
        return from_spec(spec) is not None

    def read_config(self, spec, target_config, dtype: str = "float32"):
        return from_spec(spec).config

    def load(self, spec, target, **options):
        return from_spec(spec)

    def limits(self, config) -> base.Limits:
        return base.Limits(
            default_block_size=config.block_size,
            chain_only="prompt lookup drafts (one chain of looked-up tokens, no model pass)",
            sample_refusal=(
                "draft_sampling='sample' needs a model drafter (prompt lookup drafts looked-up "
                "tokens, with no distribution to sample)"
            ),
        )

    def decode_params(self, drafter):
        return None

    def new_config(self, target_config, **options):
        return PromptLookupConfig(**options)

    def module(self, config):
        return PromptLookupModule(config)

    def init_context(self, dec, b, capacity):
        return TokenHistory.create(b, capacity)

    def write_context(self, dec, ctx, taps, ids, positions, lengths, starts=None):
        return ctx.write(ids, positions, lengths)

    def propose(self, dec, state, x_last, start, key=None):
        cfg = dec.dmod.cfg
        drafts, conf = lookup(
            state.ctx.tokens, x_last, start, dec.plan.block_size - 1, cfg.min_ngram, cfg.max_ngram
        )
        return base.chain_proposal(x_last, drafts, conf)


KIND = PromptLookupKind()
