"""GPU verify/draft attention through cuDNN's fused attention kernel.

cuDNN's fused (flash) attention, as `jax.nn.dot_product_attention(implementation="cudnn")`
exposes it, is the GPU attention JAX maintains itself; backend.py picks it where the Pallas
Triton backend is deprecated or gone (see `backend._default_gpu_variant`).

No cache-sized copy and no cache-sized mask: each call is two pieces merged by their
log-sum-exps (the flash-attention merge of two partial softmaxes):
  - the PREFIX, keys [0, n[b]) of the cache as it lies, read by cuDNN with a padding mask
    (`key_value_seq_lengths`: cuDNN reads only the first n[b] rows of row b, no bias);
  - the BLOCK, T keys (the drafter's block K/V; for verify the T cache rows from the block's
    first position on, sliced out of the cache: T rows), in XLA with its [B,T,T] mask.
draft:  prefix = the drafter's context, n = ctx_len; block = blk_k/blk_v (all visible).
verify: prefix = slots j < lo[b] = min_t q_positions[b,t], seen by every query of the row;
        block = slots lo[b] .. lo[b]+T-1, slot j seen by query t iff j <= q_positions[b,t].
        Exact when each row's positions lie within T consecutive slots from lo[b] (a verify
        block's positions are start .. start+T-1; AR's one position trivially).
Before this, the keys were [context ; block] (a concatenation: a copy of the drafter's
context per layer per step) and the visibility a boolean mask over the whole capacity (cuDNN
adds it as a [B,1,T,S] bias).

cuDNN takes float16/bfloat16 with head_dim % 8 == 0 and head_dim <= 128, 256 from Hopper on
(`max_head_dim`: the GPU compiled for); other inputs run the XLA reference instead (same semantics, so the choice never changes a
result beyond rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import backend, reference
from .reference import default_scale

_DTYPES = (jnp.float16, jnp.bfloat16)
# The prefix piece's implementation: "cudnn", or "xla" (`jax.nn.dot_product_attention`'s XLA
# implementation of the same call, same padding semantics): tests set "xla" to check this
# module's pieces and merge on a CPU.
_IMPLEMENTATION = "cudnn"


def max_head_dim() -> int:
    """The widest head cuDNN's fused attention takes on the GPU compiled for
    (`backend._compile_device_kind`): 256 from Hopper (sm90) on, 128 before."""
    return 256 if backend.is_sm90_or_later(backend._compile_device_kind()) else 128


def supported(q) -> bool:
    """Whether cuDNN's fused attention takes q's dtype and head_dim (a multiple of 8 up to
    `max_head_dim`: Qwen3.5's 256-wide gated-attention heads on a Hopper GPU)."""
    d = q.shape[-1]
    dtype_ok = jnp.dtype(q.dtype) in [jnp.dtype(x) for x in _DTYPES]
    return dtype_ok and d % 8 == 0 and d <= max_head_dim()


def _prefix_attention(q, k, v, n, scale):
    """Attention of q [B,T,N,D] over keys [0, n[b]) of k, v [B,S,K,D], with its log-sum-exp:
    (out [B,T,N,D] in q.dtype, lse [B,T,N] float32). Rows with n[b] == 0 are garbage (the
    caller masks them)."""
    b, t = q.shape[:2]
    q_len = jnp.full((b,), t, jnp.int32)
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    if _IMPLEMENTATION == "cudnn":
        try:  # float32 log-sum-exp (the public function casts it to q.dtype)
            from jax._src.cudnn.fused_attention_stablehlo import MaskType
            from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as fa
        except ImportError:
            fa = None
        if fa is not None:
            out, lse = fa(
                q,
                k,
                v,
                q_seqlen=q_len,
                kv_seqlen=n,
                scale=scale,
                mask_type=MaskType.PADDING,
                qkv_layout="BTNH",
                return_residual=True,
            )
            return out, jnp.transpose(lse, (0, 2, 1)).astype(jnp.float32)  # B N T -> B T N
    out, lse = jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        query_seq_lengths=q_len,
        key_value_seq_lengths=n,
        implementation=_IMPLEMENTATION,
        return_residual=True,
    )
    return out, lse.astype(jnp.float32)


