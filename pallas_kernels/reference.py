"""Plain-XLA reference implementations (the source of truth).

Layout everywhere: [batch, length, heads, head_dim] ("BTHD").  GQA: query
head h uses kv head h // G with G = Hq // Hkv.  Scores and softmax are in
float32 (matmuls at HIGHEST precision), the output is cast to q.dtype.
Rows that see no key at all produce 0 (and zero gradients), never NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def default_scale(head_dim: int, sm_scale: float | None) -> float:
  return float(head_dim) ** -0.5 if sm_scale is None else float(sm_scale)


def masked_attention(q, k, v, mask, sm_scale=None):
  """Dense masked GQA attention.

  q: [B,T,Hq,D]; k, v: [B,S,Hkv,D]; mask: bool, broadcastable to [B,T,S]
  (True = query t may attend to key s).  Returns [B,T,Hq,D] in q.dtype.
  """
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  if hq % hkv:
    raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
  g = hq // hkv
  scale = default_scale(d, sm_scale)
  qg = q.reshape(b, t, hkv, g, d).astype(jnp.float32)
  s = jnp.einsum("bthgd,bshd->bhgts", qg, k.astype(jnp.float32),
                 precision=_HI) * scale
  mask = jnp.broadcast_to(mask, (b, t, k.shape[1]))[:, None, None]
  s = jnp.where(mask, s, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l == 0.0, 1.0, l)
  o = jnp.einsum("bhgts,bshd->bthgd", p, v.astype(jnp.float32), precision=_HI)
  return o.reshape(b, t, hq, d).astype(q.dtype)


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


def training_mask(anchors, block_valid, ctx_len, block_size, ctx_start=None):
  """[B, N*bs, S + N*bs] DFlash training mask.

  Query row i belongs to block n = i // block_size.  It sees context slot j
  iff ctx_start[b, n] <= j < anchors[b, n] (strictly below the anchor;
  ctx_start defaults to 0) and the block_size keys of its own block
  (bidirectional); rows of invalid blocks see nothing.
  """
  b, n = anchors.shape
  rows = n * block_size
  blk_of_row = jnp.arange(rows, dtype=jnp.int32) // block_size
  row_anchor = anchors[:, blk_of_row]                      # [B, rows]
  row_valid = block_valid[:, blk_of_row]                   # [B, rows]
  j = jnp.arange(ctx_len, dtype=jnp.int32)
  ctx = (j[None, None, :] < row_anchor[:, :, None]) & row_valid[:, :, None]
  if ctx_start is not None:
    ctx &= j[None, None, :] >= ctx_start[:, blk_of_row][:, :, None]
  same = blk_of_row[:, None] == blk_of_row[None, :]
  blk = same[None] & row_valid[:, :, None]
  return jnp.concatenate([ctx, blk], axis=2)


def training_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_valid, *,
                       block_size, ctx_start=None, sm_scale=None):
  n = anchors.shape[1]
  if q.shape[1] != n * block_size or k_blk.shape[1] != n * block_size:
    raise ValueError("q/k_blk length must equal anchors.shape[1] * block_size")
  k = jnp.concatenate([k_ctx, k_blk.astype(k_ctx.dtype)], axis=1)
  v = jnp.concatenate([v_ctx, v_blk.astype(v_ctx.dtype)], axis=1)
  if ctx_start is not None:
    ctx_start = ctx_start.astype(jnp.int32)
  mask = training_mask(anchors.astype(jnp.int32), block_valid.astype(bool),
                       k_ctx.shape[1], block_size, ctx_start)
  return masked_attention(q, k, v, mask, sm_scale)
