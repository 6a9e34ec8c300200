"""GPU verify/draft attention through cuDNN's fused attention kernel.

`jax.nn.dot_product_attention(implementation=_IMPLEMENTATION)` is the GPU attention
JAX maintains itself; backend.py picks it where the Pallas Triton backend is
deprecated or gone (see `backend._default_gpu_variant`).  It is a fallback,
not a DFlash-specific kernel: the visibility rule travels as a boolean mask
(cuDNN adds it as a [B,1,T,S] bias), so every cache slot up to the capacity
is read, not only the valid length (the Pallas kernels skip tiles past it).
Stale slots must therefore hold finite values (the zero-initialised caches of
dflash_jax do); the Pallas kernels also tolerate NaN there.

cuDNN takes float16/bfloat16 with head_dim % 8 == 0 and head_dim <= 128
(256 from Hopper on); other inputs run the XLA reference instead (same
semantics, so the choice never changes a result beyond rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import reference
from .reference import default_scale

_DTYPES = (jnp.float16, jnp.bfloat16)
# jax.nn.dot_product_attention's `implementation`; tests set "xla" to check this
# module's masks and layouts on a CPU.
_IMPLEMENTATION = "cudnn"


def supported(q) -> bool:
    """Whether cuDNN's fused attention takes q's dtype and head_dim (<= 128: any GPU)."""
    d = q.shape[-1]
    return jnp.dtype(q.dtype) in [jnp.dtype(x) for x in _DTYPES] and d % 8 == 0 and d <= 128


def masked_attention(q, k, v, mask, sm_scale=None):
    """q: [B,T,Hq,D]; k, v: [B,S,Hkv,D]; mask: bool broadcastable to [B,T,S].

    Same contract as reference.masked_attention for rows that see >= 1 key.
    """
    if not supported(q):
        return reference.masked_attention(q, k, v, mask, sm_scale)
    b, t = q.shape[:2]
    mask = jnp.broadcast_to(mask, (b, t, k.shape[1]))[:, None]  # [B,1,T,S]
    return jax.nn.dot_product_attention(
        q,
        k.astype(q.dtype),
        v.astype(q.dtype),
        mask=mask,
        scale=default_scale(q.shape[-1], sm_scale),
        implementation=_IMPLEMENTATION,
    )


def verify_attention(q, k_cache, v_cache, q_positions, *, sm_scale=None):
    """q: [B,T,Hq,D]; k_cache, v_cache: [B,S,Hkv,D]; q_positions: [B,T]."""
    mask = reference.verify_mask(q_positions.astype(jnp.int32), k_cache.shape[1])
    return masked_attention(q, k_cache, v_cache, mask, sm_scale)


def draft_attention(q, ctx_k, ctx_v, ctx_len, blk_k, blk_v, *, sm_scale=None):
    """q: [B,T,Hq,D]; ctx_k/v: [B,C,Hkv,D]; ctx_len: [B]; blk_k/v: [B,T,Hkv,D].

    Keys are [context ; block] (a copy of the context, C+T rows per call).
    """
    k = jnp.concatenate([ctx_k, blk_k.astype(ctx_k.dtype)], axis=1)
    v = jnp.concatenate([ctx_v, blk_v.astype(ctx_v.dtype)], axis=1)
    mask = reference.draft_mask(ctx_len.astype(jnp.int32), ctx_k.shape[1], blk_k.shape[1])
    return masked_attention(q, k, v, mask, sm_scale)
