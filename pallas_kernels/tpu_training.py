"""Pallas TPU kernels for DFlash training attention (forward + backward).

See _training_common for the row/tile layout and the mask.  Context K/V are
viewed as [B, S_pad, Hkv*D] (S padded to the tile), block K/V as
[B, nqt*BQP, Hkv*D]; hb kv heads are handled per program (see tpu_decode).

forward  grid (B, Hkv/hb, nqt, nkt+1): steps 0..nkt-1 visit context tiles
         (tiles >= cdiv(max anchor of the query tile, tk) are skipped, their
         index_map clamped so no DMA happens; tiles below min anchor take a
         mask-free path), the last step adds the tile's own block keys
         (block-diagonal mask) and writes O and the log-sum-exp.
backward dq  kernel, same grid: dQ over context tiles + at the last step
         the block part, which also yields dK_blk / dV_blk (a block's keys
         are seen only by its own query tile).
         dkv kernel, grid (B, Hkv/hb, nkt, nqt): dK_ctx / dV_ctx of one
         context tile accumulated over the compacted list of query tiles
         that see it (scalar-prefetched qlist / qcount).

Per-row statistics (anchor, block id, lse, delta) travel as [rows, STAT]
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
from .tpu_decode import _heads_per_block, _online_update

STAT = 8      # lanes of per-row statistics in HBM (== full last dim)
POS = 1e30    # lse of rows that see nothing: exp(s - POS) == 0 in backward


def _cdiv(a, b):
  return jax.lax.div(a + (b - 1), b)


def _dims(hb, d, hh):
  return slice(hh * d, (hh + 1) * d)


# ----------------------------------------------------------------- forward --
def _fwd_kernel(tmax_ref, tmin_ref, q_ref, st_ref, cb_ref, kc_ref, vc_ref,
                kb_ref, vb_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *,
                hb, d, tk, nkt, scale, prec):
  b, qt, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  idx = b * pl.num_programs(2) + qt
  n_ctx = _cdiv(tmax_ref[idx], tk)
  n_full = jax.lax.div(jnp.maximum(tmin_ref[idx], 0), tk)
  rows = q_ref.shape[1]

  @pl.when(i == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, C.NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(i < n_full)
  def _full():
    for hh in range(hb):
      _online_update(q_ref[hh], kc_ref[:, _dims(hb, d, hh)],
                     vc_ref[:, _dims(hb, d, hh)], m_ref, l_ref, acc_ref, hh,
                     scale=scale, prec=prec)

  @pl.when((i >= n_full) & (i < n_ctx))
  def _partial():
    a = st_ref[:, 0:1]
    col = i * tk + jax.lax.broadcasted_iota(jnp.int32, (rows, tk), 1)
    mask = col < a
    for hh in range(hb):
      _online_update(q_ref[hh], kc_ref[:, _dims(hb, d, hh)],
                     vc_ref[:, _dims(hb, d, hh)], m_ref, l_ref, acc_ref, hh,
                     scale=scale, prec=prec, mask=mask)

  @pl.when(i == nkt)
  def _block_and_finalize():
    a = st_ref[:, 0:1]
    mask = (st_ref[:, 1:2] == cb_ref[0:1, :]) & (a >= 0)
    for hh in range(hb):
      _online_update(q_ref[hh], kb_ref[:, _dims(hb, d, hh)],
                     vb_ref[:, _dims(hb, d, hh)], m_ref, l_ref, acc_ref, hh,
                     scale=scale, prec=prec, mask=mask)
      l = l_ref[hh][:, 0:1]
      ok = l > 0.0
      lsafe = jnp.where(ok, l, 1.0)
      o_ref[hh] = (acc_ref[hh] / lsafe).astype(o_ref.dtype)
      lse = jnp.where(ok, m_ref[hh][:, 0:1] + jnp.log(lsafe), POS)
      lse_ref[hh] = jnp.broadcast_to(lse, (rows, STAT))


def _prep(lay, q_t, kc, vc, kb_t, vb_t, a_rows):
  b, hkv, d = lay.b, lay.hkv, lay.d
  kc2 = C.pad_axis(kc, 1, lay.s_pad).reshape(b, lay.s_pad, hkv * d)
  vc2 = C.pad_axis(vc, 1, lay.s_pad).reshape(b, lay.s_pad, hkv * d)
  kb2 = kb_t.reshape(b, lay.nqt * lay.bqp, hkv * d)
  vb2 = vb_t.reshape(b, lay.nqt * lay.bqp, hkv * d)
  rb = jnp.asarray(TC.row_block_ids(lay))
  st = jnp.stack([a_rows, jnp.broadcast_to(jnp.tile(rb, lay.nqt), a_rows.shape)],
                 axis=-1)
  st = C.pad_axis(st, 2, STAT)                                   # [B, rows, STAT]
  cb = jnp.broadcast_to(jnp.asarray(TC.col_block_ids(lay))[None], (8, lay.bqp))
  tmax, tmin = TC.tile_bounds(a_rows, lay)
  return kc2, vc2, kb2, vb2, st, cb, tmax.reshape(-1), tmin.reshape(-1)


def _common_specs(lay, hb, ctx_map):
  d, tqp, bqp = lay.d, lay.tqp, lay.bqp
  qmap = lambda bi, hi, qi, ii, *_: (bi, hi, qi, 0)
  return dict(
      q=pl.BlockSpec((None, hb, tqp, d), qmap),
      stat_f=pl.BlockSpec((None, hb, tqp, STAT), qmap),
      st=pl.BlockSpec((None, tqp, STAT), lambda bi, hi, qi, ii, *_: (bi, qi, 0)),
      cb=pl.BlockSpec((8, bqp), lambda *_: (0, 0)),
      ctx=pl.BlockSpec((None, lay.tk, hb * d), ctx_map),
      blk=pl.BlockSpec((None, bqp, hb * d), lambda bi, hi, qi, ii, *_: (bi, qi, hi)),
  )


def _q_grid_ctx_map(lay):
  def ctx_map(bi, hi, qi, ii, tmax_ref, tmin_ref):
    n_ctx = _cdiv(tmax_ref[bi * lay.nqt + qi], lay.tk)
    return bi, jnp.maximum(jnp.minimum(ii, n_ctx - 1), 0), hi
  return ctx_map


def forward(lay, q_t, kc, vc, kb_t, vb_t, a_rows, *, scale, interpret):
  """Returns (o_t [B,Hkv,rows,D] in q dtype, lse [B,Hkv,rows,STAT] f32)."""
  kc2, vc2, kb2, vb2, st, cb, tmax, tmin = _prep(lay, q_t, kc, vc, kb_t, vb_t, a_rows)
  hb = _heads_per_block(lay.hkv, lay.d)
  sp = _common_specs(lay, hb, _q_grid_ctx_map(lay))
  rows = lay.nqt * lay.tqp
  kernel = functools.partial(_fwd_kernel, hb=hb, d=lay.d, tk=lay.tk, nkt=lay.nkt,
                             scale=scale, prec=C.dot_precision(q_t.dtype))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(lay.b, lay.hkv // hb, lay.nqt, lay.nkt + 1),
      in_specs=[sp["q"], sp["st"], sp["cb"], sp["ctx"], sp["ctx"], sp["blk"], sp["blk"]],
      out_specs=[sp["q"], sp["stat_f"]],
      scratch_shapes=[pltpu.VMEM((hb, lay.tqp, C.LANES), jnp.float32),
                      pltpu.VMEM((hb, lay.tqp, C.LANES), jnp.float32),
                      pltpu.VMEM((hb, lay.tqp, lay.d), jnp.float32)])
  return pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct((lay.b, lay.hkv, rows, lay.d), q_t.dtype),
                 jax.ShapeDtypeStruct((lay.b, lay.hkv, rows, STAT), jnp.float32)],
      grid_spec=grid_spec,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="dflash_training_fwd_tpu",
  )(tmax, tmin, q_t, st, cb, kc2, vc2, kb2, vb2)


# ---------------------------------------------------------------- backward --
def _bwd_scores(q, k, v, do, lse, delta, *, scale, prec, mask=None):
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32, precision=prec)
  p = jnp.exp(s * scale - lse)
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32, precision=prec)
  ds = p * (dp - delta)
  return p, ds


def _dq_kernel(tmax_ref, tmin_ref, q_ref, do_ref, lse_ref, dl_ref, st_ref, cb_ref,
               kc_ref, vc_ref, kb_ref, vb_ref, dq_ref, dkb_ref, dvb_ref, dq_acc,
               *, hb, d, tk, nkt, scale, prec):
  b, qt, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  idx = b * pl.num_programs(2) + qt
  n_ctx = _cdiv(tmax_ref[idx], tk)
  n_full = jax.lax.div(jnp.maximum(tmin_ref[idx], 0), tk)
  rows = q_ref.shape[1]

  @pl.when(i == 0)
  def _init():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

  def ctx_step(mask):
    for hh in range(hb):
      k = kc_ref[:, _dims(hb, d, hh)]
      _, ds = _bwd_scores(q_ref[hh], k, vc_ref[:, _dims(hb, d, hh)], do_ref[hh],
                          lse_ref[hh][:, 0:1], dl_ref[hh][:, 0:1],
                          scale=scale, prec=prec, mask=mask)
      dq_acc[hh] += jax.lax.dot_general(
          ds.astype(k.dtype), k, (((1,), (0,)), ((), ())),
          preferred_element_type=jnp.float32, precision=prec)

  @pl.when(i < n_full)
  def _full():
    ctx_step(None)

  @pl.when((i >= n_full) & (i < n_ctx))
  def _partial():
    col = i * tk + jax.lax.broadcasted_iota(jnp.int32, (rows, tk), 1)
    ctx_step(col < st_ref[:, 0:1])

  @pl.when(i == nkt)
  def _block():
    mask = (st_ref[:, 1:2] == cb_ref[0:1, :]) & (st_ref[:, 0:1] >= 0)
    for hh in range(hb):
      q, do = q_ref[hh], do_ref[hh]
      kb = kb_ref[:, _dims(hb, d, hh)]
      p, ds = _bwd_scores(q, kb, vb_ref[:, _dims(hb, d, hh)], do,
                          lse_ref[hh][:, 0:1], dl_ref[hh][:, 0:1],
                          scale=scale, prec=prec, mask=mask)
      ds_c = ds.astype(kb.dtype)
      dq = dq_acc[hh] + jax.lax.dot_general(
          ds_c, kb, (((1,), (0,)), ((), ())),
          preferred_element_type=jnp.float32, precision=prec)
      dq_ref[hh] = (dq * scale).astype(dq_ref.dtype)
      dkb = jax.lax.dot_general(ds_c, q, (((0,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32, precision=prec)
      dkb_ref[:, _dims(hb, d, hh)] = (dkb * scale).astype(dkb_ref.dtype)
      dvb = jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32, precision=prec)
      dvb_ref[:, _dims(hb, d, hh)] = dvb.astype(dvb_ref.dtype)


def _dkv_kernel(qlist_ref, qcount_ref, tmin_ref, q_ref, do_ref, lse_ref, dl_ref,
                st_ref, kc_ref, vc_ref, dk_ref, dv_ref, dk_acc, dv_acc, *,
                hb, d, tk, nqt, nkt, scale, prec):
  b, kt, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  lidx = b * nkt + kt
  cnt = qcount_ref[lidx]
  qt = qlist_ref[lidx * nqt + i]
  full = tmin_ref[b * nqt + qt] >= (kt + 1) * tk
  rows = q_ref.shape[1]

  @pl.when(i == 0)
  def _init():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  def step(mask):
    for hh in range(hb):
      q, do = q_ref[hh], do_ref[hh]
      p, ds = _bwd_scores(q, kc_ref[:, _dims(hb, d, hh)], vc_ref[:, _dims(hb, d, hh)],
                          do, lse_ref[hh][:, 0:1], dl_ref[hh][:, 0:1],
                          scale=scale, prec=prec, mask=mask)
      dv_acc[hh] += jax.lax.dot_general(
          p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
          preferred_element_type=jnp.float32, precision=prec)
      dk_acc[hh] += jax.lax.dot_general(
          ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
          preferred_element_type=jnp.float32, precision=prec)

  @pl.when((i < cnt) & full)
  def _full():
    step(None)

  @pl.when((i < cnt) & jnp.logical_not(full))
  def _partial():
    col = kt * tk + jax.lax.broadcasted_iota(jnp.int32, (rows, tk), 1)
    step(col < st_ref[:, 0:1])

  @pl.when(i == nqt - 1)
  def _write():
    for hh in range(hb):
      dk_ref[:, _dims(hb, d, hh)] = (dk_acc[hh] * scale).astype(dk_ref.dtype)
      dv_ref[:, _dims(hb, d, hh)] = dv_acc[hh].astype(dv_ref.dtype)


def backward(lay, res, do_t, *, scale, interpret):
  q_t, kc, vc, kb_t, vb_t, a_rows, o_t, lse = res
  kc2, vc2, kb2, vb2, st, cb, tmax, tmin = _prep(lay, q_t, kc, vc, kb_t, vb_t, a_rows)
  hb = _heads_per_block(lay.hkv, lay.d)
  b, hkv, d = lay.b, lay.hkv, lay.d
  rows = lay.nqt * lay.tqp
  prec = C.dot_precision(q_t.dtype)
  delta = jnp.sum(do_t.astype(jnp.float32) * o_t.astype(jnp.float32), axis=-1)
  delta = jnp.broadcast_to(delta[..., None], (b, hkv, rows, STAT))
  do_t = do_t.astype(q_t.dtype)
  sems = ("parallel", "parallel", "parallel", "arbitrary")

  # dQ (+ dK_blk, dV_blk)
  sp = _common_specs(lay, hb, _q_grid_ctx_map(lay))
  dq_t, dkb2, dvb2 = pl.pallas_call(
      functools.partial(_dq_kernel, hb=hb, d=d, tk=lay.tk, nkt=lay.nkt,
                        scale=scale, prec=prec),
      out_shape=[jax.ShapeDtypeStruct(q_t.shape, q_t.dtype),
                 jax.ShapeDtypeStruct(kb2.shape, kb_t.dtype),
                 jax.ShapeDtypeStruct(vb2.shape, vb_t.dtype)],
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(b, hkv // hb, lay.nqt, lay.nkt + 1),
          in_specs=[sp["q"], sp["q"], sp["stat_f"], sp["stat_f"], sp["st"], sp["cb"],
                    sp["ctx"], sp["ctx"], sp["blk"], sp["blk"]],
          out_specs=[sp["q"], sp["blk"], sp["blk"]],
          scratch_shapes=[pltpu.VMEM((hb, lay.tqp, d), jnp.float32)]),
      compiler_params=pltpu.CompilerParams(dimension_semantics=sems),
      interpret=interpret,
      name="dflash_training_bwd_dq_tpu",
  )(tmax, tmin, q_t, do_t, lse, delta, st, cb, kc2, vc2, kb2, vb2)

  # dK_ctx, dV_ctx
  qlist, qcount = TC.kv_tile_lists(tmax.reshape(b, lay.nqt), lay)
  nqt, nkt = lay.nqt, lay.nkt

  def qsel(bi, hi, ki, ii, ql_ref, qc_ref, tm_ref):
    return bi, hi, ql_ref[(bi * nkt + ki) * nqt + ii], 0

  def stsel(bi, hi, ki, ii, ql_ref, qc_ref, tm_ref):
    return bi, ql_ref[(bi * nkt + ki) * nqt + ii], 0

  ctx_spec = pl.BlockSpec((None, lay.tk, hb * d), lambda bi, hi, ki, ii, *_: (bi, ki, hi))
  q_spec = pl.BlockSpec((None, hb, lay.tqp, d), qsel)
  f_spec = pl.BlockSpec((None, hb, lay.tqp, STAT), qsel)
  st_spec = pl.BlockSpec((None, lay.tqp, STAT), stsel)
  dk2, dv2 = pl.pallas_call(
      functools.partial(_dkv_kernel, hb=hb, d=d, tk=lay.tk, nqt=nqt, nkt=nkt,
                        scale=scale, prec=prec),
      out_shape=[jax.ShapeDtypeStruct(kc2.shape, kc.dtype),
                 jax.ShapeDtypeStruct(vc2.shape, vc.dtype)],
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(b, hkv // hb, nkt, nqt),
          in_specs=[q_spec, q_spec, f_spec, f_spec, st_spec, ctx_spec, ctx_spec],
          out_specs=[ctx_spec, ctx_spec],
          scratch_shapes=[pltpu.VMEM((hb, lay.tk, d), jnp.float32),
                          pltpu.VMEM((hb, lay.tk, d), jnp.float32)]),
      compiler_params=pltpu.CompilerParams(dimension_semantics=sems),
      interpret=interpret,
      name="dflash_training_bwd_dkv_tpu",
  )(qlist.reshape(-1), qcount.reshape(-1), tmin, q_t, do_t, lse, delta, st, kc2, vc2)

  dkc = dk2.reshape(b, lay.s_pad, hkv, d)[:, : lay.s_len]
  dvc = dv2.reshape(b, lay.s_pad, hkv, d)[:, : lay.s_len]
  dkb = dkb2.reshape(kb_t.shape)
  dvb = dvb2.reshape(vb_t.shape)
  return dq_t, dkc, dvc, dkb, dvb
