"""Shared helpers for the Pallas kernels (layouts, padding, split combine)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite stand-in for -inf: keeps every exp()/max() in the online softmax
# NaN-free, even for rows that (so far) saw no key at all.
NEG = -1e30
# Lane width used for per-row statistics on TPU ((rows, 128) f32 blocks).
LANES = 128


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_pow2(a: int) -> int:
    a = max(int(a), 1)
    return 1 << (a - 1).bit_length()


def sublane_multiple(dtype) -> int:
    """Row granularity of a TPU tile for `dtype` (8 for 32-bit, 16 for bf16)."""
    return max(8, 32 // jnp.dtype(dtype).itemsize)


def dot_precision(dtype):
    """Full-f32 matmuls for f32 inputs (no bf16 / TF32 passes); default else."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.lax.Precision.HIGHEST
    return None


def check_gqa(q, k):
    b, t, hq, d = q.shape
    if k.ndim != 4 or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"incompatible q {q.shape} / kv {k.shape}")
    hkv = k.shape[2]
    if hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    return b, t, hq, d, hkv, hq // hkv


def pad_axis(x, axis: int, size: int, value=0):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    if extra < 0:
        raise ValueError("pad_axis cannot shrink")
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def q_to_rows(q, hkv: int, rows: int):
    """[B,T,Hq,D] -> [B,Hkv,rows,D]; row r = t*G + g (padded with zeros)."""
    b, t, hq, d = q.shape
    g = hq // hkv
    x = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
    return pad_axis(x, 2, rows)


def rows_to_q(o, t: int, g: int, dtype):
    """Inverse of q_to_rows: [B,Hkv,rows,D] -> [B,T,Hq,D]."""
    b, hkv, _, d = o.shape
    o = o[:, :, : t * g].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    return o.reshape(b, t, hkv * g, d).astype(dtype)


def per_row(x, g: int, rows: int, fill):
    """[B,T] per-query values -> [B,rows] per-row values (row = t*G + g)."""
    return pad_axis(jnp.repeat(x, g, axis=1), 1, rows, fill)


def combine_splits(o_part, lse_part):
    """Merges flash-decoding partials.

    o_part: [..., NS, R, D] normalised partial outputs (f32),
    lse_part: [..., NS, R] their log-sum-exp (NEG where a split saw nothing).
    Returns [..., R, D] f32.
    """
    m = jnp.max(lse_part, axis=-2, keepdims=True)
    w = jnp.exp(lse_part - m)  # [..., NS, R]
    denom = jnp.sum(w, axis=-2)  # [..., R]
    o = jnp.sum(w[..., None] * o_part, axis=-3)  # [..., R, D]
    return o / denom[..., None]


def decode_cost(q, k, s_len: int, blk_len: int):
    """XLA's cost model of a decode-attention call: q [B,T,Hq,D] against s_len cached and blk_len
    block keys/values of k's dtype and head count (each K and V element read once)."""
    from jax.experimental import pallas as pl

    b, t, hq, d = q.shape
    hkv = k.shape[2]
    kv = s_len + blk_len
    return pl.CostEstimate(
        flops=4 * b * hq * t * kv * d,
        transcendentals=b * hq * t * kv,
        bytes_accessed=2 * b * kv * hkv * d * jnp.dtype(k.dtype).itemsize
        + 2 * q.size * q.dtype.itemsize,
    )