def _block_attention(q, k, v, mask, scale):
    """Attention of q [B,T,N,D] over T' keys k, v [B,T',K,D] with mask [B,T,T'], in float32:
    (out [B,T,N,D], lse [B,T,N]; a row that sees no key: out 0, lse -inf)."""
    b, t, n, d = q.shape
    kh = k.shape[2]
    f32 = jnp.float32
    qg = q.astype(f32).reshape(b, t, kh, n // kh, d)
    hi = jax.lax.Precision.HIGHEST
    m = mask[:, :, None, None, :]
    s = jnp.einsum("btkgd,bskd->btkgs", qg, k.astype(f32), precision=hi) * scale
    s = jnp.where(m, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B,T,K,G]
    p = jnp.where(m, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("btkgs,bskd->btkgd", p, v.astype(f32), precision=hi)
    return out.reshape(b, t, n, d), lse.reshape(b, t, n)


def merge(out_a, lse_a, valid_a, out_b, lse_b):
    """Softmax attention over the union of two disjoint key sets from each one's normalised
    output (out [B,T,N,D]) and log-sum-exp (lse [B,T,N]). valid_a [B]: whether set a has any
    key (a row of n == 0 takes b alone, whatever a's garbage); set b's empty rows have lse
    -inf. A row with no key in either set gets 0. Returns float32."""
    f32 = jnp.float32
    va = valid_a[:, None, None]
    lse_a = jnp.where(va, lse_a.astype(f32), -jnp.inf)
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wa = jnp.where(va, jnp.exp(lse_a - m), 0.0)
    wb = jnp.exp(lse_b - m)  # 0 where b is empty
    oa = jnp.where(va[..., None], out_a.astype(f32), 0.0)
    den = wa + wb
    num = oa * wa[..., None] + out_b.astype(f32) * wb[..., None]
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def _split_attention(q, k_prefix, v_prefix, n, k_blk, v_blk, blk_mask, sm_scale):
    scale = default_scale(q.shape[-1], sm_scale)
    n = jnp.clip(n.astype(jnp.int32), 0, k_prefix.shape[1])
    ob, lb = _block_attention(q, k_blk, v_blk, blk_mask, scale)
    if k_prefix.shape[1] == 0:
        return ob.astype(q.dtype)
    oc, lc = _prefix_attention(q, k_prefix, v_prefix, n, scale)
    return merge(oc, lc, n > 0, ob, lb).astype(q.dtype)


def verify_attention(q, k_cache, v_cache, q_positions, *, sm_scale=None):
    """q: [B,T,Hq,D]; k_cache, v_cache: [B,S,Hkv,D]; q_positions: [B,T] (module doc)."""
    if not supported(q):
        return reference.verify_attention(q, k_cache, v_cache, q_positions, sm_scale=sm_scale)
    b, t = q.shape[:2]
    s = k_cache.shape[1]
    pos = q_positions.astype(jnp.int32)
    lo = jnp.clip(jnp.min(pos, axis=1), 0, s)  # [B]: every query of the row sees j < lo
    tb = min(t, s)
    start = jnp.clip(lo, 0, s - tb)  # the T rows from lo on (clamped inside the cache)

    def rows(c):
        return jax.vmap(lambda cb, st: jax.lax.dynamic_slice_in_dim(cb, st, tb, axis=0))(c, start)

    j = start[:, None] + jnp.arange(tb, dtype=jnp.int32)[None]  # [B,T'] slot of each block key
    blk_mask = (j[:, None, :] >= lo[:, None, None]) & (j[:, None, :] <= pos[:, :, None])
    return _split_attention(
        q, k_cache, v_cache, lo, rows(k_cache), rows(v_cache), blk_mask, sm_scale
    )


def draft_attention(q, ctx_k, ctx_v, ctx_len, blk_k, blk_v, *, sm_scale=None):
    """q: [B,T,Hq,D]; ctx_k/v: [B,C,Hkv,D]; ctx_len: [B]; blk_k/v: [B,T,Hkv,D]
    (module doc: the context as it lies, the block apart)."""
    if not supported(q):
        return reference.draft_attention(q, ctx_k, ctx_v, ctx_len, blk_k, blk_v, sm_scale=sm_scale)
    b, t = q.shape[:2]
    blk_mask = np.ones((1, t, blk_k.shape[1]), bool)
    return _split_attention(
        q, ctx_k, ctx_v, ctx_len, blk_k.astype(q.dtype), blk_v.astype(q.dtype),
        jnp.broadcast_to(blk_mask, (b, t, blk_k.shape[1])), sm_scale,
    )  # fmt: skip
