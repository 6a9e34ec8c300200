"""Pallas TPU (Mosaic) flash-decoding kernel for verify and draft attention.

One kernel serves both:
  * verify: keys = KV cache, row r (query t, group head g) sees slot j iff
    j <= lim[r] with lim = q_positions[b, t];
  * draft:  keys = [context ; block]; context slot j visible iff
    j <= lim[r] = ctx_len[b] - 1, and all T block keys are visible (handled
    once, by split 0, from a separate small input).

Layout.  Queries of one kv head are gathered into a [R, D] tile of rows
r = t*G + g (all T queries x G heads, padded to the sublane multiple), so
each grid step is an (R x D) @ (D x tk) matmul against one K tile.  The cache
[B, S, Hkv, D] is viewed (free reshape, no copy) as [B, S, Hkv*D]; a K/V
block is (tk, W) with W = hb*D lanes covering hb kv heads: hb = 1 when
D % 128 == 0 (Qwen3: D = 128), else the smallest group making W a multiple
of 128 (D = 64 -> hb = 2).  For hb > 1 the query tile is expanded block-
diagonally to [hb*R, W] (row block i holds head i's queries in lanes
i*D:(i+1)*D, zeros elsewhere), so one plain matmul yields every head's scores
without any unaligned lane slicing; the off-diagonal blocks of the
[hb*R, W] accumulator are discarded in the epilogue.  That doubles MXU work
for D = 64, which is free in this memory-bound kernel.

Grid (B, Hkv/hb, NS, tiles_per_split): the KV length actually needed,
kv_len[b] = max(lim[b]) + 1 (scalar prefetch), is split into NS contiguous
ranges; each split writes a normalised partial output and its log-sum-exp,
merged afterwards (combine_splits).  Tiles past kv_len are skipped: their
index_map is clamped to the last needed tile (no new DMA) and the body is
guarded by pl.when.  Tiles every row sees completely take a mask-free path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _common as C
from .reference import default_scale


# Query rows x lanes of one program above which the KV tile is halved (see decode_attention):
# 2048 rows (512 queries x 4 per KV head) of 128 lanes, Qwen3-8B's prefill chunk, still fits.
_BIG_QUERY_BLOCK = 2048 * 128
# ... and above which the queries are split into chunks, one kernel call each (twice the above:
# 2048 rows of 256 lanes at a KV tile of 256 fit). SmolLM2's 512-token prefill chunk (9 query /
# 3 KV heads of 64: hb = 3, 4608 rows of 192 lanes) ran out of v5e's scoped VMEM in one call.
_MAX_QUERY_BLOCK = 2 * _BIG_QUERY_BLOCK


def _query_chunk(t: int, g: int, hb: int, d: int, sub: int) -> int:
    """Queries per call so that one program's block, hb * round_up(tc * g, sub) rows of hb * d
    lanes, stays within _MAX_QUERY_BLOCK: the fewest calls, of equal length (the last one
    shorter only by the remainder)."""
    most = max(1, _MAX_QUERY_BLOCK // (hb * hb * d) // g)
    while most > 1 and hb * C.round_up(most * g, sub) * hb * d > _MAX_QUERY_BLOCK:
        most -= 1
    return C.cdiv(t, C.cdiv(t, most))


def _choose_kv_tile(s: int, block_k: int, align: int):
    """Returns (tk, padded_S): the largest power-of-two tile from block_k down to 128 dividing
    S; else the largest multiple of `align` in [128, block_k] dividing S (a chip's share of a
    sequence-split cache, 33,280 / 8 = 4,160 positions: 416); else block_k over S padded (a
    copy of the cache at each call)."""
    if s <= block_k:
        tk = C.round_up(s, align)
        return tk, tk
    t = block_k
    while t >= 128 and s % t:
        t //= 2
    if t >= 128 and s % t == 0:
        return t, s
    for t in range(block_k // align * align, 127, -align):
        if s % t == 0:
            return t, s
    return block_k, C.round_up(s, block_k)


def _in_query_chunks(call, q, lim, blk_mask, tc: int):
    """call(q, lim=, blk_mask=) over the queries in chunks of tc, concatenated on the query
    axis (each part of an (output, lse) pair alike)."""
    chunk = lambda x, i: None if x is None else x[:, i : i + tc]  # noqa: E731
    parts = [
        call(q[:, i : i + tc], lim=lim[:, i : i + tc], blk_mask=chunk(blk_mask, i))
        for i in range(0, q.shape[1], tc)
    ]
    if isinstance(parts[0], tuple):
        return tuple(jnp.concatenate([p[j] for p in parts], axis=1) for j in range(2))
    return jnp.concatenate(parts, axis=1)


def _heads_per_block(hkv: int, d: int) -> int:
    for hb in range(1, hkv + 1):
        if hkv % hb == 0 and (hb * d) % 128 == 0:
            return hb
    return hkv


def _split_tile(kv_len, s, i, *, tk, ns):
    """KV tile visited at grid point (split s, step i), clamped (see module doc)."""
    # lax.div (truncating) on non-negative ints: `//` would lower a sign op.
    needed = jax.lax.div(kv_len + (tk - 1), tk)
    per = jax.lax.div(needed + (ns - 1), ns)
    j = s * per + jnp.minimum(i, jnp.maximum(per - 1, 0))
    return jnp.maximum(jnp.minimum(j, needed - 1), 0), needed, per


def _col(ref, c: int):
    """Column c of a per-row statistics tile as an (rows, 1) value.

    Loads the whole (rows, lanes) tile and slices the value (rather than the
    ref) so the load stays tile-aligned.
    """
    return ref[...][:, c : c + 1]


def _online_update(q, k, v, m_ref, l_ref, acc_ref, *, scale, prec, mask=None, v_rows_valid=None):
    """One flash-attention step on VMEM scratch m/l (rows, LANES), acc (rows, W)."""
    s = jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=prec
    )
    s = s * scale
    if mask is not None:
        s = jnp.where(mask, s, C.NEG)
    m_prev = m_ref[...]  # (R, LANES)
    l_prev = l_ref[...]
    m_cur = jnp.max(s, axis=1, keepdims=True)  # (R, 1)
    m_new = jnp.maximum(m_prev, m_cur)  # (R, LANES)
    m1 = m_new[:, :1]
    p = jnp.exp(s - m1)
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_new
    if v_rows_valid is not None:  # stale / padded slots may hold non-finite data
        v = jnp.where(v_rows_valid, v, jnp.zeros_like(v))
    pv = jax.lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=prec,
    )
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv


def _decode_kernel(
    kvlen_ref,
    minlim_ref,
    q_ref,
    lim_ref,
    k_ref,
    v_ref,
    *rest,
    tk,
    ns,
    scale,
    prec,
    blk_len,
    blk_masked=False,
):
    bm_ref = None
    if blk_len and blk_masked:
        bk_ref, bv_ref, bm_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    elif blk_len:
        bk_ref, bv_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    else:
        o_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    b = pl.program_id(0)
    s = pl.program_id(2)
    i = pl.program_id(3)
    kv_len = kvlen_ref[b]
    min_lim = minlim_ref[b]
    rows, w = q_ref.shape
    upd = functools.partial(
        _online_update, m_ref=m_ref, l_ref=l_ref, acc_ref=acc_ref, scale=scale, prec=prec
    )

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, C.NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    if blk_len:

        @pl.when((i == 0) & (s == 0))
        def _block_keys():
            tb = bk_ref.shape[0]
            mask = jax.lax.broadcasted_iota(jnp.int32, (rows, tb), 1) < blk_len
            if bm_ref is not None:  # a draft tree's ancestor mask, keys on the lane axis
                mask = mask & (bm_ref[...] != 0)
            vrow = jax.lax.broadcasted_iota(jnp.int32, (tb, w), 0) < blk_len
            upd(q_ref[...], bk_ref[...], bv_ref[...], mask=mask, v_rows_valid=vrow)

    _, needed, per = _split_tile(kv_len, s, i, tk=tk, ns=ns)
    j = s * per + i
    start = j * tk
    active = (i < per) & (j < needed)
    full = active & (start + tk - 1 <= min_lim)

    @pl.when(full)
    def _full_tile():
        upd(q_ref[...], k_ref[...], v_ref[...])

    @pl.when(active & jnp.logical_not(full))
    def _partial_tile():
        lim = _col(lim_ref, 0)  # (R, 1)
        col = start + jax.lax.broadcasted_iota(jnp.int32, (rows, tk), 1)
        vrow = (start + jax.lax.broadcasted_iota(jnp.int32, (tk, w), 0)) < kv_len
        upd(q_ref[...], k_ref[...], v_ref[...], mask=col <= lim, v_rows_valid=vrow)

    @pl.when(i == pl.num_programs(3) - 1)
    def _finalize():
        l = l_ref[...]
        ok = l > 0.0
        lsafe = jnp.where(ok, l, 1.0)
        o_ref[...] = acc_ref[...] / lsafe[:, :1]
        lse_ref[...] = jnp.where(ok, m_ref[...] + jnp.log(lsafe), C.NEG)


def expand_heads(x, hb: int):
    """[B, Hkv, R, D] -> [B, Hkv/hb, hb*R, hb*D] block-diagonal (see module doc)."""
    if hb == 1:
        return x
    b, hkv, r, d = x.shape
    x = x.reshape(b, hkv // hb, hb, r, d)
    eye = jnp.eye(hb, dtype=x.dtype)
    x = jnp.einsum("bkirD,ij->bkirjD", x, eye)
    return x.reshape(b, hkv // hb, hb * r, hb * d)


def collapse_heads(x, hb: int):
    """Inverse of expand_heads on [..., Hkv/hb, hb*R, hb*D] -> [..., Hkv, R, D]."""
    if hb == 1:
        return x
    *lead, hg, rr, ww = x.shape
    r, d = rr // hb, ww // hb
    x = x.reshape(*lead, hg, hb, r, hb, d)
    x = jnp.diagonal(x, axis1=-4, axis2=-2)  # [..., hg, r, d, hb]
    x = jnp.moveaxis(x, -1, -3)  # [..., hg, hb, r, d]
    return x.reshape(*lead, hg * hb, r, d)


def _pallas_decode(kernel, scalars, args, in_specs, grid, hr, w, stacked, cost, interpret):
    """The decode kernel's pallas_call over grid (B, head groups, splits, steps): per split
    the unnormalized output [hr, w] and log-sum-exp [hr, LANES] in float32, with the online
    softmax's running max, sum and accumulator in VMEM scratch. A stack's layer index is a
    third scalar prefetch that only the index maps read."""
    b, hg, ns, _ = grid
    out_map = lambda bi, hi, si, ii, *_: (bi, hi, si, 0, 0)  # noqa: E731
    out_specs = [
        pl.BlockSpec((None, None, None, hr, w), out_map),
        pl.BlockSpec((None, None, None, hr, C.LANES), out_map),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, hg, ns, hr, w), jnp.float32),
        jax.ShapeDtypeStruct((b, hg, ns, hr, C.LANES), jnp.float32),
    ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((hr, C.LANES), jnp.float32),
            pltpu.VMEM((hr, C.LANES), jnp.float32),
            pltpu.VMEM((hr, w), jnp.float32),
        ],
    )
    if stacked:
        body = kernel
        kernel = lambda kvlen, minlim, _layer, *refs: body(kvlen, minlim, *refs)  # noqa: E731
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        cost_estimate=cost,
        interpret=interpret,
        # A stack's kernel reads one layer of its [L, ...] operands and declares those bytes
        # (cost estimate: the layer's K/V at capacity, as a single cache is charged).
        name="dflash_decode_attention_tpu_stacked" if stacked else "dflash_decode_attention_tpu",
    )(*scalars, *args)


def _kv_operands(k, v, s_pad, tk, ns, w, stacked, interpret=False):
    """(BlockSpecs, K, V) of `decode_attention`'s cache: [B, S_pad, Hkv*D] free views (padded
    to whole tiles), or of a stack [L, B, S, Hkv*D] whose layer the index maps pick (the third
    scalar prefetch); a program reads tile j of its split (`_split_tile`), its heads' lanes.
    Compiled, K and V are constrained to HBM: the kernel streams them in tiles, and left to
    itself XLA's memory-space assignment may prefetch a whole cache that fits VMEM (a drafter's
    unsplit context cache, 68 MB on Qwen3.5-9B at 32K) into it every step."""
    *lead, s_len, hkv, d = k.shape
    if stacked:  # free views of the stacks
        k2 = k.reshape(*lead, s_pad, hkv * d)
        v2 = v.reshape(*lead, s_pad, hkv * d)
    else:
        k2 = C.pad_axis(k, 1, s_pad).reshape(*lead, s_pad, hkv * d)  # free view
        v2 = C.pad_axis(v, 1, s_pad).reshape(*lead, s_pad, hkv * d)

    def kv_map(bi, hi, si, ii, kvlen_ref, minlim_ref, *layer_ref):
        j, _, _ = _split_tile(kvlen_ref[bi], si, ii, tk=tk, ns=ns)
        return (layer_ref[0][0], bi, j, hi) if stacked else (bi, j, hi)

    kv_block = (None, None, tk, w) if stacked else (None, tk, w)
    if not interpret:
        k2, v2 = (pltpu.with_memory_space_constraint(x, pltpu.HBM) for x in (k2, v2))
    return [pl.BlockSpec(kv_block, kv_map), pl.BlockSpec(kv_block, kv_map)], k2, v2


def _block_operands(blk_k, blk_v, blk_mask, k_dtype, v_dtype, align, *, g, rows, hb, w):
    """(BlockSpecs, operands) of `decode_attention`'s always-visible block keys and values,
    padded to the sublane multiple `align` ([B, Tb, Hkv*D], a program's heads on the lanes),
    and of its ancestor mask (per query row, one row block per head); none without blk_k."""
    if blk_k is None:
        if blk_mask is not None:
            raise ValueError("blk_mask needs blk_k / blk_v")
        return [], []
    b, blk_len, hkv, d = blk_k.shape
    tb = C.round_up(blk_len, align)
    bk2 = C.pad_axis(blk_k.astype(k_dtype), 1, tb).reshape(b, tb, hkv * d)
    bv2 = C.pad_axis(blk_v.astype(v_dtype), 1, tb).reshape(b, tb, hkv * d)
    spec = pl.BlockSpec((None, tb, w), lambda bi, hi, si, ii, *_: (bi, 0, hi))
    specs, args = [spec, spec], [bk2, bv2]
    if blk_mask is not None:
        bm = C.per_row(blk_mask.astype(jnp.int32), g, rows, 0)  # [B, rows, Tb]
        bm = jnp.tile(C.pad_axis(bm, 2, tb, 0), (1, hb, 1))  # row block i = head i
        specs.append(pl.BlockSpec((None, hb * rows, tb), lambda bi, hi, si, ii, *_: (bi, 0, 0)))
        args.append(bm)
    return specs, args


def decode_attention(
    q,
    k,
    v,
    lim,
    *,
    blk_k=None,
    blk_v=None,
    blk_mask=None,
    sm_scale=None,
    block_k: int = 512,
    num_splits: int | None = None,
    interpret=False,
    layer=None,
    return_lse=False,
):
    """Shared entry for verify/draft.

    q: [B,T,Hq,D]; k, v: [B,S,Hkv,D]; lim: [B,T] int32, row (b,t) sees slot j
    iff j <= lim[b,t].  Optional blk_k/blk_v [B,Tb,Hkv,D]: always-visible keys, or, with
    blk_mask [B,T,Tb] bool, visible to query t where blk_mask[b, t] is True (a draft tree's
    ancestor mask: laid out per row with the keys on the lane axis).
    With `layer` (an int scalar), k and v are stacks [L,B,S,Hkv,D] (a scanned layer stack) and
    the kernel's index maps read layer `layer` where it lies (a scalar prefetch), no copy.
    `return_lse`: (output [B,T,Hq,D], log-sum-exp [B,T,Hq] (NEG: no key seen)), float32, to
    merge with other keys' attention (a sequence-split context: `dflash_jax.models.attention`)."""
    stacked = layer is not None
    one = jax.ShapeDtypeStruct(k.shape[1:], k.dtype) if stacked else k  # one layer's shape
    b, t, hq, d, hkv, g = C.check_gqa(q, one)
    s_len = k.shape[2] if stacked else k.shape[1]
    scale = default_scale(d, sm_scale)
    align = C.sublane_multiple(k.dtype)
    rows = C.round_up(t * g, C.sublane_multiple(q.dtype))
    hb = _heads_per_block(hkv, d)
    if t > 1 and hb * rows * hb * d > _MAX_QUERY_BLOCK:
        # Too many query rows for one program's VMEM: the queries in chunks (each row's
        # attention depends on its own limit only), one call each, the same keys.
        tc = _query_chunk(t, g, hb, d, C.sublane_multiple(q.dtype))
        call = functools.partial(
            decode_attention, k=k, v=v, blk_k=blk_k, blk_v=blk_v, sm_scale=sm_scale,
            block_k=block_k, num_splits=num_splits, interpret=interpret, layer=layer,
            return_lse=return_lse,
        )  # fmt: skip
        return _in_query_chunks(call, q, lim, blk_mask, tc)
    if hb * rows * hb * d > _BIG_QUERY_BLOCK:
        # Many query rows of wide heads (a 512-token prefill chunk at head_dim 256): the f32
        # scores [rows, tk] and accumulator [rows, w] would outgrow the scoped VMEM at tk 512.
        block_k = min(block_k, 256)
    tk, s_pad = _choose_kv_tile(s_len, block_k, align)
    if stacked and s_pad != s_len:  # padding the stack would copy every layer: this one only
        return decode_attention(
            q, k[layer], v[layer], lim, blk_k=blk_k, blk_v=blk_v, blk_mask=blk_mask,
            sm_scale=sm_scale, block_k=block_k, num_splits=num_splits, interpret=interpret,
            return_lse=return_lse,
        )  # fmt: skip
    n_tiles = s_pad // tk

    lim = jnp.minimum(lim.astype(jnp.int32), s_len - 1)
    kv_len = jnp.maximum(jnp.max(lim, axis=1) + 1, 0).astype(jnp.int32)
    min_lim = jnp.min(lim, axis=1).astype(jnp.int32)
    lim_rows = C.per_row(lim, g, rows, -1)
    lim_rows = jnp.broadcast_to(lim_rows[:, :, None], (b, rows, C.LANES))

    hg, hr, w = hkv // hb, hb * rows, hb * d  # programs per b, rows, lanes
    lim_rows = jnp.tile(lim_rows, (1, hb, 1))  # row block i = head i

    ns = num_splits or C.cdiv(4, b * hg)
    ns = max(1, min(ns, n_tiles))
    steps = C.cdiv(n_tiles, ns)

    q4 = expand_heads(C.q_to_rows(q, hkv, rows), hb)  # [B, hg, hr, w]
    kv_specs, k2, v2 = _kv_operands(k, v, s_pad, tk, ns, w, stacked, interpret)
    in_specs = [
        pl.BlockSpec((None, None, hr, w), lambda bi, hi, si, ii, *_: (bi, hi, 0, 0)),
        pl.BlockSpec((None, hr, C.LANES), lambda bi, hi, si, ii, *_: (bi, 0, 0)),
        *kv_specs,
    ]
    args = [q4, lim_rows, k2, v2]
    blk_len = 0 if blk_k is None else blk_k.shape[1]
    blk_specs, blk_args = _block_operands(
        blk_k, blk_v, blk_mask, k.dtype, v.dtype, align, g=g, rows=rows, hb=hb, w=w
    )
    in_specs += blk_specs
    args += blk_args

    kernel = functools.partial(
        _decode_kernel, tk=tk, ns=ns, scale=scale, prec=C.dot_precision(q.dtype),
        blk_len=blk_len, blk_masked=blk_mask is not None,
    )  # fmt: skip
    scalars = (kv_len, min_lim)
    if stacked:  # the layer index: a third scalar prefetch, read by the index maps only
        scalars += (jnp.asarray(layer, jnp.int32).reshape(1),)
    cost = C.decode_cost(q, one, s_len, blk_len)
    o_part, lse_part = _pallas_decode(
        kernel, scalars, args, in_specs, (b, hg, ns, steps), hr, w, stacked, cost, interpret
    )
    o = collapse_heads(C.combine_splits(o_part, lse_part[..., 0]), hb)
    if not return_lse:
        return C.rows_to_q(o, t, g, q.dtype)
    return C.rows_to_q(o, t, g, jnp.float32), _row_lse(lse_part, hkv, rows, t, g)


def _row_lse(lse_part, hkv: int, rows: int, t: int, g: int):
    """The log-sum-exp per query [B, T, Hq] (float32; NEG where no split saw a key) of the
    kernel's per-split statistics [B, hg, ns, hr, LANES] (row block i of a head group: its
    head i)."""
    part = lse_part[..., 0]  # [B, hg, ns, hr]
    top = jnp.max(part, axis=2)
    lse = top + jnp.log(jnp.sum(jnp.exp(part - top[:, :, None]), axis=2))
    lse = jnp.where(top <= C.NEG / 2, C.NEG, lse)
    lse = lse.reshape(lse.shape[0], hkv, rows, 1)
    return C.rows_to_q(lse, t, g, jnp.float32)[..., 0]
