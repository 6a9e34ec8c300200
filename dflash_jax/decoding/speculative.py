"""Speculative (DFlash) and autoregressive generation as two compiled programs.

(Over ~450 lines on purpose: the algorithm, spec_step inside one while_loop, its prefill and
the programs that compile them belong together; request checks and results live in
generate_io.py, warm-up and comparison in serving.py.)

  prefill  (jit): target forward over the (right-padded) prompts with taps; first token; the
                  drafter context cache filled with the prompt's context K/V.
  decode   (jit): one `lax.while_loop`; every iteration is `spec_step`:
                    draft   one drafter pass over [x_last, MASK * (bs-1)]  (or K denoise passes)
                    verify  one target pass over [x_last, d_1 .. d_{bs-1}] appended to the cache
                    accept  the longest prefix with d_i == y_{i-1}; commit y_0 .. y_a
                    roll back both caches to the committed length, append the new taps
                  until every sequence hit max_new_tokens or a stop token.
No host round trip per step. The autoregressive baseline is the same loop with an empty draft
(block of one token), through the same target code and cache. `generate_programs` wraps both in
`jax.jit`s with in/out shardings for a device mesh (`dflash_jax.parallel.sharding`'s rules; none on one
device); `generate_io` checks the request and reads the result back on the host.

Losslessness. At temperature 0, y_i is the target's argmax after the committed prefix, and we
commit only y's, so the output equals greedy autoregressive decoding token for token. At
temperature > 0, y_i is a fresh sample from the target's adjusted distribution given the prefix
[committed, d_1..d_i]; while d_i == y_{i-1} that prefix IS the committed sequence, so y_0..y_a
are successive samples from the target conditionals. This is speculative (rejection) sampling
with a one-hot draft distribution q = delta(d): accept d with probability min(1, p(d)/q(d)) =
p(d), i.e. exactly when an independent target sample equals d, and on rejection the residual
norm(max(p - q, 0)) is p with d removed: the distribution of y_{i} given y_{i} != d_{i+1}. So
every emitted token is distributed as the target's sample (tested statistically against an
independent reference in tests/test_sampled_lossless.py).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
from typing import Callable, List, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding.request import (
    GenerationResult,
    check_denoise,
    check_request,
    check_tree_request,
    collect,
    gather_multiprocess,
)
from dflash_jax.decoding.sampling import greedy_argmax, pick_tokens
from dflash_jax.decoding.tree import Tree, accept_path, build_tree
from dflash_jax.drafters.dflash import DFlashDrafter, Drafter, decode_attend
from dflash_jax.models import attention as attn_lib
from dflash_jax.models.transformer import KVCache, Transformer, flat_heads, write_kv
from dflash_jax.parallel import sharding
from dflash_jax.support import checks


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static settings of one compiled generation program (hashable: part of the jit key)."""

    block_size: int  # 1 = autoregressive
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    stop_ids: tuple = ()
    denoise_steps: int = 1
    # Which positions the K passes fix: "confidence" (the most confident still-masked ones) or
    # "fixed" (left to right); remask: a fixed low-confidence token may be masked again
    # (`_denoise`).
    denoise_schedule: str = "confidence"
    remask: bool = False
    confidence_threshold: Optional[float] = None
    record_drafts: bool = False
    # Verify a draft tree of this many nodes (`dflash_jax.decoding.tree`) instead of the chain.
    tree_budget: Optional[int] = None
    # Host function called with each step's commits (`generate`'s stream_callback), or None.
    # Part of the jit key: a program is compiled per function (reuse one to reuse the program).
    stream: Optional[Callable[[List[List[int]]], None]] = None
    attention_impl: str = "xla"
    # Prompts longer than this are prefilled in chunks of this many tokens (a scan appending to
    # the cache), so attention temporaries grow linearly with the context, not quadratically:
    # each chunk's scores are [chunk, capacity]. 0: one pass (dense [prompt, capacity] scores).
    prefill_chunk: int = 512


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


def _embed(tmod, tparams, ids):
    return tmod.apply({"params": tparams}, ids, method=Transformer.embed)


def _lm_logits(tmod, tparams, hidden):
    return tmod.apply({"params": tparams}, hidden, method=Transformer.logits)


