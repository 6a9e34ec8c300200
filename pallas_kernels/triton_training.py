"""Pallas GPU (Triton backend) kernels for DFlash training attention.

Same layout/mask as tpu_training (see _training_common).  Context K/V are read
straight from [B, S, Hkv, D] with masked loads (no padding copy).

forward  grid (B, Hkv, nqt): one query tile (TQP rows = nb blocks x G heads)
         loops over the context tiles [lo, hi) its rows' windows
         [ctx_start, anchor) touch -- fully masked tiles below and above are
         never visited -- then its own block keys.
backward dq kernel, grid (B, Hkv, nqt): dQ + dK_blk/dV_blk (block keys are
         private to their query tile).  dkv kernel, grid (B, Hkv, nkt): one
         context tile accumulates dK/dV over the compacted list of query
         tiles that can see it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common as C
from . import _training_common as TC

POS = 1e30


def _cdiv(a, b):
    return jax.lax.div(a + (b - 1), b)


def _ids(lay):
    r = jnp.arange(lay.tqp, dtype=jnp.int32)
    rowblk = jnp.where(r < lay.tq, jax.lax.div(jax.lax.div(r, lay.g), lay.bs), -1)
    c = jnp.arange(lay.bqp, dtype=jnp.int32)
    colblk = jnp.where(c < lay.bq, jax.lax.div(c, lay.bs), -2)
    return rowblk, colblk


def _dot(a, b, dims, prec):
    return jax.lax.dot_general(
        a, b, (dims, ((), ())), preferred_element_type=jnp.float32, precision=prec
    )


_NT = ((1,), (1,))  # a @ b.T
_NN = ((1,), (0,))  # a @ b
_TN = ((0,), (0,))  # a.T @ b


def _load_ctx(ref, start, tk, s_len):
    ok = (start + jnp.arange(tk, dtype=jnp.int32)) < s_len
    return plgpu.load(ref.at[pl.ds(start, tk), :], mask=ok[:, None], other=0.0)


def _tile_range(a, s, lay):
    """Context tiles [lo, hi) touched by the rows' windows [s, a) (cf. TC.tile_bounds)."""
    sees = s < a
    hi = _cdiv(jnp.max(jnp.where(sees, a, 0)), lay.tk)
    lo = jax.lax.div(jnp.min(jnp.where(sees, s, lay.nkt * lay.tk)), lay.tk)
    return jnp.minimum(lo, hi), hi


def _ctx_mask(cols, a, s):
    return (cols[None, :] >= s[:, None]) & (cols[None, :] < a[:, None])


