"""Tiling/layout shared by the TPU and Triton training-attention kernels.

Query rows are grouped per kv head: row = token*G + g (G = Hq // Hkv).  A
query tile holds `nb` whole DFlash blocks, i.e. bq = nb*block_size tokens =
TQ = bq*G rows, padded to TQP rows (TPU: sublane multiple; Triton: power of
two).  The tile's own block keys form a bq-token tile padded to BQP.  Every
row carries `a` = anchors[b, n] (its block's context limit, clipped to
[0, S]) or -1 for invalid blocks / padding rows, and `s` = ctx_start[b, n]
(the first visible context slot, clipped to [0, S]; 0 for invalid/padding
rows).  The mask is then

    context slot j : s[row] <= j < a[row]
    block key  c   : block(row) == block(c)  and  a[row] >= 0

Per query tile, `tile_bounds` gives the range of context tiles [lo, hi) that
any of its rows can see (tiles wholly below min(s) or at/above max(a) are
skipped) and the range [flo, fhi) of tiles every row sees entirely (these
take a mask-free path).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from . import _common as C


@dataclasses.dataclass(frozen=True)
class Layout:
    b: int
    n: int  # blocks per sequence (before padding)
    bs: int  # block_size
    hkv: int
    g: int
    d: int
    s_len: int  # context length S
    nb: int  # blocks per query tile
    nqt: int  # query tiles
    tqp: int  # padded rows per query tile
    bqp: int  # padded block-key rows per query tile
    tk: int  # context tile
    nkt: int  # context tiles
    s_pad: int  # padded context length (multiple of tk; TPU pads, Triton masks)

    @property
    def bq(self):
        return self.nb * self.bs

    @property
    def tq(self):
        return self.bq * self.g


def make_layout(
    q_shape, hkv, s_len, n, block_size, *, rows_target, block_k, pow2: bool, align: int
) -> Layout:
    b, _, hq, d = q_shape
    g = hq // hkv
    bs = block_size
    nb = max(1, min(n, rows_target // (bs * g)))
    if pow2:
        tqp = max(16, C.next_pow2(nb * bs * g))
        bqp = max(16, C.next_pow2(nb * bs))
        tk = max(16, min(C.next_pow2(block_k), C.next_pow2(max(s_len, 1))))
    else:
        tqp = C.round_up(nb * bs * g, align)
        bqp = C.round_up(nb * bs, align)
        tk = min(block_k, C.round_up(max(s_len, 1), align))
    nqt = C.cdiv(n, nb)
    nkt = max(1, C.cdiv(s_len, tk))
    return Layout(
        b=b,
        n=n,
        bs=bs,
        hkv=hkv,
        g=g,
        d=d,
        s_len=s_len,
        nb=nb,
        nqt=nqt,
        tqp=tqp,
        bqp=bqp,
        tk=tk,
        nkt=nkt,
        s_pad=nkt * tk,
    )


def q_to_tiles(x, lay: Layout):
    """[B, N*bs, Hq, D] -> [B, Hkv, nqt*TQP, D]."""
    b, d = x.shape[0], x.shape[-1]
    x = C.pad_axis(x, 1, lay.nqt * lay.bq)
    x = x.reshape(b, lay.nqt, lay.bq, lay.hkv, lay.g, d).transpose(0, 3, 1, 2, 4, 5)
    x = x.reshape(b, lay.hkv, lay.nqt, lay.tq, d)
    return C.pad_axis(x, 3, lay.tqp).reshape(b, lay.hkv, lay.nqt * lay.tqp, d)


def tiles_to_q(x, lay: Layout):
    b, d = x.shape[0], x.shape[-1]
    x = x.reshape(b, lay.hkv, lay.nqt, lay.tqp, d)[:, :, :, : lay.tq]
    x = x.reshape(b, lay.hkv, lay.nqt, lay.bq, lay.g, d).transpose(0, 2, 3, 1, 4, 5)
    x = x.reshape(b, lay.nqt * lay.bq, lay.hkv * lay.g, d)
    return x[:, : lay.n * lay.bs]


def blk_to_tiles(x, lay: Layout):
    """[B, N*bs, Hkv, D] -> [B, nqt*BQP, Hkv, D]."""
    b = x.shape[0]
    x = C.pad_axis(x, 1, lay.nqt * lay.bq)
    x = x.reshape(b, lay.nqt, lay.bq, lay.hkv, lay.d)
    x = C.pad_axis(x, 2, lay.bqp)
    return x.reshape(b, lay.nqt * lay.bqp, lay.hkv, lay.d)


def tiles_to_blk(x, lay: Layout):
    b = x.shape[0]
    x = x.reshape(b, lay.nqt, lay.bqp, lay.hkv, lay.d)[:, :, : lay.bq]
    return x.reshape(b, lay.nqt * lay.bq, lay.hkv, lay.d)[:, : lay.n * lay.bs]


def row_limits(anchors, ctx_start, block_valid, lay: Layout):
    """Per row context window [s, a): two [B, nqt*TQP] int32 arrays (a, s).

    a = clip(anchor, 0, S), -1 = the row sees nothing (not even block keys);
    s = clip(ctx_start, 0, S) (0 when ctx_start is None or the row is invalid).
    """

    def per_row(x, fill):
        x = C.pad_axis(x, 1, lay.nqt * lay.nb, fill)  # [B, nqt*nb]
        x = jnp.repeat(x, lay.bs * lay.g, axis=1)  # per row
        x = x.reshape(x.shape[0], lay.nqt, lay.tq)
        return C.pad_axis(x, 2, lay.tqp, fill).reshape(x.shape[0], lay.nqt * lay.tqp)

    valid = block_valid.astype(bool)
    a = jnp.clip(anchors.astype(jnp.int32), 0, lay.s_len)
    a = jnp.where(valid, a, -1)
    if ctx_start is None:
        s = jnp.zeros_like(a)
    else:
        s = jnp.clip(ctx_start.astype(jnp.int32), 0, lay.s_len)
        s = jnp.where(valid, s, 0)
    return per_row(a, -1), per_row(s, 0)


def row_block_ids(lay: Layout) -> np.ndarray:
    """[TQP]: block index (within the tile) of each row, -1 for padding rows."""
    r = np.arange(lay.tqp)
    return np.where(r < lay.tq, (r // lay.g) // lay.bs, -1).astype(np.int32)


def col_block_ids(lay: Layout) -> np.ndarray:
    """[BQP]: block index (within the tile) of each block key, -2 for padding."""
    c = np.arange(lay.bqp)
    return np.where(c < lay.bq, c // lay.bs, -2).astype(np.int32)


def tile_bounds(a_rows, s_rows, lay: Layout):
    """Context-tile ranges per (b, query tile), each [B, nqt] int32 (tile units).

    lo, hi: tiles [lo, hi) hold every context slot any real row of the tile
      sees (hi == lo when none): tiles below or above are skipped.
    flo, fhi: tiles [flo, fhi) are seen entirely by every real row (mask-free);
      fhi <= flo when there are none.  lo <= flo and fhi <= hi whenever fhi > flo.
    """
    shape = (a_rows.shape[0], lay.nqt, lay.tqp)
    a = a_rows.reshape(shape)[:, :, : lay.tq]
    s = s_rows.reshape(shape)[:, :, : lay.tq]
    sees = s < a
    big = jnp.int32(lay.nkt * lay.tk)
    lo_pos = jnp.min(jnp.where(sees, s, big), axis=2)
    hi_pos = jnp.max(jnp.where(sees, a, 0), axis=2)
    hi = (hi_pos + lay.tk - 1) // lay.tk
    lo = jnp.minimum(lo_pos // lay.tk, hi)
    flo = (jnp.max(s, axis=2) + lay.tk - 1) // lay.tk
    fhi = jnp.maximum(jnp.min(a, axis=2), 0) // lay.tk
    return lo, hi, flo, fhi


def kv_tile_lists(lo, hi, lay: Layout):
    """Query tiles that see each context tile, compacted.

    lo, hi: [B, nqt] context-tile ranges of the query tiles (`tile_bounds`).
    Returns qlist [B, nkt, nqt] (needed tiles first, the tail repeats the last
    needed one so a clamped index_map issues no new DMA) and qcount [B, nkt].
    """
    kt = jnp.arange(lay.nkt, dtype=jnp.int32)
    need = (lo[:, None, :] <= kt[None, :, None]) & (kt[None, :, None] < hi[:, None, :])
    qcount = jnp.sum(need, axis=2).astype(jnp.int32)
    order = jnp.argsort(jnp.logical_not(need), axis=2, stable=True).astype(jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(qcount - 1, 0)[..., None], axis=2)
    pos = jnp.arange(lay.nqt, dtype=jnp.int32)
    qlist = jnp.where(pos[None, None, :] < qcount[..., None], order, last)
    return qlist, qcount
