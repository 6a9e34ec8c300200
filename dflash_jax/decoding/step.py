"""The speculative (DFlash) and autoregressive decode step, and its prefill.

The algorithm, as one frozen object: `Decoder` holds the two models, their parameters and the
static `Plan`, so a step reads `decoder.step(state)` and its parts `propose`, `verify`, `accept`,
`commit(state, proposal, verdict)` take only what changes per step. The programs that jit and
cache it live in `programs.py`, the API (`generate`) in `generation.py`.

  prefill  (jit): target forward over the (right-padded) prompts with taps; first token; the
                  drafter context cache filled with the prompt's context K/V.
  decode   (jit): one `lax.while_loop`; every iteration is `Decoder.step`:
                    draft   one drafter pass over [x_last, MASK * (bs-1)]  (or K denoise passes)
                    verify  one target pass over [x_last, d_1 .. d_{bs-1}] appended to the cache
                    accept  the longest prefix with d_i == y_{i-1}; commit y_0 .. y_a
                    roll back both caches to the committed length, append the new taps
                  until every sequence hit max_new_tokens or a stop token.
No host round trip per step. The autoregressive baseline is the same loop with an empty draft
(block of one token), through the same target code and cache. `programs.generate_programs`
wraps both in `jax.jit`s with in/out shardings for a device mesh (`dflash_jax.parallel.sharding`'s
rules; none on one device); `request` checks the request and reads the result back on the host.

Why the output is the target's, greedy and sampled (the proof): docs/generation.md, "Why the
output is the target's".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, List, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.sampling import (
    adjusted_logits,
    pick_tokens,
    sample_categorical,
)
from dflash_jax.drafters import registry
from dflash_jax.drafters.base import Proposal
from dflash_jax.drafters.tree import accept_path
from dflash_jax.models import attention as attn_lib
from dflash_jax.models.target import new_cache
from dflash_jax.models.transformer import KVCache, Transformer


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static settings of one compiled generation program (hashable: part of the jit key)."""

    block_size: int  # 1 = autoregressive
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    stop_token_ids: tuple = ()
    denoise_steps: int = 1
    # Which positions the K passes fix: "confidence" (the most confident still-masked ones) or
    # "fixed" (left to right); remask: a fixed low-confidence token may be masked again
    # (`DFlashKind.denoise`).
    denoise_schedule: str = "confidence"
    remask: bool = False
    confidence_threshold: Optional[float] = None
    return_drafts: bool = False  # record each step's drafted block
    # Verify a draft tree of this many nodes (`dflash_jax.drafters.tree`) instead of the chain.
    tree_budget: Optional[int] = None
    # Host function called with each step's commits (`generate`'s stream_callback), or None.
    # Part of the jit key: a program is compiled per function (reuse one to reuse the program).
    stream: Optional[Callable[[List[List[int]]], None]] = None
    attention_impl: str = "xla"
    # How a drafter drafts at T > 0: "argmax" or "sample" (`drafters.base.DRAFT_SAMPLING`);
    # None: the drafter kind's default (`DrafterKind.default_draft_sampling`).
    draft_sampling: Optional[str] = None
    # Prompts longer than this are prefilled in chunks of this many tokens (a scan appending to
    # the cache), so attention temporaries grow linearly with the context, not quadratically:
    # each chunk's scores are [chunk, capacity]. 0: one pass (dense [prompt, capacity] scores).
    prefill_chunk: int = 512

    # The fields only the decode loop reads: plans that differ in these alone share one prefill
    # program (`prefill_plan`; tests/test_decoding.py checks that the prefill's HLO is the same).
    DECODE_ONLY = (
        "denoise_steps",
        "denoise_schedule",
        "remask",
        "confidence_threshold",
        "tree_budget",
        "stream",
        "draft_sampling",
    )

    def prefill_plan(self) -> "Plan":
        """This plan with the decode-only fields at their defaults: the prefill's jit key. Of a
        tree's budget it keeps only that there is one (0): the prefill lays the target's cache
        out for a chain's verify or a tree's (`new_cache(seq_split=)`), so trees of any budget
        share one prefill, and not a chain's."""
        defaults = {f.name: f.default for f in dataclasses.fields(Plan)}
        plan = dataclasses.replace(self, **{k: defaults[k] for k in Plan.DECODE_ONLY})
        return plan if self.tree_budget is None else dataclasses.replace(plan, tree_budget=0)