def _write_context(
    dmod, dparams, ctx: KVCache, taps, positions, lengths, starts=None, impl: str = "xla"
) -> KVCache:
    """Projects taps [B,T,F] to per-layer context K/V and stores them at `positions`; with
    `starts` [B] (positions = starts[b] + arange(T)) through `attention.write_block` (the
    Pallas DMA kernel under a TPU Pallas `impl`)."""
    ck, cv = dmod.apply({"params": dparams}, taps, positions, method=DFlashDrafter.context_kv)
    if starts is None:
        write = lambda old, new: write_kv(old, flat_heads(new), positions)
    else:
        write = lambda old, new: attn_lib.write_block(
            old, flat_heads(new), starts, impl, ctx.head_dim
        )
    k = tuple(write(old, new) for old, new in zip(ctx.k, ck))
    v = tuple(write(old, new) for old, new in zip(ctx.v, cv))
    return ctx.replace(k=k, v=v, lengths=lengths)


def _draft_logits(tmod, tparams, dmod, dparams, ctx: KVCache, x_last, tokens, start, plan: Plan):
    """One drafter pass over [x_last, tokens] (tokens [B, bs-1]: MASK where not yet drafted) at
    positions start + arange(bs): the logits [B, bs-1, V] of the block positions after x_last."""
    positions = start[:, None] + jnp.arange(plan.block_size, dtype=jnp.int32)[None]
    attend = decode_attend(ctx.lengths, plan.attention_impl)
    block = jnp.concatenate([x_last[:, None], tokens], axis=1)
    hidden = dmod.apply(
        {"params": dparams}, _embed(tmod, tparams, block), positions, ctx.k, ctx.v, attend
    )
    return _lm_logits(tmod, tparams, hidden[:, 1:])


def _denoise(tmod, tparams, dmod, dparams, ctx: KVCache, x_last, start, plan: Plan, logp=False):
    """The K = `plan.denoise_steps` drafter passes over one block: (drafts [B, bs-1],
    confidence [B, bs-1], log-probs [B, bs-1, V] or None).

    After pass j < K, n_j = round((bs-1) j / K) positions hold a drafted token (its MASK
    embedding replaced by the token's) and the rest stay MASK for the next pass; the last pass
    fills every position still masked. Which positions are fixed (`plan.denoise_schedule`):
      "confidence": the n_j - n_{j-1} most confident (max probability) still-masked ones;
      "fixed": the first n_j, left to right (a fixed count per pass, whatever the confidence).
    `plan.remask` ("confidence" only): after pass j < K the n_j kept are the most confident of
    all positions, the fixed tokens scored by the confidence they were drafted with and the
    masked ones by this pass's, so a fixed token that later predictions outrank is masked again
    and predicted again in a later pass (it never changes a committed token: only drafts).
    Each position's confidence and log-probs are those of the pass that drafted its final
    token (the last pass for the positions it fills): what a draft tree is built from.
    """
    bs = plan.block_size
    b = x_last.shape[0]
    mask_id = jnp.int32(dmod.cfg.mask_token_id)
    tokens = jnp.full((b, bs - 1), mask_id, jnp.int32)
    fixed = jnp.zeros((b, bs - 1), bool)
    conf = jnp.zeros((b, bs - 1), jnp.float32)
    out_lp = None
    steps = plan.denoise_steps
    need_conf = steps > 1 or plan.confidence_threshold is not None
    for j in range(1, steps + 1):
        logits = _draft_logits(tmod, tparams, dmod, dparams, ctx, x_last, tokens, start, plan)
        pred = greedy_argmax(logits)
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1) if logp else None
        if lp is not None and need_conf:
            p_max = jnp.exp(jnp.max(lp, axis=-1))
        elif need_conf:
            p_max = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
        else:
            p_max = jnp.ones(pred.shape, jnp.float32)  # confidence unused: skip the softmax
        n_j = int(round((bs - 1) * j / steps))
        keep = None
        if j == steps:
            newly = ~fixed
        elif plan.denoise_schedule == "fixed":
            newly = (jnp.arange(bs - 1)[None] < n_j) & ~fixed
        elif plan.remask:
            score = jnp.where(fixed, conf, p_max)
            top = jax.lax.top_k(score, max(n_j, 1))[1]
            keep = jnp.zeros_like(fixed).at[jnp.arange(b)[:, None], top].set(n_j > 0)
            newly = keep & ~fixed
        else:
            m = n_j - int(round((bs - 1) * (j - 1) / steps))
            score = jnp.where(fixed, -jnp.inf, p_max)
            top = jax.lax.top_k(score, max(m, 1))[1]
            newly = jnp.zeros_like(fixed).at[jnp.arange(b)[:, None], top].set(m > 0)
        tokens = jnp.where(newly, pred, tokens)
        conf = jnp.where(newly, p_max, conf)
        if lp is not None:
            out_lp = lp if out_lp is None else jnp.where(newly[..., None], lp, out_lp)
        fixed = fixed | newly
        if keep is not None:  # remasked: back to MASK, predicted again by a later pass
            tokens = jnp.where(keep, tokens, mask_id)
            fixed = keep
    return tokens, conf, out_lp


