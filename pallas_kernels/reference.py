"""Plain-XLA reference implementations (the source of truth).

The one masked GQA attention (`gqa_attention`) and the one DFlash training mask
(`training_mask`) live here, with the kernels they check: the library imports them (its "xla"
attention is `gqa_attention`, re-exported as `dflash_jax.models.layers.masked_attention`; the trainer's
mask is this `training_mask`), and this package imports nothing from the library. The module
adds the decoding masks and the (q, k, v, ...) signatures the kernels share.

Layout everywhere: [batch, length, heads, head_dim] ("BTHD").  GQA: query
head h uses kv head h // G with G = Hq // Hkv.  Scores and softmax are in
float32 (matmuls at HIGHEST precision), the output is cast to q.dtype.
Rows that see no key at all produce 0 (and zero gradients), never NaN.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ._common import NEG

_HI = jax.lax.Precision.HIGHEST
# Large negative instead of -inf so fully masked rows give a uniform (then zeroed) softmax,
# never NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def gqa_attention(
    q_BTND, k_BSKD, v_BSKD, mask_BTS, sm_scale: Optional[float] = None, *, precision=None
):
    """GQA attention with an explicit boolean mask; softmax in float32. The one XLA reference:
    the model's "xla" attention (`dflash_jax.models.layers.masked_attention`), and what the kernels are
    checked against (`masked_attention` below: in float32 at `precision=HIGHEST`).

    q [B,T,N,D], k/v [B,S,K,D] (query head h reads kv head h // (N // K)); mask: bool,
    broadcastable to [B,T,S], True = query t may attend to key s. Returns [B,T,N,D] in q's
    dtype. Rows whose mask is all False return zeros (and zero gradients), never NaN.
    """
    b, t, n, d = q_BTND.shape
    kh = k_BSKD.shape[2]
    if n % kh:
        raise ValueError(f"{n} query heads must be a multiple of {kh} key/value heads")
    g = n // kh
    scale = d**-0.5 if sm_scale is None else sm_scale
    s = k_BSKD.shape[1]
    # Per KV head, its g query heads and the t queries as one [t*g, d] operand: a few large
    # batched dots over leading [B, K] (XLA:CPU runs the [B, K, G]-batched [t, d] x [d, s]
    # form 3.4x slower at t=512, s=1024, g=3); the same function.
    q = q_BTND.reshape(b, t, kh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, d)
    k = k_BSKD.transpose(0, 2, 1, 3)  # [B, K, S, D]
    v = v_BSKD.transpose(0, 2, 1, 3)
    logits = (
        jnp.einsum("bkqd,bksd->bkqs", q, k, precision=precision, preferred_element_type=jnp.float32)
        * scale
    )
    mask = jnp.broadcast_to(mask_BTS, (b, t, s))[:, None, :, None, :]  # [B, 1, T, 1, S]
    logits = logits.reshape(b, kh, t, g, s)
    logits = jnp.where(mask, logits, _MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(mask, probs, 0.0).astype(v_BSKD.dtype).reshape(b, kh, t * g, s)
    out = jnp.einsum(
        "bkqs,bksd->bkqd", probs, v, precision=precision, preferred_element_type=jnp.float32
    )
    out = out.reshape(b, kh, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, n, d).astype(q_BTND.dtype)


def training_mask(
    anchors_BN,
    block_valid_BN,
    block_size: int,
    ctx_len: int,
    segment_ids_BS: Optional[jnp.ndarray] = None,
    ctx_start_BN: Optional[jnp.ndarray] = None,
    window: Optional[int] = None,
    causal: bool = False,
):
    """The DFlash training attention mask, [B, N*bs, ctx_len + N*bs] bool (True = may attend).
    The one reference of it: the library's "xla" training attention uses it
    (`dflash_jax.training.masks.training_mask`), and the fused training kernels are checked
    against it.

    Query row r belongs to block n = r // bs with anchor p = anchors[b, n]. Keys are the
    ctx_len context features followed by the N*bs block keys (same row order). Row r sees
      context j  iff  j < p  (STRICTLY: the anchor's own feature is not context; seeing it
                      would leak x_{p+1})  and, with segment ids, segment[j] == segment[p],
                      and, with `ctx_start_BN` (the kernels' form of the same rule: the first
                      position of the anchor's document), j >= ctx_start[b, n];
      block key r' iff r' // bs == n (its own block, bidirectional);
    and nothing at all when the block is invalid. A sliding layer's `window` also requires
    (p + i) - j < window for context j and |i - i'| < window for block key r' (i = r % bs, the
    row's position in its block, i' = r' % bs); `causal` requires i' <= i.
    """
    b, n = anchors_BN.shape
    rows = n * block_size
    blk_of_row = jnp.arange(rows, dtype=jnp.int32) // block_size
    row_anchor = anchors_BN[:, blk_of_row]  # [B, rows]
    row_valid = block_valid_BN[:, blk_of_row]  # [B, rows]
    j = jnp.arange(ctx_len, dtype=jnp.int32)
    ctx = j[None, None, :] < row_anchor[:, :, None]
    if segment_ids_BS is not None:
        anchor_seg = jnp.take_along_axis(segment_ids_BS, anchors_BN, axis=1)[:, blk_of_row]
        ctx &= segment_ids_BS[:, None, :ctx_len] == anchor_seg[:, :, None]
    if ctx_start_BN is not None:
        ctx &= j[None, None, :] >= ctx_start_BN[:, blk_of_row][:, :, None]
    own = blk_of_row[:, None] == blk_of_row[None, :]
    if window is not None:
        i = jnp.arange(rows, dtype=jnp.int32) % block_size
        ctx &= (row_anchor + i[None])[:, :, None] - j[None, None, :] < window
        own &= jnp.abs(i[:, None] - i[None, :]) < window
    if causal:
        i = jnp.arange(rows, dtype=jnp.int32) % block_size
        own &= i[None, :] <= i[:, None]
    own = jnp.broadcast_to(own, (b, rows, rows))
    return jnp.concatenate([ctx, own], axis=2) & row_valid[:, :, None]


def default_scale(head_dim: int, sm_scale: float | None) -> float:
    return float(head_dim) ** -0.5 if sm_scale is None else float(sm_scale)


def masked_attention(q, k, v, mask, sm_scale=None):
    """`gqa_attention` (the one XLA reference) in float32 at HIGHEST precision, cast back to
    q.dtype.

    q: [B,T,Hq,D]; k, v: [B,S,Hkv,D]; mask: bool, broadcastable to [B,T,S]
    (True = query t may attend to key s).  Returns [B,T,Hq,D] in q.dtype.
    """
    f32 = jnp.float32
    out = gqa_attention(
        q.astype(f32),
        k.astype(f32),
        v.astype(f32),
        mask,
        default_scale(q.shape[-1], sm_scale),
        precision=_HI,
    )
    return out.astype(q.dtype)


def verify_mask(q_positions, cache_len):
    """[B,T,S]: query (b,t) sees cache slot j iff j <= q_positions[b,t]."""
    j = jnp.arange(cache_len, dtype=jnp.int32)
    return j[None, None, :] <= q_positions[:, :, None]


def verify_attention(q, k_cache, v_cache, q_positions, *, sm_scale=None):
    mask = verify_mask(q_positions.astype(jnp.int32), k_cache.shape[1])
    return masked_attention(q, k_cache, v_cache, mask, sm_scale)


def draft_mask(ctx_len, ctx_capacity, block_len):
    """[B,1,C+T]: context slot j visible iff j < ctx_len[b]; all block slots."""
    j = jnp.arange(ctx_capacity, dtype=jnp.int32)
    ctx = j[None, :] < ctx_len[:, None]
    blk = jnp.ones((ctx_len.shape[0], block_len), bool)
    return jnp.concatenate([ctx, blk], axis=1)[:, None, :]


def attention_lse(q, k, v, seen_BTS, *, sm_scale=None):
    """GQA attention under a boolean mask [B,T,S] (True: query t sees key s) returning (out
    [B,T,Hq,D] float32, log-sum-exp [B,T,Hq] float32; out 0 and lse NEG where a row sees no key):
    one chip's share of attention over keys split by sequence, to be merged with the others'."""
    f32 = jnp.float32
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    k, v = k.astype(f32), v.astype(f32)
    seen = seen_BTS[:, :, None, None, :]
    qg = q.astype(f32).reshape(b, t, hkv, hq // hkv, d) * default_scale(d, sm_scale)
    s = jnp.einsum("btkgd,bskd->btkgs", qg, k, precision=_HI)
    s = jnp.where(seen, s, NEG)
    top = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(seen, jnp.exp(s - top), 0.0)
    total = jnp.sum(p, axis=-1)
    out = jnp.einsum("btkgs,bskd->btkgd", p, v, precision=_HI)
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    lse = jnp.where(total > 0, top[..., 0] + jnp.log(jnp.where(total > 0, total, 1.0)), NEG)
    return out.reshape(b, t, hq, d), lse.reshape(b, t, hq)


def draft_attention_lse(q, ctx_k, ctx_v, ctx_len, blk_k, blk_v, blk_seen, *, sm_scale=None):
    """`draft_attention` with the block's keys seen only by rows b where blk_seen[b], returning
    (out, log-sum-exp) as `attention_lse`: one chip's share of attention over a context split
    by sequence, to be merged."""
    b, t = q.shape[:2]
    k = jnp.concatenate([ctx_k, blk_k.astype(ctx_k.dtype)], axis=1)
    v = jnp.concatenate([ctx_v, blk_v.astype(ctx_v.dtype)], axis=1)
    j = jnp.arange(ctx_k.shape[1], dtype=jnp.int32)
    seen = jnp.concatenate(
        [
            j[None, :] < ctx_len[:, None],
            jnp.broadcast_to(blk_seen.astype(bool)[:, None], (b, blk_k.shape[1])),
        ],
        axis=1,
    )  # [B, C + T]
    return attention_lse(
        q, k, v, jnp.broadcast_to(seen[:, None], (b, t, k.shape[1])), sm_scale=sm_scale
    )


def verify_attention_lse(q, k_cache, v_cache, q_positions, *, sm_scale=None):
    """`verify_attention` returning (out, log-sum-exp) as `attention_lse`: one chip's share of
    a target cache split by sequence (its positions shifted by the share's first slot, so a
    negative one sees nothing here)."""
    seen = verify_mask(q_positions.astype(jnp.int32), k_cache.shape[1])
    return attention_lse(q, k_cache, v_cache, seen, sm_scale=sm_scale)


def draft_attention(q, ctx_k, ctx_v, ctx_len, blk_k, blk_v, *, sm_scale=None):
    k = jnp.concatenate([ctx_k, blk_k.astype(ctx_k.dtype)], axis=1)
    v = jnp.concatenate([ctx_v, blk_v.astype(ctx_v.dtype)], axis=1)
    mask = draft_mask(ctx_len.astype(jnp.int32), ctx_k.shape[1], blk_k.shape[1])
    return masked_attention(q, k, v, mask, sm_scale)


def tree_mask(prefix_len, capacity, blk_mask):
    """[B,T,C+Tb]: cache slot j visible iff j < prefix_len[b]; block key u to query t iff
    blk_mask[b, t, u] (a draft tree's ancestor-or-self mask)."""
    j = jnp.arange(capacity, dtype=jnp.int32)
    t = blk_mask.shape[1]
    ctx = jnp.broadcast_to(
        j[None, None, :] < prefix_len[:, None, None], (prefix_len.shape[0], t, capacity)
    )
    return jnp.concatenate([ctx, blk_mask.astype(bool)], axis=2)


def tree_attention(q, k_cache, v_cache, prefix_len, blk_k, blk_v, blk_mask, *, sm_scale=None):
    k = jnp.concatenate([k_cache, blk_k.astype(k_cache.dtype)], axis=1)
    v = jnp.concatenate([v_cache, blk_v.astype(v_cache.dtype)], axis=1)
    mask = tree_mask(prefix_len.astype(jnp.int32), k_cache.shape[1], blk_mask)
    return masked_attention(q, k, v, mask, sm_scale)


def training_attention(
    q,
    k_ctx,
    v_ctx,
    k_blk,
    v_blk,
    anchors,
    block_valid,
    *,
    block_size,
    ctx_start=None,
    sm_scale=None,
):
    n = anchors.shape[1]
    if q.shape[1] != n * block_size or k_blk.shape[1] != n * block_size:
        raise ValueError("q/k_blk length must equal anchors.shape[1] * block_size")
    k = jnp.concatenate([k_ctx, k_blk.astype(k_ctx.dtype)], axis=1)
    v = jnp.concatenate([v_ctx, v_blk.astype(v_ctx.dtype)], axis=1)
    if ctx_start is not None:
        ctx_start = ctx_start.astype(jnp.int32)
    mask = training_mask(
        anchors.astype(jnp.int32),
        block_valid.astype(bool),
        block_size,
        k_ctx.shape[1],
        ctx_start_BN=ctx_start,
    )
    return masked_attention(q, k, v, mask, sm_scale)
