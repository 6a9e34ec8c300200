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
the same pass's log-probabilities; DFlash 2: its candidate selector's chain); EAGLE-3 keeps its
own one-layer K/V cache and the fused feature of the last committed position, and drafts
token by token (`Eagle3`). The building blocks stay `Decoder` methods (`draft_block`,
`draft_logprobs`, `select_block`, `write_context`), which tests replace by oracles.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax.numpy as jnp

import jax

from dflash_jax.decoding.tree import Tree, build_tree
from dflash_jax.drafters import eagle3 as eagle3_lib
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
    # candidates ([B, bs-1, K] token ids and probabilities; DFlash 2 and EAGLE-3 at T > 0), or
    # with q_ids None over the whole vocabulary in id order (q_probs [B, bs-1, V]; DFlash's
    # sampled drafts): verified by rejection sampling against it (`Decoder.rejection_tokens`).
    # q_probs None: drafts verified as one-hot proposals (a draft is accepted iff the target's
    # own sample names it).
    q_ids: Optional[jnp.ndarray] = None
    q_probs: Optional[jnp.ndarray] = None


# How a drafter drafts at T > 0 (`Plan.draft_sampling`, `generate(draft_sampling=...)`):
# "sample": each draft sampled from the drafter's distribution (under the request's
# temperature, top-k, top-p for DFlash; DFlash 2's selector and EAGLE-3 their own), verified
# by rejection sampling against it (the reference implementations' rule); "argmax": the
# drafter's most probable drafts, verified as one-hot proposals. Both lossless. At T = 0 every
# drafter drafts its argmax. The default of each kind (None in the plan): "sample" for all
# three; for DFlash it gave the higher tau at T = 1 (docs/generation.md: bundled pair 1.44 vs
# 1.14, SmolLM2 1.22 vs 1.12; benchmarks/draft_sampling_tau.py).
DRAFT_SAMPLING = ("argmax", "sample")
DEFAULT_DRAFT_SAMPLING = {"dflash": "sample", "dflash2": "sample", "eagle3": "sample"}