def draft_block(tmod, tparams, dmod, dparams, ctx: KVCache, x_last, start, plan: Plan):
    """Drafts bs-1 tokens after x_last. Returns (drafts [B, bs-1], confidence [B, bs-1]).

    denoise_steps = 1: DFlash's single pass. K > 1: K masked-diffusion passes (`_denoise`: the
    positions fixed after each pass by confidence or left to right, optionally remasked).
    """
    tokens, conf, _ = _denoise(tmod, tparams, dmod, dparams, ctx, x_last, start, plan)
    return tokens, conf


def accepted_prefix(drafts, y, trusted=None):
    """Number of drafts accepted: the longest prefix with d_i == y_{i-1}. drafts [B, bs-1],
    y [B, bs] target tokens at the block positions; trusted [B, bs-1] optional cap."""
    match = drafts == y[:, :-1]
    if trusted is not None:
        match &= trusted
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)


@flax.struct.dataclass
class Proposal:
    """What one step gives the target to verify: T tokens at positions start + depths (the
    last committed token x_last first, at depth 0), and how they were drafted."""

    tokens: jnp.ndarray  # [B, T]
    depths: jnp.ndarray  # [B, T]
    drafts: Optional[jnp.ndarray] = None  # [B, bs-1] a chain's drafts (None: AR or a tree)
    conf: Optional[jnp.ndarray] = None  # [B, bs-1] their confidence
    tree: Optional[Tree] = None  # a draft tree (its mask is the verify's), None: a chain


def draft_logprobs(tmod, tparams, dmod, dparams, ctx: KVCache, x_last, start, plan: Plan):
    """The drafter's log-probabilities [B, bs-1, V] at the block positions after x_last: what a
    draft tree is built from. One pass over [x_last, MASK * (bs-1)], or with denoise_steps K > 1
    the K passes of `_denoise`, each position's log-probs from the pass that drafted it (the
    last pass for the positions still masked before it)."""
    if plan.denoise_steps == 1:
        masks = jnp.full((x_last.shape[0], plan.block_size - 1), dmod.cfg.mask_token_id, jnp.int32)
        logits = _draft_logits(tmod, tparams, dmod, dparams, ctx, x_last, masks, start, plan)
        return jax.nn.log_softmax(logits, axis=-1)
    return _denoise(tmod, tparams, dmod, dparams, ctx, x_last, start, plan, logp=True)[2]


def propose(tmod, tparams, dmod, dparams, plan: Plan, state: DecodeState, x_last, start):
    """Draft: nothing (autoregressive: a drafter that drafts nothing), a chain of bs-1 tokens,
    or a tree of `plan.tree_budget` nodes from the same drafter pass(es)."""
    b = x_last.shape[0]
    if dmod is None:
        return Proposal(tokens=x_last[:, None], depths=jnp.zeros((b, 1), jnp.int32))
    if plan.tree_budget:
        logp = draft_logprobs(tmod, tparams, dmod, dparams, state.ctx, x_last, start, plan)
        tree = build_tree(x_last, logp, plan.tree_budget)
        return Proposal(tokens=tree.tokens, depths=tree.depths, tree=tree)
    drafts, conf = draft_block(tmod, tparams, dmod, dparams, state.ctx, x_last, start, plan)
    bs = plan.block_size
    depths = jnp.broadcast_to(jnp.arange(bs, dtype=jnp.int32)[None], (b, bs))
    tokens = jnp.concatenate([x_last[:, None], drafts], axis=1)
    return Proposal(tokens=tokens, depths=depths, drafts=drafts, conf=conf)


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


def _verify_tokens(tmod, tparams, dmod, plan: Plan, state: DecodeState, prop, start, key):
    tap_layers = dmod.cfg.target_layer_ids if dmod is not None else ()
    extra = {}
    if prop.tree is not None:
        extra = dict(positions_BT=start[:, None] + prop.depths, tree_mask_BTT=prop.tree.mask)
    hidden, cache, taps = tmod.apply(
        {"params": tparams}, prop.tokens, cache=state.cache, tap_layers=tap_layers, **extra
    )
    logits = _lm_logits(tmod, tparams, hidden)  # [B, T, V]
    y = pick_tokens(logits, key, plan.temperature, plan.top_k, plan.top_p)
    return y, cache, taps


