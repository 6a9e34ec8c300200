"""Pallas TPU kernels for DFlash training attention (forward + backward).

(Over ~450 lines on purpose: the forward and the two backward kernels share one tile layout.)

See _training_common for the row/tile layout and the mask.  One program
handles one kv head.  K/V-like [B, L, Hkv, D] arrays are presented to the
kernels as (tile, D) blocks: when D % 128 == 0 through the free view
[B, L, Hkv*D] (block (tile, D) at lane-block h), otherwise through a
head-major copy [B, Hkv, L, D] (D is then the full minor dim).  The context
is zero-padded to a multiple of the context tile.

forward  grid (B, Hkv, nqt, nkt+1): step i < hi-lo visits context tile
         lo+i, where [lo, hi) are the tiles the query tile's context windows
         [ctx_start, anchor) touch (scalar-prefetched, see
         TC.tile_bounds); the remaining steps are skipped with the
         index_map clamped to hi-1 so no DMA happens; tiles every row sees
         entirely take a mask-free path.  The last step adds the tile's own
         block keys (block-diagonal mask) and writes O and the log-sum-exp.
backward dq  kernel, same grid: dQ over context tiles + at the last step
         the block part, which also yields dK_blk / dV_blk (a block's keys
         are seen only by its own query tile).
         dkv kernel, grid (B, Hkv, nkt, nqt): dK_ctx / dV_ctx of one
         context tile accumulated over the compacted list of query tiles
         that see it (scalar-prefetched qlist / qcount).

Per-row statistics (anchor, block id, ctx start; lse, delta) travel as [rows, STAT]
arrays (value broadcast along STAT lanes) so they load as 2-D tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _common as C
from . import _training_common as TC
from .tpu_decode import _col, _online_update

STAT = 8  # lanes of per-row statistics in HBM (== full last dim)
POS = 1e30  # lse of rows that see nothing: exp(s - POS) == 0 in backward


class _KVView:
    """Presents [B, L, Hkv, D] arrays as per-head (tile, D) blocks (see doc)."""

    def __init__(self, hkv, d):
        self.hkv, self.d = hkv, d
        self.lane_view = d % 128 == 0

    def to(self, x):
        b, l = x.shape[:2]
        if self.lane_view:
            return x.reshape(b, l, self.hkv * self.d)
        return x.transpose(0, 2, 1, 3)

    def back(self, x):
        if self.lane_view:
            return x.reshape(x.shape[0], x.shape[1], self.hkv, self.d)
        return x.transpose(0, 2, 1, 3)

    def spec(self, tile, index):
        """index(*grid_and_prefetch) -> (b, h, tile_idx)."""
        if self.lane_view:

            def imap(*a):
                bi, hi, ti = index(*a)
                return bi, ti, hi

            return pl.BlockSpec((None, tile, self.d), imap)

        def imap_hm(*a):
            bi, hi, ti = index(*a)
            return bi, hi, ti, 0

        return pl.BlockSpec((None, None, tile, self.d), imap_hm)


# ----------------------------------------------------------------- forward --
def _bounds(bnd_ref, idx):
    """(lo, hi, flo, fhi) of query tile idx (see TC.tile_bounds)."""
    return tuple(bnd_ref[idx * 4 + c] for c in range(4))


def _ctx_mask(st_ref, t, tk, rows):
    """(rows, tk) mask of context tile t: ctx_start <= col < anchor."""
    col = t * tk + jax.lax.broadcasted_iota(jnp.int32, (rows, tk), 1)
    return (col >= _col(st_ref, 2)) & (col < _col(st_ref, 0))


def _fwd_kernel(
    bnd_ref,
    q_ref,
    st_ref,
    cb_ref,
    kc_ref,
    vc_ref,
    kb_ref,
    vb_ref,
    o_ref,
    lse_ref,
    m_ref,
    l_ref,
    acc_ref,
    *,
    tk,
    nkt,
    scale,
    prec,
):
    b, qt, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    lo, hi, flo, fhi = _bounds(bnd_ref, b * pl.num_programs(2) + qt)
    t = lo + i  # context tile visited by this step
    full = (t >= flo) & (t < fhi)
    rows = q_ref.shape[0]
    upd = functools.partial(
        _online_update, m_ref=m_ref, l_ref=l_ref, acc_ref=acc_ref, scale=scale, prec=prec
    )

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, C.NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((t < hi) & full)
    def _full():
        upd(q_ref[...], kc_ref[...], vc_ref[...])

    @pl.when((t < hi) & jnp.logical_not(full))
    def _partial():
        upd(q_ref[...], kc_ref[...], vc_ref[...], mask=_ctx_mask(st_ref, t, tk, rows))

    @pl.when(i == nkt)
    def _block_and_finalize():
        mask = (_col(st_ref, 1) == cb_ref[...][0:1, :]) & (_col(st_ref, 0) >= 0)
        upd(q_ref[...], kb_ref[...], vb_ref[...], mask=mask)
        l = _col(l_ref, 0)
        ok = l > 0.0
        lsafe = jnp.where(ok, l, 1.0)
        o_ref[...] = (acc_ref[...] / lsafe).astype(o_ref.dtype)
        lse = jnp.where(ok, _col(m_ref, 0) + jnp.log(lsafe), POS)
        lse_ref[...] = jnp.broadcast_to(lse, (rows, STAT))


def _prep(lay, kc, vc, kb_t, vb_t, a_rows, s_rows):
    view = _KVView(lay.hkv, lay.d)
    kc2 = view.to(C.pad_axis(kc, 1, lay.s_pad))
    vc2 = view.to(C.pad_axis(vc, 1, lay.s_pad))
    kb2, vb2 = view.to(kb_t), view.to(vb_t)
    rb = jnp.asarray(TC.row_block_ids(lay))
    st = jnp.stack([a_rows, jnp.broadcast_to(jnp.tile(rb, lay.nqt), a_rows.shape), s_rows], axis=-1)
    st = C.pad_axis(st, 2, STAT)  # [B, rows, STAT]
    cb = jnp.broadcast_to(jnp.asarray(TC.col_block_ids(lay))[None], (8, lay.bqp))
    lo, hi, flo, fhi = TC.tile_bounds(a_rows, s_rows, lay)  # [B, nqt] each
    bnd = jnp.stack([lo, hi, flo, fhi], axis=-1).reshape(-1)  # [B*nqt*4]
    return view, kc2, vc2, kb2, vb2, st, cb, bnd, (lo, hi, flo, fhi)


def _q_grid_specs(lay, view):
    """BlockSpecs for grids (B, Hkv, nqt, steps) with scalar prefetch bnd."""
    d, tqp, bqp, tk, nqt = lay.d, lay.tqp, lay.bqp, lay.tk, lay.nqt
    qmap = lambda bi, hi, qi, ii, *_: (bi, hi, qi, 0)

    def ctx_index(bi, hi, qi, ii, bnd_ref):
        lo, hi_t, _, _ = _bounds(bnd_ref, bi * nqt + qi)
        # Step ii visits tile lo+ii; steps past hi-1 repeat it (clamp: no DMA).
        return bi, hi, jnp.maximum(jnp.minimum(lo + ii, hi_t - 1), 0)

    return dict(
        q=pl.BlockSpec((None, None, tqp, d), qmap),
        stat_f=pl.BlockSpec((None, None, tqp, STAT), qmap),
        st=pl.BlockSpec((None, tqp, STAT), lambda bi, hi, qi, ii, *_: (bi, qi, 0)),
        cb=pl.BlockSpec((8, bqp), lambda *_: (0, 0)),
        ctx=view.spec(tk, ctx_index),
        blk=view.spec(bqp, lambda bi, hi, qi, ii, *_: (bi, hi, qi)),
    )


def forward(lay, q_t, kc, vc, kb_t, vb_t, a_rows, s_rows, *, scale, interpret):
    """Returns (o_t [B,Hkv,rows,D] in q dtype, lse [B,Hkv,rows,STAT] f32)."""
    view, kc2, vc2, kb2, vb2, st, cb, bnd, _ = _prep(lay, kc, vc, kb_t, vb_t, a_rows, s_rows)
    sp = _q_grid_specs(lay, view)
    rows = lay.nqt * lay.tqp
    kernel = functools.partial(
        _fwd_kernel, tk=lay.tk, nkt=lay.nkt, scale=scale, prec=C.dot_precision(q_t.dtype)
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(lay.b, lay.hkv, lay.nqt, lay.nkt + 1),
        in_specs=[sp["q"], sp["st"], sp["cb"], sp["ctx"], sp["ctx"], sp["blk"], sp["blk"]],
        out_specs=[sp["q"], sp["stat_f"]],
        scratch_shapes=[
            pltpu.VMEM((lay.tqp, C.LANES), jnp.float32),
            pltpu.VMEM((lay.tqp, C.LANES), jnp.float32),
            pltpu.VMEM((lay.tqp, lay.d), jnp.float32),
        ],
    )
    visible = lay.b * lay.hkv * lay.nqt * lay.tqp * (lay.s_len / 2 + lay.bqp)
    cost = pl.CostEstimate(
        flops=int(4 * visible * lay.d),
        transcendentals=int(visible),
        bytes_accessed=int(
            2 * (kc.size + kb_t.size) * kc.dtype.itemsize + 2 * q_t.size * q_t.dtype.itemsize
        ),
    )
    return pl.pallas_call(
        kernel,
        out_shape=[
            jax.ShapeDtypeStruct((lay.b, lay.hkv, rows, lay.d), q_t.dtype),
            jax.ShapeDtypeStruct((lay.b, lay.hkv, rows, STAT), jnp.float32),
        ],
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="dflash_training_fwd_tpu",
    )(bnd, q_t, st, cb, kc2, vc2, kb2, vb2)


# ---------------------------------------------------------------- backward --
def _bwd_scores(q, k, v, do, lse, delta, *, scale, prec, mask=None):
    s = jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=prec
    )
    p = jnp.exp(s * scale - lse)
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dp = jax.lax.dot_general(
        do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=prec
    )
    ds = p * (dp - delta)
    return p, ds


def _mm(a, b, dims, prec):
    return jax.lax.dot_general(
        a, b, (dims, ((), ())), preferred_element_type=jnp.float32, precision=prec
    )


_NN = ((1,), (0,))  # a @ b
_TN = ((0,), (0,))  # a.T @ b


def _dq_kernel(
    bnd_ref,
    q_ref,
    do_ref,
    lse_ref,
    dl_ref,
    st_ref,
    cb_ref,
    kc_ref,
    vc_ref,
    kb_ref,
    vb_ref,
    dq_ref,
    dkb_ref,
    dvb_ref,
    dq_acc,
    *,
    tk,
    nkt,
    scale,
    prec,
):
    b, qt, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    lo, hi, flo, fhi = _bounds(bnd_ref, b * pl.num_programs(2) + qt)
    t = lo + i
    full = (t >= flo) & (t < fhi)
    rows = q_ref.shape[0]

    @pl.when(i == 0)
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    def ctx_step(mask):
        k = kc_ref[...]
        _, ds = _bwd_scores(
            q_ref[...],
            k,
            vc_ref[...],
            do_ref[...],
            _col(lse_ref, 0),
            _col(dl_ref, 0),
            scale=scale,
            prec=prec,
            mask=mask,
        )
        dq_acc[...] += _mm(ds.astype(k.dtype), k, _NN, prec)

    @pl.when((t < hi) & full)
    def _full():
        ctx_step(None)

    @pl.when((t < hi) & jnp.logical_not(full))
    def _partial():
        ctx_step(_ctx_mask(st_ref, t, tk, rows))

    @pl.when(i == nkt)
    def _block():
        mask = (_col(st_ref, 1) == cb_ref[...][0:1, :]) & (_col(st_ref, 0) >= 0)
        q, do, kb = q_ref[...], do_ref[...], kb_ref[...]
        p, ds = _bwd_scores(
            q,
            kb,
            vb_ref[...],
            do,
            _col(lse_ref, 0),
            _col(dl_ref, 0),
            scale=scale,
            prec=prec,
            mask=mask,
        )
        ds_c = ds.astype(kb.dtype)
        dq = dq_acc[...] + _mm(ds_c, kb, _NN, prec)
        dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
        dkb_ref[...] = (_mm(ds_c, q, _TN, prec) * scale).astype(dkb_ref.dtype)
        dvb_ref[...] = _mm(p.astype(do.dtype), do, _TN, prec).astype(dvb_ref.dtype)


def _dkv_kernel(
    qlist_ref,
    qcount_ref,
    bnd_ref,
    q_ref,
    do_ref,
    lse_ref,
    dl_ref,
    st_ref,
    kc_ref,
    vc_ref,
    dk_ref,
    dv_ref,
    dk_acc,
    dv_acc,
    *,
    tk,
    nqt,
    nkt,
    scale,
    prec,
):
    b, kt, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    lidx = b * nkt + kt
    cnt = qcount_ref[lidx]
    qt = qlist_ref[lidx * nqt + i]
    _, _, flo, fhi = _bounds(bnd_ref, b * nqt + qt)
    full = (kt >= flo) & (kt < fhi)
    rows = q_ref.shape[0]

    @pl.when(i == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    def step(mask):
        q, do = q_ref[...], do_ref[...]
        p, ds = _bwd_scores(
            q,
            kc_ref[...],
            vc_ref[...],
            do,
            _col(lse_ref, 0),
            _col(dl_ref, 0),
            scale=scale,
            prec=prec,
            mask=mask,
        )
        dv_acc[...] += _mm(p.astype(do.dtype), do, _TN, prec)
        dk_acc[...] += _mm(ds.astype(q.dtype), q, _TN, prec)

    @pl.when((i < cnt) & full)
    def _full():
        step(None)

    @pl.when((i < cnt) & jnp.logical_not(full))
    def _partial():
        step(_ctx_mask(st_ref, kt, tk, rows))

    @pl.when(i == nqt - 1)
    def _write():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def backward(lay, res, do_t, *, scale, interpret):
    q_t, kc, vc, kb_t, vb_t, a_rows, s_rows, o_t, lse = res
    view, kc2, vc2, kb2, vb2, st, cb, bnd, (lo, hi, _, _) = _prep(
        lay, kc, vc, kb_t, vb_t, a_rows, s_rows
    )
    b, hkv, d = lay.b, lay.hkv, lay.d
    rows = lay.nqt * lay.tqp
    prec = C.dot_precision(q_t.dtype)
    delta = jnp.sum(do_t.astype(jnp.float32) * o_t.astype(jnp.float32), axis=-1)
    delta = jnp.broadcast_to(delta[..., None], (b, hkv, rows, STAT))
    do_t = do_t.astype(q_t.dtype)
    sems = ("parallel", "parallel", "parallel", "arbitrary")

    # dQ (+ dK_blk, dV_blk)
    sp = _q_grid_specs(lay, view)
    dq_t, dkb2, dvb2 = pl.pallas_call(
        functools.partial(_dq_kernel, tk=lay.tk, nkt=lay.nkt, scale=scale, prec=prec),
        out_shape=[
            jax.ShapeDtypeStruct(q_t.shape, q_t.dtype),
            jax.ShapeDtypeStruct(kb2.shape, kb_t.dtype),
            jax.ShapeDtypeStruct(vb2.shape, vb_t.dtype),
        ],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, lay.nqt, lay.nkt + 1),
            in_specs=[
                sp["q"],
                sp["q"],
                sp["stat_f"],
                sp["stat_f"],
                sp["st"],
                sp["cb"],
                sp["ctx"],
                sp["ctx"],
                sp["blk"],
                sp["blk"],
            ],
            out_specs=[sp["q"], sp["blk"], sp["blk"]],
            scratch_shapes=[pltpu.VMEM((lay.tqp, d), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=sems),
        interpret=interpret,
        name="dflash_training_bwd_dq_tpu",
    )(bnd, q_t, do_t, lse, delta, st, cb, kc2, vc2, kb2, vb2)

    # dK_ctx, dV_ctx: grid over context tiles, inner loop over the query tiles
    # that see the tile (compacted list, scalar-prefetched).
    qlist, qcount = TC.kv_tile_lists(lo, hi, lay)
    nqt, nkt = lay.nqt, lay.nkt

    def qsel(bi, hi, ki, ii, ql_ref, *_):
        return bi, hi, ql_ref[(bi * nkt + ki) * nqt + ii], 0

    def stsel(bi, hi, ki, ii, ql_ref, *_):
        return bi, ql_ref[(bi * nkt + ki) * nqt + ii], 0

    ctx_spec = view.spec(lay.tk, lambda bi, hi, ki, ii, *_: (bi, hi, ki))
    q_spec = pl.BlockSpec((None, None, lay.tqp, d), qsel)
    f_spec = pl.BlockSpec((None, None, lay.tqp, STAT), qsel)
    st_spec = pl.BlockSpec((None, lay.tqp, STAT), stsel)
    dk2, dv2 = pl.pallas_call(
        functools.partial(_dkv_kernel, tk=lay.tk, nqt=nqt, nkt=nkt, scale=scale, prec=prec),
        out_shape=[
            jax.ShapeDtypeStruct(kc2.shape, kc.dtype),
            jax.ShapeDtypeStruct(vc2.shape, vc.dtype),
        ],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, hkv, nkt, nqt),
            in_specs=[q_spec, q_spec, f_spec, f_spec, st_spec, ctx_spec, ctx_spec],
            out_specs=[ctx_spec, ctx_spec],
            scratch_shapes=[
                pltpu.VMEM((lay.tk, d), jnp.float32),
                pltpu.VMEM((lay.tk, d), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=sems),
        interpret=interpret,
        name="dflash_training_bwd_dkv_tpu",
    )(qlist.reshape(-1), qcount.reshape(-1), bnd, q_t, do_t, lse, delta, st, kc2, vc2)

    dkc = view.back(dk2)[:, : lay.s_len]
    dvc = view.back(dv2)[:, : lay.s_len]
    return dq_t, dkc, dvc, view.back(dkb2), view.back(dvb2)