def _fwd_kernel(
    q_ref, a_ref, s_ref, kc_ref, vc_ref, kb_ref, vb_ref, o_ref, lse_ref, *, lay, scale, prec
):
    tk = lay.tk
    q = q_ref[...]
    a, s = a_ref[...], s_ref[...]
    rows, d = q.shape
    lo, hi = _tile_range(a, s, lay)

    def update(k, v, mask, carry):
        m, l, acc = carry
        s = jnp.where(mask, _dot(q, k, _NT, prec) * scale, C.NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        return (
            m_new,
            alpha * l + jnp.sum(p, axis=1),
            acc * alpha[:, None] + _dot(p.astype(v.dtype), v, _NN, prec),
        )

    def body(j, carry):
        start = pl.multiple_of(j * tk, tk)
        k = _load_ctx(kc_ref, start, tk, lay.s_len)
        v = _load_ctx(vc_ref, start, tk, lay.s_len)
        cols = start + jnp.arange(tk, dtype=jnp.int32)
        return update(k, v, _ctx_mask(cols, a, s), carry)

    carry = (
        jnp.full((rows,), C.NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
    )
    carry = jax.lax.fori_loop(lo, hi, body, carry)
    rowblk, colblk = _ids(lay)
    mask = (rowblk[:, None] == colblk[None, :]) & (a >= 0)[:, None]
    m, l, acc = update(kb_ref[...], vb_ref[...], mask, carry)
    ok = l > 0.0
    lsafe = jnp.where(ok, l, 1.0)
    o_ref[...] = (acc / lsafe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(ok, m + jnp.log(lsafe), POS)


def _specs(lay):
    d, tqp, bqp = lay.d, lay.tqp, lay.bqp
    return dict(
        q=pl.BlockSpec((None, None, tqp, d), lambda bi, hi, qi: (bi, hi, qi, 0)),
        row=pl.BlockSpec((None, None, tqp), lambda bi, hi, qi: (bi, hi, qi)),
        a=pl.BlockSpec((None, tqp), lambda bi, hi, qi: (bi, qi)),
        ctx=pl.BlockSpec((None, lay.s_len, None, d), lambda bi, hi, qi: (bi, 0, hi, 0)),
        blk=pl.BlockSpec((None, bqp, None, d), lambda bi, hi, qi: (bi, qi, hi, 0)),
    )


def _params(lay):
    return plgpu.CompilerParams(num_warps=4 if lay.d <= 64 else 8, num_stages=2)


def forward(lay, q_t, kc, vc, kb_t, vb_t, a_rows, s_rows, *, scale, interpret):
    sp = _specs(lay)
    rows = lay.nqt * lay.tqp
    return pl.pallas_call(
        functools.partial(_fwd_kernel, lay=lay, scale=scale, prec=C.dot_precision(q_t.dtype)),
        out_shape=[
            jax.ShapeDtypeStruct((lay.b, lay.hkv, rows, lay.d), q_t.dtype),
            jax.ShapeDtypeStruct((lay.b, lay.hkv, rows), jnp.float32),
        ],
        grid=(lay.b, lay.hkv, lay.nqt),
        in_specs=[sp["q"], sp["a"], sp["a"], sp["ctx"], sp["ctx"], sp["blk"], sp["blk"]],
        out_specs=[sp["q"], sp["row"]],
        compiler_params=_params(lay),
        interpret=interpret,
        name="dflash_training_fwd_triton",
    )(q_t, a_rows, s_rows, kc, vc, kb_t, vb_t)


def _bwd_p_ds(q, k, v, do, lse, delta, mask, scale, prec):
    p = jnp.where(mask, jnp.exp(_dot(q, k, _NT, prec) * scale - lse[:, None]), 0.0)
    ds = p * (_dot(do, v, _NT, prec) - delta[:, None])
    return p, ds


def _dq_kernel(
    q_ref,
    do_ref,
    lse_ref,
    dl_ref,
    a_ref,
    s_ref,
    kc_ref,
    vc_ref,
    kb_ref,
    vb_ref,
    dq_ref,
    dkb_ref,
    dvb_ref,
    *,
    lay,
    scale,
    prec,
):
    tk = lay.tk
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], dl_ref[...]
    a, s = a_ref[...], s_ref[...]
    lo, hi = _tile_range(a, s, lay)

    def body(j, dq):
        start = pl.multiple_of(j * tk, tk)
        k = _load_ctx(kc_ref, start, tk, lay.s_len)
        v = _load_ctx(vc_ref, start, tk, lay.s_len)
        cols = start + jnp.arange(tk, dtype=jnp.int32)
        _, ds = _bwd_p_ds(q, k, v, do, lse, delta, _ctx_mask(cols, a, s), scale, prec)
        return dq + _dot(ds.astype(k.dtype), k, _NN, prec)

    dq = jax.lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    rowblk, colblk = _ids(lay)
    mask = (rowblk[:, None] == colblk[None, :]) & (a >= 0)[:, None]
    kb, vb = kb_ref[...], vb_ref[...]
    p, ds = _bwd_p_ds(q, kb, vb, do, lse, delta, mask, scale, prec)
    ds_c = ds.astype(kb.dtype)
    dq = dq + _dot(ds_c, kb, _NN, prec)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
    dkb_ref[...] = (_dot(ds_c, q, _TN, prec) * scale).astype(dkb_ref.dtype)
    dvb_ref[...] = _dot(p.astype(do.dtype), do, _TN, prec).astype(dvb_ref.dtype)


def _dkv_kernel(
    qlist_ref,
    qcount_ref,
    q_ref,
    do_ref,
    lse_ref,
    dl_ref,
    a_ref,
    s_ref,
    kc_ref,
    vc_ref,
    dk_ref,
    dv_ref,
    *,
    lay,
    scale,
    prec,
):
    tk, tqp = lay.tk, lay.tqp
    kt = pl.program_id(2)
    start = pl.multiple_of(kt * tk, tk)
    k = _load_ctx(kc_ref, start, tk, lay.s_len)
    v = _load_ctx(vc_ref, start, tk, lay.s_len)
    cols = start + jnp.arange(tk, dtype=jnp.int32)
    cnt = qcount_ref[kt]

    def body(i, carry):
        dk, dv = carry
        qt = qlist_ref[kt, i]
        r0 = pl.multiple_of(qt * tqp, tqp)
        q = q_ref[pl.ds(r0, tqp), :]
        do = do_ref[pl.ds(r0, tqp), :]
        lse = lse_ref[pl.ds(r0, tqp)]
        delta = dl_ref[pl.ds(r0, tqp)]
        a = a_ref[pl.ds(r0, tqp)]
        s = s_ref[pl.ds(r0, tqp)]
        p, ds = _bwd_p_ds(q, k, v, do, lse, delta, _ctx_mask(cols, a, s), scale, prec)
        dv = dv + _dot(p.astype(do.dtype), do, _TN, prec)
        dk = dk + _dot(ds.astype(q.dtype), q, _TN, prec)
        return dk, dv

    zeros = jnp.zeros((tk, lay.d), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, cnt, body, (zeros, zeros))
    ok = (cols < lay.s_len)[:, None]
    plgpu.store(dk_ref.at[pl.ds(start, tk), :], (dk * scale).astype(dk_ref.dtype), mask=ok)
    plgpu.store(dv_ref.at[pl.ds(start, tk), :], dv.astype(dv_ref.dtype), mask=ok)


def backward(lay, res, do_t, *, scale, interpret):
    q_t, kc, vc, kb_t, vb_t, a_rows, s_rows, o_t, lse = res
    b, hkv, d = lay.b, lay.hkv, lay.d
    rows = lay.nqt * lay.tqp
    prec = C.dot_precision(q_t.dtype)
    delta = jnp.sum(do_t.astype(jnp.float32) * o_t.astype(jnp.float32), axis=-1)
    do_t = do_t.astype(q_t.dtype)
    sp = _specs(lay)
    dq_t, dkb, dvb = pl.pallas_call(
        functools.partial(_dq_kernel, lay=lay, scale=scale, prec=prec),
        out_shape=[
            jax.ShapeDtypeStruct(q_t.shape, q_t.dtype),
            jax.ShapeDtypeStruct(kb_t.shape, kb_t.dtype),
            jax.ShapeDtypeStruct(vb_t.shape, vb_t.dtype),
        ],
        grid=(b, hkv, lay.nqt),
        in_specs=[
            sp["q"],
            sp["q"],
            sp["row"],
            sp["row"],
            sp["a"],
            sp["a"],
            sp["ctx"],
            sp["ctx"],
            sp["blk"],
            sp["blk"],
        ],
        out_specs=[sp["q"], sp["blk"], sp["blk"]],
        compiler_params=_params(lay),
        interpret=interpret,
        name="dflash_training_bwd_dq_triton",
    )(q_t, do_t, lse, delta, a_rows, s_rows, kc, vc, kb_t, vb_t)

    lo, hi, _, _ = TC.tile_bounds(a_rows, s_rows, lay)
    qlist, qcount = TC.kv_tile_lists(lo, hi, lay)
    nkt, nqt = lay.nkt, lay.nqt
    full_q = pl.BlockSpec((None, None, rows, d), lambda bi, hi, ki: (bi, hi, 0, 0))
    full_row = pl.BlockSpec((None, None, rows), lambda bi, hi, ki: (bi, hi, 0))
    ctx = pl.BlockSpec((None, lay.s_len, None, d), lambda bi, hi, ki: (bi, 0, hi, 0))
    dkc, dvc = pl.pallas_call(
        functools.partial(_dkv_kernel, lay=lay, scale=scale, prec=prec),
        out_shape=[
            jax.ShapeDtypeStruct(kc.shape, kc.dtype),
            jax.ShapeDtypeStruct(vc.shape, vc.dtype),
        ],
        grid=(b, hkv, nkt),
        in_specs=[
            pl.BlockSpec((None, nkt, nqt), lambda bi, hi, ki: (bi, 0, 0)),
            pl.BlockSpec((None, nkt), lambda bi, hi, ki: (bi, 0)),
            full_q,
            full_q,
            full_row,
            full_row,
            pl.BlockSpec((None, rows), lambda bi, hi, ki: (bi, 0)),
            pl.BlockSpec((None, rows), lambda bi, hi, ki: (bi, 0)),
            ctx,
            ctx,
        ],
        out_specs=[ctx, ctx],
        compiler_params=_params(lay),
        interpret=interpret,
        name="dflash_training_bwd_dkv_triton",
    )(qlist, qcount, q_t, do_t, lse, delta, a_rows, s_rows, kc, vc)
    return dq_t, dkc, dvc, dkb, dvb