def verify(tmod, tparams, dmod, plan: Plan, state: DecodeState, prop: Proposal, start, key):
    """One target pass over the proposal, its K/V appended to the cache at slots start ..
    start+T-1 (a chain: causal; a tree: each node sees the committed prefix and its own
    ancestors). Returns (y [B, T]: the target's token after each proposed token, the cache,
    the taps [B, T, F] for the drafter).

    A chain under `confidence_threshold` verifies only the first w of its T tokens, w the
    narrowest of `verify_widths` that holds every row's trusted drafts (`lax.switch` over the
    widths): the confidence saves target compute, not only acceptance. y past w is -1 (never
    a draft) and the taps there 0 (never committed)."""
    if plan.confidence_threshold is None or prop.drafts is None:
        return _verify_tokens(tmod, tparams, dmod, plan, state, prop, start, key)
    bs = prop.tokens.shape[1]

    def narrow(w):
        def run():
            cut = prop.replace(tokens=prop.tokens[:, :w], depths=prop.depths[:, :w])
            y, cache, taps = _verify_tokens(tmod, tparams, dmod, plan, state, cut, start, key)
            pad = ((0, 0), (0, bs - w))
            y = jnp.pad(y, pad, constant_values=-1)
            return y, cache, jnp.pad(taps, pad + ((0, 0),))

        return run

    idx = verify_width_index(prop.conf, plan.confidence_threshold, bs)
    return jax.lax.switch(idx, [narrow(w) for w in verify_widths(bs)])


def accept(plan: Plan, prop: Proposal, y):
    """(path [B, L]: the proposal indices of the accepted drafts by depth, padded; a [B]: how
    many were accepted). The step commits y at [0, path[:a]]: a + 1 target tokens."""
    b = y.shape[0]
    if prop.tree is not None:
        return accept_path(prop.tree, y, plan.block_size - 1)
    if prop.drafts is None:  # autoregressive
        return jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32)
    trusted = None
    if plan.confidence_threshold is not None:
        # Trim the block at the first low-confidence draft: those drafts are never accepted
        # (still lossless; the bonus token comes from the target).
        trusted = prop.conf >= plan.confidence_threshold
    path = jnp.broadcast_to(
        jnp.arange(1, plan.block_size, dtype=jnp.int32)[None], prop.drafts.shape
    )
    return path, accepted_prefix(prop.drafts, y, trusted)


def _compact(cache: KVCache, path, start, impl: str = "xla") -> KVCache:
    """Moves the K/V of the accepted tree nodes (slots start + path[k]) to their positions'
    slots start + 1 + k, in every layer: the cache then holds what autoregressive decoding of
    the committed tokens would have written. The rows are written back as one block
    (`attention.write_block`: the Pallas DMA kernel under a TPU Pallas impl)."""
    src = (start[:, None] + path)[..., None]
    move = lambda x: attn_lib.write_block(
        x, jnp.take_along_axis(x, src, axis=1), start + 1, impl, cache.head_dim
    )
    return cache.replace(k=tuple(move(x) for x in cache.k), v=tuple(move(x) for x in cache.v))


def commit(dmod, dparams, plan: Plan, state: DecodeState, prop, y, path, a, cache, taps, start):
    """Commits y at the root and the accepted path (cut at max_new_tokens and at a stop token),
    rolls both caches back to the committed length (a tree's accepted K/V compacted into
    place first) and appends the accepted positions' taps to the drafter's context."""
    b, n_buf = state.tokens.shape
    bidx = jnp.arange(b)
    nodes = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path], axis=1)  # [B, L+1]
    if prop.tree is not None:
        y = jnp.take_along_axis(y, nodes, axis=1)
        taps = jnp.take_along_axis(taps, nodes[..., None], axis=1)
        cache = _compact(cache, path, start, plan.attention_impl)
    width = nodes.shape[1]
    n = jnp.minimum(a + 1, state.max_new - state.num_out)
    idx = jnp.arange(width, dtype=jnp.int32)[None]
    is_stop = (
        jnp.isin(y, jnp.asarray(plan.stop_ids, jnp.int32)) & (idx < n[:, None])
        if plan.stop_ids
        else jnp.zeros_like(y, bool)
    )
    has_stop = jnp.any(is_stop, axis=1)
    n = jnp.where(has_stop, jnp.argmax(is_stop, axis=1) + 1, n)
    n = jnp.where(state.done, 0, n).astype(jnp.int32)
    write_at = jnp.where(idx < n[:, None], state.num_out[:, None] + idx, n_buf)
    tokens = state.tokens.at[bidx[:, None], write_at].set(y, mode="drop")
    new_len = start + n
    cache = cache.rollback(new_len)
    ctx = state.ctx
    if dmod is not None:
        positions = start[:, None] + idx
        ctx = _write_context(
            dmod, dparams, ctx, taps, positions, new_len, start, plan.attention_impl
        )
    num_out = state.num_out + n
    if plan.stream is not None:
        # Optional host callback (only when streaming was asked for): committed tokens
        # y[b, :n[b]] of this step; ordered so the terminal sees them in sequence.
        jax.debug.callback(functools.partial(_emit_stream, plan.stream), y, n, ordered=True)
    drafts_rec = state.drafts
    if plan.record_drafts and prop.drafts is not None:
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