@flax.struct.dataclass
class DecodeState:
    cache: KVCache
    ctx: Optional[KVCache]
    tokens: jnp.ndarray  # [B, N] generated tokens (prompt excluded)
    num_out: jnp.ndarray  # [B] tokens generated so far
    done: jnp.ndarray  # [B] bool
    step: jnp.ndarray  # [] decode iterations run
    accepted: jnp.ndarray  # [B, N] tokens committed at each step (0 when inactive)
    drafts: jnp.ndarray  # [N, B, bs-1] drafted blocks (shape [0, B, 0] when not recorded)
    key: jnp.ndarray
    max_new: jnp.ndarray  # [] tokens to generate per sequence


def accepted_prefix(drafts, y, trusted=None):
    """Number of drafts accepted: the longest prefix with d_i == y_{i-1}. drafts [B, bs-1],
    y [B, bs] target tokens at the block positions; trusted [B, bs-1] optional cap."""
    match = drafts == y[:, :-1]
    if trusted is not None:
        match &= trusted
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)


@flax.struct.dataclass
class Verdict:
    """What the target made of a proposal: its token after each proposed one (y [B, T]), the
    cache with the proposal's K/V appended, the taps [B, T, F]; after `accept`, the accepted
    path ([B, L]: proposal indices by depth, padded) and how many drafts were accepted ([B])."""

    y: jnp.ndarray
    cache: KVCache
    taps: jnp.ndarray
    path: Optional[jnp.ndarray] = None
    accepted: Optional[jnp.ndarray] = None


