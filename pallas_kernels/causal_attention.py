"""Causal, segment-masked self-attention of packed rows through JAX's own flash kernels.

The frozen target pass of drafter training runs full causal self-attention over each packed
row (documents separated by `segment_ids`). These wrappers hand it to a flash kernel, so no
[T, T] score tensor is ever materialised:

  splash_causal_attention  TPU: splash attention (`jax.experimental.pallas.ops.tpu.
                           splash_attention`, a Mosaic kernel): `CausalMask` and'ed with
                           `SegmentIds`, GQA through its grouped heads (`make_splash_mha` takes
                           fewer KV heads than query heads), vmapped over the batch.
  triton_causal_attention  GPU: the Pallas Triton flash attention of
                           `jax.experimental.pallas.ops.gpu.attention.mha` (causal, segment
                           ids); it wants as many KV heads as query heads, so K/V are repeated
                           per group (memory linear in T).

Both take q [B,T,Hq,D], k/v [B,T,Hkv,D] (Hq a multiple of Hkv), segment_ids [B,T] int32 or
None, and return [B,T,Hq,D] in q's dtype. Causality is by token index within the row: query t
sees keys s <= t of its own segment. That equals the position rule `pos[s] <= pos[t]` of
`dflash_jax.models.attention.chunked_causal_attention` whenever each segment is one contiguous run whose
positions increase with the index (rows of dflash_jax.data.packing, with positions restarting
per document or running 0..T-1 over the row, both qualify).

Lengths: both kernels tile the sequence, so T is padded at the end to a multiple of 128 (the
padded keys lie after every real query, hence never seen by one) and the output sliced back.
The query is multiplied by the softmax scale (1/sqrt(D)) before the kernel, in q's dtype.
Compiled kernels are opaque to GSPMD: callers on a sharded mesh run these per shard
(`dflash_jax.models.attention.causal_attention` does).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

_MULTIPLE = 128  # both kernels' minimum tile along the sequence
_SPLASH_BLOCKS = (512, 256, 128)  # the largest that divides the padded length is used


def _padded(t: int) -> int:
    return -(-t // _MULTIPLE) * _MULTIPLE


def _prepare(q, k, v, segment_ids, sm_scale):
    """Scaled q, k/v in q's dtype and int32 segment ids, all padded to a multiple of 128."""
    b, t, _, d = q.shape
    scale = d**-0.5 if sm_scale is None else sm_scale
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    pad = _padded(t) - t
    rows = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q = rows((q * jnp.asarray(scale, q.dtype)).astype(q.dtype))
    k, v = rows(k.astype(q.dtype)), rows(v.astype(q.dtype))
    seg = jnp.pad(seg, [(0, 0), (0, pad)], constant_values=-1)
    return q, k, v, seg


@functools.lru_cache(maxsize=64)
def _splash_kernel(num_q_heads: int, seq_len: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    block = next(x for x in _SPLASH_BLOCKS if seq_len % x == 0)
    sizes = sa.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = sa.MultiHeadMask([sa.CausalMask((seq_len, seq_len))] * num_q_heads)
    return sa.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def splash_causal_attention(q, k, v, segment_ids=None, *, sm_scale=None, interpret=False):
    """TPU splash attention, causal by index and masked by segment (module docstring).
    interpret=True runs the Mosaic kernel in Pallas interpret mode (any backend)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, t, hq, d = q.shape
    if hq % k.shape[2]:
        raise ValueError(f"{hq} query heads must be a multiple of {k.shape[2]} KV heads")
    q, k, v, seg = _prepare(q, k, v, segment_ids, sm_scale)
    kernel = _splash_kernel(hq, q.shape[1], bool(interpret))
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B,T,H,D] <-> [B,H,T,D]
    out = jax.vmap(lambda q_, k_, v_, s_: kernel(q_, k_, v_, segment_ids=sa.SegmentIds(s_, s_)))(
        heads_first(q), heads_first(k), heads_first(v), seg
    )
    return heads_first(out)[:, :t]


def triton_causal_attention(q, k, v, segment_ids=None, *, sm_scale=None, interpret=False):
    """GPU Pallas (Triton) flash attention, causal by index and masked by segment (module
    docstring). interpret=True runs it in the Pallas interpreter (any backend)."""
    with warnings.catch_warnings():  # deprecated from jax 0.11 (for Mosaic GPU), still shipped
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    b, t, hq, d = q.shape
    hkv = k.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads must be a multiple of {hkv} KV heads")
    q, k, v, seg = _prepare(q, k, v, segment_ids, sm_scale)
    k, v = jnp.repeat(k, hq // hkv, axis=2), jnp.repeat(v, hq // hkv, axis=2)
    out = gpu_attention.mha(q, k, v, seg, sm_scale=1.0, causal=True, interpret=bool(interpret))
    return out[:, :t]