def spec_step(tmod, tparams, dmod, dparams, plan: Plan, state: DecodeState) -> DecodeState:
    """One draft -> verify -> accept -> commit iteration for the whole batch: autoregressive,
    chain and tree decoding are the same four functions over a `Proposal`."""
    start = state.cache.lengths  # position of x_last, the last committed token
    x_last = state.tokens[jnp.arange(state.tokens.shape[0]), state.num_out - 1]
    key, sub = jax.random.split(state.key)
    with jax.named_scope("draft"):
        prop = propose(tmod, tparams, dmod, dparams, plan, state, x_last, start)
    with jax.named_scope("verify"):
        y, cache, taps = verify(tmod, tparams, dmod, plan, state, prop, start, sub)
    with jax.named_scope("accept"):
        path, a = accept(plan, prop, y)
        state = commit(dmod, dparams, plan, state, prop, y, path, a, cache, taps, start)
    return state.replace(key=key)


def _emit_stream(sink, y, n):
    y, n = np.asarray(y), np.asarray(n)
    sink([y[b, : n[b]].tolist() for b in range(y.shape[0])])


def _prefill(
    tmod,
    dmod,
    plan: Plan,
    capacity: int,
    n_buf: int,
    tparams,
    dparams,
    prompts,
    prompt_lens,
    max_new,
    key,
) -> DecodeState:
    b, p = prompts.shape
    tap_layers = dmod.cfg.target_layer_ids if dmod is not None else ()
    cache = KVCache.create(tmod.cfg, b, capacity)
    ctx = None if dmod is None else KVCache.create(dmod.cfg, b, capacity)
    chunk = plan.prefill_chunk
    if not chunk or p <= chunk or p % chunk:
        chunk = p  # one pass
    bidx = jnp.arange(b)

    def prefill_chunk(carry, xs):
        """Target over prompt tokens [i*chunk, (i+1)*chunk), appended to the caches; keeps
        the final hidden state of each prompt's last token when it falls in this chunk."""
        cache, ctx, last = carry
        ids, i = xs
        start = i * chunk
        hidden, cache, taps = tmod.apply(
            {"params": tparams}, ids, cache=cache, tap_layers=tap_layers
        )
        if dmod is not None:
            positions = start + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
            ctx = _write_context(
                dmod,
                dparams,
                ctx,
                taps,
                positions,
                prompt_lens,
                jnp.full((b,), start, jnp.int32),
                plan.attention_impl,
            )
        at = prompt_lens - 1 - start
        here = (at >= 0) & (at < chunk)
        last = jnp.where(here[:, None], hidden[bidx, jnp.clip(at, 0, chunk - 1)], last)
        return (cache, ctx, last), None

    with jax.named_scope("prefill"):
        last = jnp.zeros((b, tmod.cfg.hidden_size), tmod.cfg.dtype)
        if chunk == p:
            (cache, ctx, last), _ = prefill_chunk((cache, ctx, last), (prompts, 0))
        else:
            chunks = prompts.reshape(b, p // chunk, chunk).transpose(1, 0, 2)  # [n, B, chunk]
            (cache, ctx, last), _ = jax.lax.scan(
                prefill_chunk, (cache, ctx, last), (chunks, jnp.arange(p // chunk, dtype=jnp.int32))
            )
        cache = cache.rollback(prompt_lens)
        last = last[:, None]
        key, sub = jax.random.split(key)
        first = pick_tokens(
            _lm_logits(tmod, tparams, last)[:, 0], sub, plan.temperature, plan.top_k, plan.top_p
        )
    tokens = jnp.zeros((b, n_buf), jnp.int32).at[:, 0].set(first)
    stop = (
        jnp.isin(first, jnp.asarray(plan.stop_ids, jnp.int32))
        if plan.stop_ids
        else jnp.zeros((b,), bool)
    )
    num_out = jnp.ones((b,), jnp.int32)
    nd = n_buf if plan.record_drafts and dmod is not None else 0
    return DecodeState(
        cache=cache,
        ctx=ctx,
        tokens=tokens,
        num_out=num_out,
        done=stop | (num_out >= max_new),
        step=jnp.zeros((), jnp.int32),
        accepted=jnp.zeros((b, n_buf), jnp.int32),
        drafts=jnp.zeros((nd, b, plan.block_size - 1 if nd else 0), jnp.int32),
        key=key,
        max_new=max_new,
    )


def _decode(tmod, dmod, plan: Plan, tparams, dparams, state: DecodeState) -> DecodeState:
    n_buf = state.tokens.shape[1]

    def cond(s):
        return (~jnp.all(s.done)) & (s.step < n_buf)

    return jax.lax.while_loop(
        cond, functools.partial(spec_step, tmod, tparams, dmod, dparams, plan), state
    )


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, int(n - 1).bit_length()))


# Cache capacities are multiples of the decode kernels' KV tile (the TPU kernel's 512-slot tile;
# 128 below it), so no kernel pads, i.e. copies, a cache to its tile in any step.
KV_TILE, KV_TILE_SMALL = 512, 128


def cache_capacity(slots: int) -> int:
    """`slots` rounded up to a multiple of the KV tile (of 128 while under one tile)."""
    tile = KV_TILE if slots > KV_TILE else KV_TILE_SMALL
    return -(-int(slots) // tile) * tile


def buffer_sizes(prompt_len: int, max_new_tokens: int, block_size: int):
    """(p_pad, n_buf, capacity) of one program: the prompt bucket, the output buffer and the
    cache slots. Bucketed (powers of two) so that other lengths within a bucket reuse the
    compiled program. n_buf >= max_new_tokens is enough: a row is done once it holds
    max_new_tokens tokens, so a block never writes past p_pad + n_buf - 2 + block_size."""
    p_pad = _bucket(int(prompt_len), 16)
    n_buf = _bucket(int(max_new_tokens), 32)
    return p_pad, n_buf, cache_capacity(p_pad + n_buf + int(block_size))


def generate_programs(
    tmod,
    dmod,
    plan: Plan,
    capacity: int,
    n_buf: int,
    mesh,
    tparams,
    dparams,
    batch: int,
    prompt_len: int,
):
    """(prefill_jit, decode_jit, shardings): `_prefill` and `_decode` (plain functions: these
    are their only `jax.jit`s; the decode state donated) with in/out shardings fixed for
    `mesh`: parameters by the partition rules, prompts and per-sequence state over the batch
    axes, caches B over batch and K over tensor; GSPMD propagates them through the layers and the `while_loop`. With
    `mesh=None` (one device) no shardings are fixed and `shardings` is None.

    shardings: dict(tparams, dparams, ids, lens, state, state_shape, arg_shapes), for lowering
    on abstract values (`sharding.with_shardings`). `tparams` / `dparams` may be shapes.
    """

    def prefill(tp, dp, ids, lens, max_new, key):
        return _prefill(tmod, dmod, plan, capacity, n_buf, tp, dp, ids, lens, max_new, key)

    def decode(tp, dp, state):
        return _decode(tmod, dmod, plan, tp, dp, state)

    if mesh is None:
        return jax.jit(prefill), jax.jit(decode, donate_argnums=(2,)), None
    tsh = sharding.param_shardings(tparams, mesh, sharding.target_rules(), tmod.cfg.head_dim)
    dsh = (
        None
        if dparams is None
        else sharding.param_shardings(
            dparams, mesh, sharding.target_rules(), dmod.cfg.body.head_dim
        )
    )
    repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    ids_sh = jax.sharding.NamedSharding(mesh, sharding.batch_spec((batch, prompt_len), mesh))
    lens_sh = jax.sharding.NamedSharding(mesh, sharding.batch_spec((batch,), mesh))
    arg_shapes = (
        jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.eval_shape(lambda: jax.random.PRNGKey(0)),
    )
    with sharding.compiling_for(mesh):  # traces the prefill: kernels for the mesh's platform
        state_shape = jax.eval_shape(prefill, tparams, dparams, *arg_shapes)
    state_sh = sharding.decode_state_sharding(state_shape, mesh)
    prefill_jit = jax.jit(
        prefill, in_shardings=(tsh, dsh, ids_sh, lens_sh, repl, repl), out_shardings=state_sh
    )
    decode_jit = jax.jit(
        decode, in_shardings=(tsh, dsh, state_sh), out_shardings=state_sh, donate_argnums=(2,)
    )
    shardings = dict(
        tparams=tsh,
        dparams=dsh,
        ids=ids_sh,
        lens=lens_sh,
        state=state_sh,
        state_shape=state_shape,
        arg_shapes=arg_shapes,
    )
    return prefill_jit, decode_jit, shardings


class _Compiled:
    """AOT-compiled (prefill, decode) executables keyed by their static configuration, so
    compile time is measured apart and new prompt lengths within a bucket never recompile.
    Bounded: at most `max_entries` configurations stay compiled (least recently used goes
    first), so a long-lived process (a server, a notebook sweeping settings) does not keep
    every program it ever built; `DFLASH_COMPILED_PROGRAMS` sets the bound (default 16).
    Programs that stream keep only the latest callback's (a new function each call would
    otherwise keep every program alive)."""

    cache: "collections.OrderedDict" = collections.OrderedDict()
    max_entries: int = int(os.environ.get("DFLASH_COMPILED_PROGRAMS", "16"))

    @classmethod
    def get(cls, key, build):
        """(executables, seconds spent compiling now: 0 on a hit). key[2] is the Plan."""
        if key in cls.cache:
            cls.cache.move_to_end(key)
            return cls.cache[key], 0.0
        if key[2].stream is not None:
            for old in [k for k in cls.cache if k[2].stream not in (None, key[2].stream)]:
                del cls.cache[old]
        t0 = time.perf_counter()
        built = build()
        cls.cache[key] = built
        while len(cls.cache) > max(1, cls.max_entries):
            cls.cache.popitem(last=False)
        return built, time.perf_counter() - t0


def generate(
    target,
    drafter: Optional[Drafter],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    block_size: Optional[int] = None,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: int = 0,
    stop_token_ids: Sequence[int] = (),
    denoise_steps: int = 1,
    confidence_threshold: Optional[float] = None,
    return_drafts: bool = False,
    attention_impl: Optional[str] = None,
    stream_callback: Optional[Callable[[List[List[int]]], None]] = None,
    mesh=None,
    prefill_chunk: Optional[int] = None,
    tree_budget: Optional[int] = None,
    denoise_schedule: str = "confidence",
    remask: bool = False,
) -> GenerationResult:
    """Generates continuations of `prompts` (lists of token ids) with DFlash, or
    autoregressively when `drafter` is None. See `GenerationResult` for what it returns.

    stream_callback: called on the host with, per sequence, the token ids just committed: once
    after prefill (the first token), then after every decode step. Concatenated, the calls give
    `result.tokens`. Streaming adds one host callback per step; leave it None for speed.
    mesh: a `jax.sharding.Mesh` (see `dflash_jax.parallel.sharding.make_mesh`): the same programs run
    sharded on it (parameters by the partition rules, batch over data axes, KV heads over
    `tensor`); stats then also name the mesh and the cache sharding.
    prefill_chunk: prompts longer than this are prefilled this many tokens at a time (default
    `Plan.prefill_chunk`; 0: one pass). Same tokens either way.
    tree_budget: verify a draft tree of this many nodes per step (`dflash_jax.decoding.tree`: the most
    probable prefixes of depth <= block_size - 1 under the drafter's one pass) instead of the
    chain of block_size - 1 drafts; None: the chain. Same tokens either way (lossless). With
    denoise_steps > 1 the tree is built from the K passes' distributions (`draft_logprobs`).
    denoise_schedule: which positions each of the denoise_steps passes fixes, "confidence"
    (the most confident) or "fixed" (left to right); remask: a fixed low-confidence token may
    be masked and predicted again (denoise_steps >= 3, "confidence"). They change the drafts,
    never the output.
    """
    # Every argument checked (types, ranges, ids in the vocabulary) before any compute.
    v = check_request(
        target,
        drafter,
        prompts,
        max_new_tokens,
        block_size,
        temperature,
        top_k,
        top_p,
        seed,
        stop_token_ids,
        denoise_steps,
        confidence_threshold,
    )
    prompts, max_new_tokens, bs = v["prompts"], v["max_new_tokens"], v["block_size"]
    temperature = v["temperature"]
    tree_budget = check_tree_request(target, drafter, bs, tree_budget, v, return_drafts)
    denoise_schedule, remask = check_denoise(
        denoise_schedule, remask, v["denoise_steps"], has_drafter=drafter is not None
    )
    if prefill_chunk is not None:
        checks.int_param("prefill_chunk", prefill_chunk, lo=0)
    if mesh is not None:
        sharding.check_expert_axis(mesh.shape.get("expert", 1), target.config.num_experts)
    plan = Plan(
        block_size=bs,
        temperature=float(temperature),
        top_k=None if temperature == 0 else v["top_k"],
        top_p=None if temperature == 0 else v["top_p"],
        stop_ids=v["stop_token_ids"],
        denoise_steps=v["denoise_steps"] if drafter is not None else 1,
        denoise_schedule=denoise_schedule if drafter is not None else "confidence",
        remask=remask and drafter is not None,
        confidence_threshold=v["confidence_threshold"] if drafter is not None else None,
        record_drafts=bool(return_drafts and drafter is not None),
        tree_budget=tree_budget,
        stream=stream_callback,
        # "pallas"/"auto" made concrete for the devices compiled for (the mesh's).
        attention_impl=attn_lib.for_devices(attention_impl or target.attention_impl, mesh),
        **({} if prefill_chunk is None else {"prefill_chunk": int(prefill_chunk)}),
    )
    b = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    width = bs if tree_budget is None else tree_budget + 1  # cache slots one step writes
    p_pad, n_buf, capacity = buffer_sizes(int(lens.max()), max_new_tokens, width)
    ids = np.zeros((b, p_pad), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p

    tmod = Transformer(target.config, plan.attention_impl)
    dmod = DFlashDrafter(drafter.config) if drafter is not None else None
    tparams = target.params
    dparams = drafter.params if drafter is not None else None
    args = (
        jnp.asarray(ids),
        jnp.asarray(lens),
        jnp.asarray(max_new_tokens, jnp.int32),
        jax.random.PRNGKey(v["seed"]),
    )
    key = (
        tmod,
        dmod,
        plan,
        b,
        p_pad,
        n_buf,
        capacity,
        mesh,
        jax.tree_util.tree_structure(tparams),
        jax.tree_util.tree_structure(dparams),
    )

    def build():
        prefill_jit, decode_jit, sh = generate_programs(
            tmod, dmod, plan, capacity, n_buf, mesh, tparams, dparams, b, p_pad
        )
        if sh is None:  # one device: lowered on the arrays as they are placed
            state = jax.eval_shape(prefill_jit, tparams, dparams, *args)
            return (
                prefill_jit.lower(tparams, dparams, *args).compile(),
                decode_jit.lower(tparams, dparams, state).compile(),
                None,
            )
        repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        arg_sh = (sh["ids"], sh["lens"], repl, repl)
        # Lowered on shapes: the arrays may be placed otherwise (e.g. a trainer's FSDP
        # layout); they are moved to the programs' shardings below.
        shapes = lambda tree: jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree
        )
        tp_s, dp_s = shapes(tparams), shapes(dparams)
        with sharding.compiling_for(mesh):  # kernels for the mesh's platform
            return (
                prefill_jit.lower(tp_s, dp_s, *shapes(args)).compile(),
                decode_jit.lower(tp_s, dp_s, sh["state_shape"]).compile(),
                (sh["tparams"], sh["dparams"], arg_sh),
            )

    (prefill_x, decode_x, placement), compile_s = _Compiled.get(key, build)
    if placement is not None:  # put parameters and inputs where the sharded programs want them
        from dflash_jax.parallel import distributed  # put: also across processes (pod hosts)

        tsh, dsh, arg_sh = placement
        tparams = distributed.put(tparams, tsh)
        dparams = None if dparams is None else distributed.put(dparams, dsh)
        args = tuple(distributed.put(a, s) for a, s in zip(args, arg_sh))

    t0 = time.perf_counter()
    state = prefill_x(tparams, dparams, *args)
    jax.block_until_ready(state.tokens)
    t1 = time.perf_counter()
    if stream_callback is not None:
        stream_callback([[int(t)] for t in np.asarray(state.tokens[:, 0])])
    state = decode_x(tparams, dparams, state)
    jax.block_until_ready(state.tokens)
    jax.effects_barrier()
    t2 = time.perf_counter()
    times = (t1 - t0, t2 - t1, compile_s)
    if mesh is not None and jax.process_count() > 1:
        state, times = gather_multiprocess(state, plan, times)
    result = collect(state, plan, b, prefill_s=times[0], decode_s=times[1], compile_s=times[2])
    if mesh is not None:
        result.stats.update(
            mesh=sharding.mesh_str(mesh), cache_sharding=str(state.cache.k[0].sharding.spec)
        )
    return result
