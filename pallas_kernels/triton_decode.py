"""Pallas GPU (Triton backend) flash-decoding kernel for verify/draft attention.

Same semantics as tpu_decode.decode_attention.  Grid (B, Hkv, NS): program
(b, h, s) owns the R = T*G query rows of kv head h (padded to a power of two
>= 16 for tl.dot) and walks its share of the *needed* KV tiles
[0, cdiv(kv_len[b], tk)) with a dynamic-bound loop, so tiles past the valid
length are never loaded, and the work is spread over the NS splits according
to the actual length rather than the cache capacity.  K/V tiles are read
straight from the [B, S, Hkv, D] cache with masked loads (no padding copy).
Each split writes a normalised partial output + log-sum-exp; the merge is a
tiny XLA epilogue.  Block keys (draft) are folded in by split 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common as C
from .reference import default_scale


def _update(q, k, v, m, l, acc, mask, *, scale, prec):
    s = jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=prec
    )
    s = jnp.where(mask, s * scale, C.NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = alpha * l + jnp.sum(p, axis=1)
    pv = jax.lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=prec,
    )
    return m_new, l, acc * alpha[:, None] + pv


def _decode_kernel(
    kvlen_ref, q_ref, lim_ref, k_ref, v_ref, *rest, tk, ns, scale, prec, blk_len, blk_pad
):
    if blk_len:
        bk_ref, bv_ref, o_ref, lse_ref = rest
    else:
        o_ref, lse_ref = rest
    b = pl.program_id(0)
    split = pl.program_id(2)
    kv_len = kvlen_ref[b]
    needed = jax.lax.div(kv_len + (tk - 1), tk)
    per = jax.lax.div(needed + (ns - 1), ns)
    lo = split * per
    hi = jnp.minimum(lo + per, needed)

    q = q_ref[...]
    rows, d = q.shape
    lim = lim_ref[...]
    m = jnp.full((rows,), C.NEG, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    acc = jnp.zeros((rows, d), jnp.float32)

    if blk_len:
        # The block keys arrive zero-padded to blk_pad rows (a power of two, as
        # tl.dot needs): a whole-ref read, never a slice past the ref's end.
        valid = jnp.arange(blk_pad, dtype=jnp.int32) < blk_len
        mask = jnp.broadcast_to((valid & (split == 0))[None, :], (rows, blk_pad))
        m, l, acc = _update(q, bk_ref[...], bv_ref[...], m, l, acc, mask, scale=scale, prec=prec)

    def body(j, carry):
        m, l, acc = carry
        start = pl.multiple_of(j * tk, tk)
        cols = start + jnp.arange(tk, dtype=jnp.int32)
        ok = cols < kv_len
        # The last tile may run past S (S % tk != 0): the masked load never
        # dereferences those rows (and zero-fills them, so stale NaN cannot leak).
        k = plgpu.load(k_ref.at[pl.ds(start, tk), :], mask=ok[:, None], other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(start, tk), :], mask=ok[:, None], other=0.0)
        mask = cols[None, :] <= lim[:, None]
        return _update(q, k, v, m, l, acc, mask, scale=scale, prec=prec)

    m, l, acc = jax.lax.fori_loop(lo, hi, body, (m, l, acc))
    ok = l > 0.0
    lsafe = jnp.where(ok, l, 1.0)
    o_ref[...] = acc / lsafe[:, None]
    lse_ref[...] = jnp.where(ok, m + jnp.log(lsafe), C.NEG)


def decode_attention(
    q,
    k,
    v,
    lim,
    *,
    blk_k=None,
    blk_v=None,
    sm_scale=None,
    block_k: int = 64,
    num_splits: int | None = None,
    target_programs: int = 264,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret=False,
):
    """q: [B,T,Hq,D]; k, v: [B,S,Hkv,D]; lim: [B,T] (row sees j iff j <= lim)."""
    b, t, hq, d, hkv, g = C.check_gqa(q, k)
    s_len = k.shape[1]
    scale = default_scale(d, sm_scale)
    dp = max(16, C.next_pow2(d))
    rows = max(16, C.next_pow2(t * g))
    tk = max(16, min(C.next_pow2(block_k), C.next_pow2(s_len)))
    n_tiles = C.cdiv(s_len, tk)

    lim = jnp.minimum(lim.astype(jnp.int32), s_len - 1)
    kv_len = jnp.maximum(jnp.max(lim, axis=1) + 1, 0).astype(jnp.int32)
    lim_rows = C.per_row(lim, g, rows, -1)
    if num_splits is None:
        num_splits = C.cdiv(target_programs, b * hkv)
    ns = max(1, min(num_splits, n_tiles))

    q4 = C.pad_axis(C.q_to_rows(q, hkv, rows), 3, dp)
    k = C.pad_axis(k, 3, dp)  # no-op for the usual power-of-two head dims
    v = C.pad_axis(v, 3, dp)
    grid = (b, hkv, ns)
    in_specs = [
        pl.BlockSpec((b,), lambda bi, hi, si: (0,)),
        pl.BlockSpec((None, None, rows, dp), lambda bi, hi, si: (bi, hi, 0, 0)),
        pl.BlockSpec((None, rows), lambda bi, hi, si: (bi, 0)),
        pl.BlockSpec((None, s_len, None, dp), lambda bi, hi, si: (bi, 0, hi, 0)),
        pl.BlockSpec((None, s_len, None, dp), lambda bi, hi, si: (bi, 0, hi, 0)),
    ]
    args = [kv_len, q4, lim_rows, k, v]
    blk_len = blk_pad = 0
    if blk_k is not None:
        blk_len = blk_k.shape[1]
        blk_pad = max(16, C.next_pow2(blk_len))
        spec = pl.BlockSpec((None, blk_pad, None, dp), lambda bi, hi, si: (bi, 0, hi, 0))
        in_specs += [spec, spec]
        # Zero rows up to blk_pad (a B*blk_pad*Hkv*D copy, tiny): padded V rows
        # are finite, padded keys are masked out of the scores.
        pad_blk = lambda x: C.pad_axis(C.pad_axis(x.astype(k.dtype), 3, dp), 1, blk_pad)
        args += [pad_blk(blk_k), pad_blk(blk_v)]
    out_specs = [
        pl.BlockSpec((None, None, None, rows, dp), lambda bi, hi, si: (bi, hi, si, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda bi, hi, si: (bi, hi, si, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, hkv, ns, rows, dp), jnp.float32),
        jax.ShapeDtypeStruct((b, hkv, ns, rows), jnp.float32),
    ]
    kernel = functools.partial(
        _decode_kernel,
        tk=tk,
        ns=ns,
        scale=scale,
        prec=C.dot_precision(q.dtype),
        blk_len=blk_len,
        blk_pad=blk_pad,
    )
    cost = C.decode_cost(q, k, s_len, blk_len)
    o_part, lse_part = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        cost_estimate=cost,
        interpret=interpret,
        name="dflash_decode_attention_triton",
    )(*args)
    o = C.combine_splits(o_part, lse_part)[..., :d]
    return C.rows_to_q(o, t, g, q.dtype)