def verify_widths(block_size: int):
    """The static verify widths a chain step chooses from under a confidence threshold: a
    quarter, half and the whole block (at least 2 tokens: x_last and one draft)."""
    return tuple(sorted({max(2, block_size // 4), max(2, block_size // 2), block_size}))


def verify_width_index(conf, threshold: float, block_size: int):
    """Which of `verify_widths` a step verifies: the narrowest that holds x_last and the
    longest run of drafts (from the first) at or above `threshold` in any row of the batch
    (drafts after a row's first low-confidence one are never accepted, so they need no
    verify). conf: [B, bs-1]."""
    run = jnp.sum(jnp.cumprod((conf >= threshold).astype(jnp.int32), axis=1), axis=1)
    need = jnp.max(run) + 1
    widths = jnp.asarray(verify_widths(block_size), jnp.int32)
    return jnp.argmax(widths >= need).astype(jnp.int32)


def _compact(cache: KVCache, path, start, impl: str = "xla") -> KVCache:
    """Moves the K/V of the accepted tree nodes (slots start + path[k]) to their positions'
    slots start + 1 + k, in every layer: the cache then holds what autoregressive decoding of
    the committed tokens would have written. The rows are written back as one block
    (`attention.write_block`: the Pallas DMA kernel under a TPU Pallas impl)."""
    if cache.stacked:  # [L, B, S, K*D]: layer by layer, each written where it lies
        rows = (jnp.arange(path.shape[0])[:, None], start[:, None] + path)

        def layer(i, kv):
            move = lambda x: attn_lib.write_block(
                x, x[(i, *rows)], start + 1, impl, cache.head_dim, layer=i
            )
            return tuple(move(x) for x in kv)

        k, v = jax.lax.fori_loop(0, cache.k.shape[0], layer, (cache.k, cache.v))
        return cache.replace(k=k, v=v)
    src = (start[:, None] + path)[..., None]
    move = lambda x: attn_lib.write_block(
        x, jnp.take_along_axis(x, src, axis=1), start + 1, impl, cache.head_dim
    )
    return cache.replace(k=tuple(move(x) for x in cache.k), v=tuple(move(x) for x in cache.v))


def _emit_stream(sink, y, n):
    y, n = np.asarray(y), np.asarray(n)
    sink([y[b, : n[b]].tolist() for b in range(y.shape[0])])


@flax.struct.dataclass
class Decoder:
    """One generation program's models and settings: the target (`tmod`, `tparams`), the
    drafter (`dmod`, `dparams`; None: autoregressive, a drafter that drafts nothing) and the
    static `plan`. A pytree whose leaves are the parameters (modules and plan are static), so it
    crosses `jax.jit` as one argument; built inside the programs from the parameters they take.
    """

    tparams: Any
    dparams: Any
    tmod: Transformer = flax.struct.field(pytree_node=False)
    dmod: Any = flax.struct.field(pytree_node=False)  # its kind: `registry.loop_of(dmod)`
    plan: Plan = flax.struct.field(pytree_node=False)

    def embed(self, ids):
        return self.tmod.apply({"params": self.tparams}, ids, method="embed")

    def lm_logits(self, hidden):
        return self.tmod.apply({"params": self.tparams}, hidden, method="logits")

    @property
    def kind(self):
        """The kind of drafter drafting in this loop (`drafters.registry.loop_of`:
        autoregressive, DFlash, DFlash 2, EAGLE-3, prompt lookup): what it keeps of the target
        and how it proposes."""
        return registry.loop_of(self.dmod)

    @property
    def samples_drafts(self) -> bool:
        """The drafter samples its drafts (at T > 0 with draft_sampling "sample": DFlash 2's
        and EAGLE-3's default, DFlash's choice): `propose` takes a key and the drafts are
        verified against their proposal distribution (`rejection_tokens`)."""
        return self.kind.samples_drafts(self)

    def propose(self, state: DecodeState, x_last, start, key=None) -> Proposal:
        """What this step verifies, as the drafter's kind proposes it (`drafters.base`): nothing but
        x_last (autoregressive), a chain of bs-1 tokens or a tree of `plan.tree_budget` nodes
        (DFlash), the candidate selector's chain (DFlash 2; sampled with `key` at T > 0, with
        its proposal q), a chain drafted token by token (EAGLE-3; sampled at T > 0 likewise)."""
        return self.kind.propose(self, state, x_last, start, key)

    def rejection_tokens(self, logits, prop: Proposal, key):
        """y [B, T] for drafts sampled from a proposal q (speculative sampling): draft d_i is
        accepted with probability min(1, p_i(d_i) / q_i(d_i)), p_i the target's adjusted
        distribution after the prefix ending at d_{i-1} (logits[:, i-1]); y[:, i-1] is d_i if
        accepted, else a sample of the residual norm(max(p_i - q_i, 0)) (over the whole
        vocabulary), which never names d_i; y[:, T-1] is a sample of p_T. `accept` then takes
        the longest prefix with y[:, i-1] == d_i, so each step emits target samples exactly.
        q over candidates (q_ids [B, bs-1, K]) or, q_ids None, over the vocabulary."""
        t = logits.shape[1]
        n = t - 1
        drafts = prop.drafts[:, :n]
        q_probs = prop.q_probs[:, :n]
        plan = self.plan
        logp = adjusted_logits(logits[:, :n], plan.temperature, plan.top_k, plan.top_p)
        p = jax.nn.softmax(logp, axis=-1)  # [B, n, V]
        p_d = jnp.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
        b = drafts.shape[0]
        if prop.q_ids is None:  # dense: q over the vocabulary in id order
            q_dense = q_probs.astype(jnp.float32)
            q_d = jnp.take_along_axis(q_dense, drafts[..., None], axis=-1)[..., 0]
        else:
            q_ids = prop.q_ids[:, :n]
            q_d = jnp.sum(jnp.where(q_ids == drafts[..., None], q_probs, 0.0), axis=-1)
            q_dense = (
                jnp.zeros(p.shape, jnp.float32)
                .at[jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None], q_ids]
                .add(q_probs.astype(jnp.float32))
            )
        k_u, k_res, k_bonus = jax.random.split(key, 3)
        u = jax.random.uniform(k_u, drafts.shape, jnp.float32)
        accept = u * q_d < p_d
        res = jnp.maximum(p - q_dense, 0.0)
        has = jnp.sum(res, axis=-1, keepdims=True) > 0
        res_log = jnp.where(has, jnp.log(res), logp)  # p == q exactly: never rejected anyway
        resampled = sample_categorical(k_res, res_log)
        bonus = pick_tokens(logits[:, n], k_bonus, plan.temperature, plan.top_k, plan.top_p)
        return jnp.concatenate([jnp.where(accept, drafts, resampled), bonus[:, None]], axis=1)

    def _verify_tokens(self, state: DecodeState, prop: Proposal, start, key) -> Verdict:
        tap_layers = self.kind.taps(self)
        variables = {"params": self.tparams}
        if prop.tree is None:
            hidden, cache, taps = self.tmod.apply(
                variables, prop.tokens, cache=state.cache, tap_layers=tap_layers
            )
        else:
            positions = start[:, None] + prop.depths
            hidden, cache, taps = self.tmod.apply(
                variables,
                prop.tokens,
                positions,
                state.cache,
                prop.tree.mask,
                tap_layers,
                method="verify_tree",
            )
        logits = self.lm_logits(hidden)  # [B, T, V]
        if prop.q_probs is not None:
            y = self.rejection_tokens(logits, prop, key)
        else:
            y = pick_tokens(logits, key, self.plan.temperature, self.plan.top_k, self.plan.top_p)
        return Verdict(y=y, cache=cache, taps=taps)

    def verify(self, state: DecodeState, prop: Proposal, start, key) -> Verdict:
        """One target pass over the proposal, its K/V appended to the cache at slots start ..
        start+T-1 (a chain: causal; a tree: each node sees the committed prefix and its own
        ancestors): the `Verdict`'s y [B, T] (the target's token after each proposed token),
        cache and taps [B, T, F] for the drafter.

        A chain under `confidence_threshold` verifies only the first w of its T tokens, w the
        narrowest of `verify_widths` that holds every row's trusted drafts (`lax.switch` over the
        widths): the confidence saves target compute, not only acceptance. y past w is -1 (never
        a draft) and the taps there 0 (never committed)."""
        if self.plan.confidence_threshold is None or prop.drafts is None:
            return self._verify_tokens(state, prop, start, key)
        bs = prop.tokens.shape[1]

        def narrow(w):
            def run():
                cut = prop.replace(tokens=prop.tokens[:, :w], depths=prop.depths[:, :w])
                v = self._verify_tokens(state, cut, start, key)
                pad = ((0, 0), (0, bs - w))
                y = jnp.pad(v.y, pad, constant_values=-1)
                taps = None if v.taps is None else jnp.pad(v.taps, pad + ((0, 0),))
                # One pending width for every branch (a hybrid target's cache).
                return Verdict(y=y, cache=v.cache.pad_pending(bs), taps=taps)

            return run

        idx = verify_width_index(prop.conf, self.plan.confidence_threshold, bs)
        return jax.lax.switch(idx, [narrow(w) for w in verify_widths(bs)])

    def accept(self, prop: Proposal, verdict: Verdict) -> Verdict:
        """The verdict with its accepted path ([B, L]: the proposal indices of the accepted
        drafts by depth, padded) and count a ([B]). The step commits y at [0, path[:a]]: a + 1
        target tokens."""
        y = verdict.y
        b = y.shape[0]
        if prop.tree is not None:
            path, a = accept_path(prop.tree, y, self.plan.block_size - 1)
            return verdict.replace(path=path, accepted=a)
        if prop.drafts is None:  # autoregressive
            zeros = jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32)
            return verdict.replace(path=zeros[0], accepted=zeros[1])
        trusted = None
        if self.plan.confidence_threshold is not None:
            # Trim the block at the first low-confidence draft: those drafts are never accepted
            # (still lossless; the bonus token comes from the target).
            trusted = prop.conf >= self.plan.confidence_threshold
        path = jnp.broadcast_to(
            jnp.arange(1, self.plan.block_size, dtype=jnp.int32)[None], prop.drafts.shape
        )
        return verdict.replace(path=path, accepted=accepted_prefix(prop.drafts, y, trusted))

    def commit(self, state: DecodeState, prop: Proposal, verdict: Verdict) -> DecodeState:
        """Commits y at the root and the accepted path (cut at max_new_tokens and at a stop token),
        rolls both caches back to the committed length (a tree's accepted K/V compacted into
        place first) and appends the accepted positions' taps to the drafter's context."""
        y, cache, taps, path, a = (
            verdict.y,
            verdict.cache,
            verdict.taps,
            verdict.path,
            verdict.accepted,
        )
        start = state.cache.lengths  # position of x_last, the last committed token
        b, n_buf = state.tokens.shape
        bidx = jnp.arange(b)
        nodes = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path], axis=1)  # [B, L+1]
        if prop.tree is not None:
            y = jnp.take_along_axis(y, nodes, axis=1)
            taps = jnp.take_along_axis(taps, nodes[..., None], axis=1)
            cache = _compact(cache, path, start, self.plan.attention_impl)
        width = nodes.shape[1]
        n = jnp.minimum(a + 1, state.max_new - state.num_out)
        idx = jnp.arange(width, dtype=jnp.int32)[None]
        is_stop = (
            jnp.isin(y, jnp.asarray(self.plan.stop_token_ids, jnp.int32)) & (idx < n[:, None])
            if self.plan.stop_token_ids
            else jnp.zeros_like(y, bool)
        )
        has_stop = jnp.any(is_stop, axis=1)
        n = jnp.where(has_stop, jnp.argmax(is_stop, axis=1) + 1, n)
        n = jnp.where(state.done, 0, n).astype(jnp.int32)
        write_at = jnp.where(idx < n[:, None], state.num_out[:, None] + idx, n_buf)
        tokens = state.tokens.at[bidx[:, None], write_at].set(y, mode="drop")
        new_len = start + n
        cache = cache.rollback(new_len)
        ids = jnp.take_along_axis(prop.tokens, nodes, axis=1)  # the committed positions' tokens
        ctx = self.kind.write_context(
            self, state.ctx, taps, ids, start[:, None] + idx, new_len, start
        )
        num_out = state.num_out + n
        if self.plan.stream is not None:
            # Optional host callback (only when streaming was asked for): committed tokens
            # y[b, :n[b]] of this step; ordered so the terminal sees them in sequence.
            jax.debug.callback(
                functools.partial(_emit_stream, self.plan.stream), y, n, ordered=True
            )
        drafts_rec = state.drafts
        if self.plan.return_drafts and prop.drafts is not None:
            drafts_rec = drafts_rec.at[state.step].set(prop.drafts)
        return state.replace(
            cache=cache,
            ctx=ctx,
            tokens=tokens,
            num_out=num_out,
            done=state.done | has_stop | (num_out >= state.max_new),
            step=state.step + 1,
            accepted=state.accepted.at[:, state.step].set(n),
            drafts=drafts_rec,
        )

    def step(self, state: DecodeState) -> DecodeState:
        """One draft -> verify -> accept -> commit iteration for the whole batch: autoregressive,
        chain and tree decoding are the same four methods over a `Proposal`."""
        start = state.cache.lengths  # position of x_last, the last committed token
        x_last = state.tokens[jnp.arange(state.tokens.shape[0]), state.num_out - 1]
        key, sub = jax.random.split(state.key)
        draft_key = None
        if self.samples_drafts:
            sub, draft_key = jax.random.split(sub)
        with jax.named_scope("draft"):
            prop = self.propose(state, x_last, start, draft_key)
        with jax.named_scope("verify"):
            verdict = self.verify(state, prop, start, sub)
        with jax.named_scope("accept"):
            verdict = self.accept(prop, verdict)
            state = self.commit(state, prop, verdict)
        return state.replace(key=key)

    def prefill(self, capacity: int, n_buf: int, prompts, prompt_lens, max_new, key) -> DecodeState:
        """The target over the right-padded prompts [B, P] (in chunks of `plan.prefill_chunk`)
        into a cache of `capacity` slots, the drafter's context filled from the taps, the first
        token sampled: the state the decode loop starts from (`n_buf` output slots)."""
        b, p = prompts.shape
        tap_layers = self.kind.taps(self)
        # Split by sequence where the mesh cannot split the heads; a tree's verify reads whole
        # (`prefill_plan` keeps the difference).
        cache = new_cache(self.tmod.cfg, b, capacity, seq_split=self.plan.tree_budget is None)
        ctx = self.kind.init_context(self, b, capacity)
        chunk = self.plan.prefill_chunk
        if not chunk or p <= chunk or p % chunk:
            chunk = p  # one pass
        bidx = jnp.arange(b)

        def prefill_chunk(carry, xs):
            """Target over prompt tokens [i*chunk, (i+1)*chunk), appended to the caches; keeps
            the final hidden state of each prompt's last token when it falls in this chunk."""
            cache, ctx, last = carry
            ids, i = xs
            start = i * chunk
            hidden, cache, taps = self.tmod.apply(
                {"params": self.tparams}, ids, cache=cache, tap_layers=tap_layers
            )
            cache = cache.settle(jnp.minimum(prompt_lens, cache.lengths))  # a recurrent state
            positions = start + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
            ctx = self.kind.write_context(
                self, ctx, taps, ids, positions, prompt_lens, jnp.full((b,), start, jnp.int32)
            )
            at = prompt_lens - 1 - start
            here = (at >= 0) & (at < chunk)
            last = jnp.where(here[:, None], hidden[bidx, jnp.clip(at, 0, chunk - 1)], last)
            return (cache, ctx, last), None

        with jax.named_scope("prefill"):
            last = jnp.zeros((b, self.tmod.cfg.hidden_size), self.tmod.cfg.dtype)
            if chunk == p:
                (cache, ctx, last), _ = prefill_chunk((cache, ctx, last), (prompts, 0))
            else:
                chunks = prompts.reshape(b, p // chunk, chunk).transpose(1, 0, 2)  # [n, B, chunk]
                (cache, ctx, last), _ = jax.lax.scan(
                    prefill_chunk,
                    (cache, ctx, last),
                    (chunks, jnp.arange(p // chunk, dtype=jnp.int32)),
                )
            cache = cache.rollback(prompt_lens)
            last = last[:, None]
            key, sub = jax.random.split(key)
            first = pick_tokens(
                self.lm_logits(last)[:, 0],
                sub,
                self.plan.temperature,
                self.plan.top_k,
                self.plan.top_p,
            )
        tokens = jnp.zeros((b, n_buf), jnp.int32).at[:, 0].set(first)
        stop = (
            jnp.isin(first, jnp.asarray(self.plan.stop_token_ids, jnp.int32))
            if self.plan.stop_token_ids
            else jnp.zeros((b,), bool)
        )
        num_out = jnp.ones((b,), jnp.int32)
        nd = n_buf if self.plan.return_drafts and self.dmod is not None else 0
        return DecodeState(
            cache=cache,
            ctx=ctx,
            tokens=tokens,
            num_out=num_out,
            done=stop | (num_out >= max_new),
            step=jnp.zeros((), jnp.int32),
            accepted=jnp.zeros((b, n_buf), jnp.int32),
            drafts=jnp.zeros((nd, b, self.plan.block_size - 1 if nd else 0), jnp.int32),
            key=key,
            max_new=max_new,
        )

    def decode(self, state: DecodeState) -> DecodeState:
        """`step` in one `lax.while_loop` until every sequence is done (or the buffer is full)."""
        n_buf = state.tokens.shape[1]

        def cond(s):
            return (~jnp.all(s.done)) & (s.step < n_buf)

        return jax.lax.while_loop(cond, self.step, state)
