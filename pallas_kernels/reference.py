"""Plain-XLA reference implementations (the source of truth).

Masked attention and the training mask are the library's own (`dflash_jax.layers.
masked_attention`, `dflash_jax.training.masks.training_mask`): one reference each, which the
model's "xla" path runs and the kernels are checked against. This module adds the decoding
masks and the (q, k, v, ...) signatures the kernels share.

Layout everywhere: [batch, length, heads, head_dim] ("BTHD").  GQA: query
head h uses kv head h // G with G = Hq // Hkv.  Scores and softmax are in
float32 (matmuls at HIGHEST precision), the output is cast to q.dtype.
Rows that see no key at all produce 0 (and zero gradients), never NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax import layers
from dflash_jax.training import masks

_HI = jax.lax.Precision.HIGHEST


def default_scale(head_dim: int, sm_scale: float | None) -> float:
    return float(head_dim) ** -0.5 if sm_scale is None else float(sm_scale)


def masked_attention(q, k, v, mask, sm_scale=None):
    """The library's masked GQA attention (`dflash_jax.layers.masked_attention`, the one XLA
    reference) in float32 at HIGHEST precision, cast back to q.dtype.

    q: [B,T,Hq,D]; k, v: [B,S,Hkv,D]; mask: bool, broadcastable to [B,T,S]
    (True = query t may attend to key s).  Returns [B,T,Hq,D] in q.dtype.
    """
    f32 = jnp.float32
    out = layers.masked_attention(
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


def draft_attention(q, ctx_k, ctx_v, ctx_len, blk_k, blk_v, *, sm_scale=None):
    k = jnp.concatenate([ctx_k, blk_k.astype(ctx_k.dtype)], axis=1)
    v = jnp.concatenate([ctx_v, blk_v.astype(ctx_v.dtype)], axis=1)
    mask = draft_mask(ctx_len.astype(jnp.int32), ctx_k.shape[1], blk_k.shape[1])
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
    mask = masks.training_mask(
        anchors.astype(jnp.int32),
        block_valid.astype(bool),
        block_size,
        k_ctx.shape[1],
        ctx_start_BN=ctx_start,
    )
    return masked_attention(q, k, v, mask, sm_scale)