def draft_sampling(dec, kind) -> str:
    """The draft rule this plan asks of drafter kind `kind` ("argmax" or "sample")."""
    return dec.plan.draft_sampling or DEFAULT_DRAFT_SAMPLING[kind.name]


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
        """T > 0 with draft_sampling "sample", on a chain of one pass (a tree and the
        denoising passes draft from the argmax)."""
        plan = dec.plan
        return (
            plan.temperature > 0
            and draft_sampling(dec, self) == "sample"
            and not plan.tree_budget
            and plan.denoise_steps == 1
        )

    def chain(self, dec, ctx, x_last, start, key):
        """(drafts [B, bs-1], confidence [B, bs-1], q_ids, q_probs): a greedy chain, verified
        as one-hot proposals (q None), or drafts sampled from the drafter's adjusted
        distribution q over the vocabulary (`Decoder.sample_block`; q_ids None)."""
        if self.samples_drafts(dec):
            drafts, conf, q = dec.sample_block(ctx, x_last, start, key)
            return drafts, conf, None, q
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
    T = 0; at T > 0 sampled, with its proposal q for rejection sampling (draft_sampling
    "sample", its default; "argmax": the greedy walk, verified as one-hot proposals)."""

    name = "dflash2"

    def samples_drafts(self, dec) -> bool:
        return dec.plan.temperature > 0 and draft_sampling(dec, self) == "sample"

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


@flax.struct.dataclass
class Eagle3Context:
    """An EAGLE-3 drafter's context: its own one-layer K/V cache (slot = position; rows at
    positions < cache.lengths = committed length - 1 hold the committed rows) and `pending`
    [B, H], the fused target feature of the last committed position, whose row waits for
    the token after it."""

    cache: KVCache
    pending: jnp.ndarray


class Eagle3:
    """EAGLE-3 (`drafters.eagle3`): one drafter layer over its own cache, K = block_size - 1
    steps per proposal.

    Rows. The row at position p pairs a feature of position p with the embedding of the token
    at p + 1; its logits predict the token at p + 2. With L committed positions (0 .. L-1 in
    the target cache, x_last at L = start not yet through the target), the cache holds the
    committed rows 0 .. L-2, built from the target's features fc(taps); the feature of L-1
    is `pending`.

    propose: step i = 1 .. K is one row at position start - 2 + i: step 1 = (pending,
    embedding(x_last)) at start - 1, step i > 1 = (step i-1's pre-norm hidden output,
    embedding(d_{i-1})); step i's logits give d_i, the token at start + i. Each step's K/V go
    to its slot without advancing the committed length (commit overwrites them).

    write_context (commit: positions start .. start+n-1 with taps, ids[0] = x_last; prefill:
    a prompt chunk): rows start-1 .. start+n-2, row start-1+j = (feature j, embedding(ids[j]))
    with feature 0 = pending and feature j = fc(taps[j-1]); their K/V only (no attention:
    a committed row's output is never read); the feature of the new last position
    start+n-1 becomes pending.

    Parameters (`Decoder.dparams`): `Eagle3.decode_params` of the user object, {"params",
    "vocab": {"d2t"}} and optionally "embedding" (the drafter's own; absent: the target's)."""

    name = "eagle3"

    def taps(self, dec):
        return dec.dmod.cfg.tap_layers(dec.tmod.cfg.num_layers)

    def variables(self, dec):
        return {"params": dec.dparams["params"], "vocab": dec.dparams["vocab"]}

    def embed(self, dec, ids):
        """Embeddings of token ids (any shape): the drafter's own table, else the target's."""
        own = dec.dparams.get("embedding")
        if own is None:
            return dec.embed(ids)
        return jnp.take(own, ids, axis=0)

    def init_context(self, dec, b, capacity):
        body = dec.dmod.cfg.body
        return Eagle3Context(
            cache=eagle3_lib.create_cache(dec.dmod.cfg, b, capacity),
            pending=jnp.zeros((b, body.hidden_size), body.dtype),
        )

    def write_context(self, dec, ctx, taps, ids, positions, lengths, starts=None):
        b, t = ids.shape
        if starts is None:
            starts = positions[:, 0]
        mod = dec.dmod
        fused = mod.apply(self.variables(dec), taps, method=eagle3_lib.Eagle3Drafter.fuse)
        feats = jnp.concatenate([ctx.pending[:, None].astype(fused.dtype), fused[:, :-1]], 1)
        rows = starts[:, None] - 1 + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
        k, v = mod.apply(
            self.variables(dec),
            self.embed(dec, ids),
            feats,
            jnp.maximum(rows, 0),
            method=eagle3_lib.Eagle3Drafter.row_kv,
        )
        keep = (rows >= 0) & (rows < lengths[:, None] - 1)
        slots = jnp.where(keep, rows, ctx.cache.capacity)  # capacity: dropped
        cache = eagle3_lib.write_step_kv(ctx.cache, k, v, slots, jnp.maximum(lengths - 1, 0))
        last = lengths - 1 - starts  # index of the last committed position in this write
        here = last >= 0
        new = fused[jnp.arange(b), jnp.clip(last, 0, t - 1)]
        pending = jnp.where(here[:, None], new.astype(ctx.pending.dtype), ctx.pending)
        return Eagle3Context(cache=cache, pending=pending)

    def samples_drafts(self, dec) -> bool:
        return dec.plan.temperature > 0 and draft_sampling(dec, self) == "sample"

    def draft_step(self, dec, state, cache, feature, token, position, chain, i):
        """One drafting step: the row (feature [B, H], embedding of token [B]) at position [B]
        against the cache (slots < cache.lengths) -> (hidden [B, H], logits [B, Vd] float32
        over the draft vocabulary, the cache with the row's K/V in its slot, length kept).
        state (the decode state), chain [B, bs] (x_last, the drafts so far, zeros after) and
        i (this step's 1-based index) are unused here: what an oracle that tests put in its
        place may read."""
        del state, chain, i
        hidden, logits, k, v = dec.dmod.apply(
            self.variables(dec),
            self.embed(dec, token)[:, None],
            feature[:, None],
            position[:, None],
            cache.k[0],
            cache.v[0],
            cache.lengths,
            method=eagle3_lib.Eagle3Drafter.step,
        )
        cache = eagle3_lib.write_step_kv(cache, k, v, position[:, None], cache.lengths)
        return hidden[:, 0], logits[:, 0], cache

    def propose(self, dec, state, x_last, start, key=None):
        b = x_last.shape[0]
        bs = dec.plan.block_size
        k_steps = bs - 1
        sampled = self.samples_drafts(dec)
        vd = dec.dmod.cfg.draft_vocab_size
        targets = dec.dmod.apply(
            self.variables(dec),
            jnp.arange(vd, dtype=jnp.int32),
            method=eagle3_lib.Eagle3Drafter.to_target_ids,
        ).astype(jnp.int32)  # [Vd]: the target id of each draft id
        keys = jax.random.split(key, k_steps) if sampled else jnp.zeros((k_steps, 2), jnp.uint32)
        chain0 = jnp.zeros((b, bs), jnp.int32).at[:, 0].set(x_last)
        ctx = state.ctx
        # The steps attend to the committed rows and to the steps before (length + i - 1).
        cache0 = ctx.cache.replace(lengths=start - 1)

        def one(carry, xs):
            cache, feature, token, chain = carry
            i, step_key = xs
            position = start - 2 + i
            lengths = cache.lengths
            hidden, logits, cache = self.draft_step(
                dec, state, cache, feature, token, position, chain, i
            )
            cache = cache.replace(lengths=lengths + 1)
            logits = logits.astype(jnp.float32)
            p = jax.nn.softmax(logits, axis=-1)
            if sampled:
                q = jax.nn.softmax(logits / dec.plan.temperature, axis=-1)
                d = jax.random.categorical(step_key, logits / dec.plan.temperature, axis=-1)
            else:
                q = None
                d = jnp.argmax(logits, axis=-1)
            d = d.astype(jnp.int32)
            conf = jnp.take_along_axis(p, d[:, None], axis=-1)[:, 0]
            draft = targets[d]
            chain = chain.at[:, i].set(draft)
            out = (draft, conf) + ((q,) if sampled else ())
            return (cache, hidden.astype(feature.dtype), draft, chain), out

        carry = (cache0, ctx.pending, x_last, chain0)
        steps = jnp.arange(1, bs, dtype=jnp.int32)
        _, outs = jax.lax.scan(one, carry, (steps, keys))
        drafts = outs[0].T  # [B, K]
        conf = outs[1].T
        q_ids = q_probs = None
        if sampled:
            q_probs = jnp.transpose(outs[2], (1, 0, 2))  # [B, K, Vd]
            q_ids = jnp.broadcast_to(targets[None, None], q_probs.shape)
        depths = jnp.broadcast_to(jnp.arange(bs, dtype=jnp.int32)[None], (b, bs))
        tokens = jnp.concatenate([x_last[:, None], drafts], axis=1)
        return Proposal(
            tokens=tokens,
            depths=depths,
            drafts=drafts,
            conf=conf,
            q_ids=q_ids,
            q_probs=q_probs,
        )


AUTOREGRESSIVE, DFLASH, DFLASH2 = Autoregressive(), DFlash(), DFlash2()
PROMPT_LOOKUP, EAGLE3 = PromptLookup(), Eagle3()


def kind_of(dmod):
    """The kind of drafter module `dmod` (None: autoregressive decoding)."""
    if dmod is None:
        return AUTOREGRESSIVE
    if isinstance(dmod, lookup_lib.PromptLookupModule):
        return PROMPT_LOOKUP
    if isinstance(dmod, eagle3_lib.Eagle3Drafter):
        return EAGLE3
    return DFLASH2 if dmod.cfg.dflash2 else DFLASH
