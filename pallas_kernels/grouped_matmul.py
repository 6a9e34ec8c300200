"""Grouped matmul for few rows that reads only the weights of the groups (experts) with rows.

`jax.lax.ragged_dot(rows [M, K], weights [E, K, N], group_sizes [E])` multiplies the rows of
group e (rows sum(sizes[:e]) .. sum(sizes[:e+1]) - 1) by weights[e]; rows past the groups'
sum give 0. A mixture-of-experts decode step has few rows (batch x block tokens x top-k), so
most experts have none, yet ragged_dot reads every expert's weights. Both functions here equal
ragged_dot (output in rows.dtype, weights cast to it) and read at most min(E, M) experts:

`routed_gmm` (Pallas TPU, `pltpu.PrefetchScalarGridSpec`). Scalar prefetch: the offsets of the
groups [E + 1] (clipped to M), the active experts [A] (the experts with >= 1 row, in order,
compacted; the tail repeats the last active one: expert 0 when none is) and their count. Grid
(N // tile_n, A) with A = min(E, M): N tiles outer ("parallel"), active-expert slots inner
("arbitrary", the output tile stays in VMEM across them). The weight BlockSpec (None, K,
tile_n) maps step (j, s) to block (active[s], 0, j): the tail slots map to the block of the
step before them, so the pipeline issues no DMA for them; a step fetches a new weight block
only at a new (expert, N tile): n_active x (N // tile_n) blocks in all (one expert's when
none is active), at most A x (N // tile_n). The rows [M padded to the sublane tile, K] are
one block with a constant index (fetched once); the output tile [Mp, tile_n] is zeroed at
slot 0 and each active slot writes its expert's rows: it walks them in sublane-aligned
chunks of `tm` rows (8 for 32-bit, 16 for bf16) from the aligned chunk holding its first row,
one [tm, K] x [K, tile_n] MXU product each, masked to the rows of the group; inactive tail
slots compute nothing. Work: at most (Mp + A * tm) x K x tile_n multiply-adds per N tile.
Its `pl.CostEstimate` declares the bytes of the grid it runs: `cost(...)`.

`gather_gmm` (pure JAX, every backend): the same active-expert list, the weights of those A
experts gathered (`weights[active]` [A, K, N]) and one ragged_dot over them with the compacted
group sizes (the tail's groups empty). What other backends use for few rows where it pays:
XLA materializes the gathered [A, K, N] weights (read, written, read again by the gemm), so
`moe.gmm_method` takes it only when 3 x M < E.

Both also take the weights transposed, [E, N, K] (`transposed=True`: each expert's matrix in
the checkpoints' [out, in] orientation, contracted on its minor dimension), so that a chip's
slice of an expert's width keeps the hidden size minor: libtpu's default layout for an array
whose minor dimension is not a multiple of 128 lanes (a gate/up slice [E, K, 64] or [E, K,
192]) stores it transposed, which the row-major read above then copies back, every expert, at
every call (`docs/performance.md`). Transposed, the weight block is [tile_n, K] at (expert, j,
0) and each chunk is one [tm, K] x [tile_n, K]^T product; `ragged_dot_t` is ragged_dot's form.

`dflash_jax/models/moe.py` decides per program shape which one runs (`gmm_method`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _common as C

# Scoped-VMEM budget for the default tile choice: the default scoped limit is 16 MiB on
# v4 / v5e / v5p (32 MiB on v6e); above it the call asks for more (vmem_limit_bytes).
VMEM_BUDGET = 12 * 2**20


def active_experts(group_sizes, slots: int):
    """(ids [slots] int32, count [] int32): the groups with >= 1 row in increasing order, then
    the last of them repeated (group 0 when none has a row). A group's rows precede those of
    every later group, so the slots' groups are in row order."""
    sizes = group_sizes.astype(jnp.int32)
    e = sizes.shape[0]
    active = sizes > 0
    count = jnp.sum(active, dtype=jnp.int32)
    (idx,) = jnp.nonzero(active, size=slots, fill_value=0)
    idx = idx.astype(jnp.int32)
    if slots == 0 or e == 0:
        return idx, count
    last = idx[jnp.maximum(count - 1, 0)]
    slot = jnp.arange(slots, dtype=jnp.int32)
    return jnp.where(slot < count, idx, last), count


def num_slots(num_groups: int, num_rows: int) -> int:
    """Active-expert slots of the grid: at most one group per row can have rows."""
    return max(1, min(num_groups, num_rows))


def choose_tile_n(m: int, k: int, n: int, rows_dtype, w_dtype, tile_n=None) -> int:
    """The N tile: `tile_n` if given (a divisor of N, a multiple of 128 or N itself); else the
    largest multiple of 128 dividing N that is at most max(128, N // 2) (two or more N tiles:
    both TensorCores of a megacore chip get work) and keeps the double-buffered blocks within
    VMEM_BUDGET; N itself when N is not a multiple of 128."""
    if tile_n is not None:
        if n % tile_n or (tile_n % 128 and tile_n != n):
            raise ValueError(f"tile_n={tile_n} must divide N={n} and be a multiple of 128 or N")
        return tile_n
    if n % 128:
        return n
    mp = C.round_up(m, C.sublane_multiple(rows_dtype))
    cands = [t for t in range(max(128, n // 2 // 128 * 128), 0, -128) if n % t == 0]
    for t in cands:
        if vmem_bytes(mp, k, t, rows_dtype, w_dtype) <= VMEM_BUDGET:
            return t
    return cands[-1]


def vmem_bytes(mp: int, k: int, tn: int, rows_dtype, w_dtype) -> int:
    """VMEM of the kernel's blocks: rows, weight tile and output tile double-buffered, the
    weight tile cast to the rows' dtype, one chunk's float32 product."""
    ri, wi = jnp.dtype(rows_dtype).itemsize, jnp.dtype(w_dtype).itemsize
    return 2 * (mp * k * ri + k * tn * wi + mp * tn * ri) + k * tn * ri + 16 * tn * 4


def cost(m: int, k: int, n: int, e: int, rows_dtype, w_dtype) -> pl.CostEstimate:
    """The cost of `routed_gmm`'s grid: bytes = the weight blocks its index maps can fetch, one
    [K, N] expert per active-expert slot (min(E, M) slots: n_active <= that many experts are
    read, each N tile once), plus the rows block (read once) and the output (written once);
    flops = 2 x K x N x the rows the chunks multiply (at most Mp + slots x tm, and at most
    slots x Mp)."""
    tm = C.sublane_multiple(rows_dtype)
    mp = C.round_up(m, tm)
    a = num_slots(e, m)
    ri, wi = jnp.dtype(rows_dtype).itemsize, jnp.dtype(w_dtype).itemsize
    chunk_rows = min(mp + a * tm, a * mp)
    return pl.CostEstimate(
        flops=2 * chunk_rows * k * n,
        transcendentals=0,
        bytes_accessed=a * k * n * wi + mp * k * ri + mp * n * ri,
    )


# The index maps (grid step (j, s) and the scalar-prefetch refs -> block indices): the rows one
# block fetched once, expert ids[s]'s N tile j of the weights, the output's N tile j.
def rows_block(j, s, offsets_ref, ids_ref, count_ref):
    return 0, 0


def weight_block(j, s, offsets_ref, ids_ref, count_ref):
    return ids_ref[s], 0, j


def weight_block_t(j, s, offsets_ref, ids_ref, count_ref):  # weights [E, N, K]
    return ids_ref[s], j, 0


def out_block(j, s, offsets_ref, ids_ref, count_ref):
    return 0, j


# With a layer index (a fourth scalar prefetch): the weights are a scanned layer stack
# [L, E, K, N], read in place at layer_ref[0] (a slice of the stack passed to a custom call is
# a copy of the layer's experts every step).
def stacked_rows_block(j, s, offsets_ref, ids_ref, count_ref, layer_ref):
    return 0, 0


def stacked_weight_block(j, s, offsets_ref, ids_ref, count_ref, layer_ref):
    return layer_ref[0], ids_ref[s], 0, j


def stacked_weight_block_t(j, s, offsets_ref, ids_ref, count_ref, layer_ref):
    return layer_ref[0], ids_ref[s], j, 0


def stacked_out_block(j, s, offsets_ref, ids_ref, count_ref, layer_ref):
    return 0, j


def _stacked_kernel(offsets_ref, ids_ref, count_ref, layer_ref, *refs, tm, prec, transposed):
    _kernel(offsets_ref, ids_ref, count_ref, *refs, tm=tm, prec=prec, transposed=transposed)


def _kernel(offsets_ref, ids_ref, count_ref, rows_ref, w_ref, out_ref, *, tm, prec, transposed):
    s = pl.program_id(1)

    @pl.when(s == 0)
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    @pl.when(s < count_ref[0])
    def _():
        e = ids_ref[s]
        start, end = offsets_ref[e], offsets_ref[e + 1]
        # The aligned chunk holding the first row (tm is a power of two). No floor division:
        # its sign fix-up asks the default device for the TPU generation (not on a CPU host).
        a0 = jnp.bitwise_and(start, -tm)
        w = w_ref[...]
        if w.dtype != rows_ref.dtype:
            w = w.astype(rows_ref.dtype)

        # [tm, K] x [K, tile_n], or x [tile_n, K] contracted on K (minor) when transposed.
        dims = (((1,), (1 if transposed else 0,)), ((), ()))

        def chunk(c, carry):
            r0 = pl.multiple_of(a0 + c * tm, tm)
            y = jax.lax.dot_general(
                rows_ref[pl.ds(r0, tm), :],
                w,
                dims,
                preferred_element_type=jnp.float32,
                precision=prec,
            )
            r = r0 + jax.lax.broadcasted_iota(jnp.int32, y.shape, 0)
            keep = (r >= start) & (r < end)
            old = out_ref[pl.ds(r0, tm), :].astype(jnp.float32)
            out_ref[pl.ds(r0, tm), :] = jnp.where(keep, y, old).astype(out_ref.dtype)
            return carry

        jax.lax.fori_loop(0, jax.lax.div(end - a0 + tm - 1, tm), chunk, 0)


@functools.partial(jax.jit, static_argnames=("interpret", "tile_n", "transposed"))
def routed_gmm(
    rows, weights, group_sizes, *, interpret=False, tile_n=None, layer=None, transposed=False
):
    """ragged_dot(rows [M, K], weights [E, K, N], group_sizes [E]) -> [M, N] in rows.dtype,
    reading only the weights of the groups with rows (module docstring). `transposed`: the
    weights are [E, N, K] (`ragged_dot_t`). With `layer` (an int, traced or not) `weights` is
    a scanned layer stack [L, E, K, N] ([L, E, N, K] transposed) and layer `layer`'s experts
    are read where they lie (`dflash_jax/models/layer_stack.py`). On CPU: interpret=True
    runs the TPU kernel in the TPU interpret mode (`pltpu.InterpretParams()`: TPU memory
    semantics, one device), interpret="plain" in Pallas' generic interpreter, which also runs
    inside a multi-device `shard_map` (where the TPU interpret mode's simulation of the devices
    waited forever: an 8-device expert-parallel decode, jax 0.10.2)."""
    m, k = rows.shape
    e, kw, n = weights.shape[-3:]
    if transposed:
        e, n, kw = weights.shape[-3:]
    if weights.ndim != (3 if layer is None else 4) or kw != k or group_sizes.shape != (e,):
        raise ValueError(
            f"routed_gmm: rows {rows.shape}, weights {weights.shape}, group_sizes "
            f"{group_sizes.shape} do not fit"
        )
    if m == 0 or n == 0 or e == 0 or k == 0:
        return jnp.zeros((m, n), rows.dtype)
    tm = C.sublane_multiple(rows.dtype)
    mp = C.round_up(m, tm)
    tn = choose_tile_n(m, k, n, rows.dtype, weights.dtype, tile_n)
    a = num_slots(e, m)
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.cumsum(sizes)
    offsets = jnp.minimum(jnp.concatenate([jnp.zeros((1,), jnp.int32), ends]), m)
    # A group clipped to nothing (it starts at or past row M) has no row here.
    ids, count = active_experts(offsets[1:] - offsets[:-1], a)
    need = vmem_bytes(mp, k, tn, rows.dtype, weights.dtype)
    params = dict(dimension_semantics=("parallel", "arbitrary"))
    if need > VMEM_BUDGET:
        params["vmem_limit_bytes"] = need + 4 * 2**20
    tile = (tn, k) if transposed else (k, tn)
    wmap = weight_block_t if transposed else weight_block
    kernel, maps, scalars = _kernel, (rows_block, wmap, out_block), ()
    w_block, name = (None, *tile), "dflash_routed_gmm"
    if layer is not None:
        kernel = _stacked_kernel
        wmap = stacked_weight_block_t if transposed else stacked_weight_block
        maps = (stacked_rows_block, wmap, stacked_out_block)
        scalars = (jnp.asarray(layer, jnp.int32).reshape(1),)
        w_block, name = (None, None, *tile), "dflash_routed_gmm_stacked"
    prec = C.dot_precision(rows.dtype)
    out = pl.pallas_call(
        functools.partial(kernel, tm=tm, prec=prec, transposed=transposed),
        out_shape=jax.ShapeDtypeStruct((mp, n), rows.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3 + len(scalars),
            grid=(n // tn, a),
            in_specs=[pl.BlockSpec((mp, k), maps[0]), pl.BlockSpec(w_block, maps[1])],
            out_specs=pl.BlockSpec((mp, tn), maps[2]),
        ),
        compiler_params=pltpu.CompilerParams(**params),
        cost_estimate=cost(m, k, n, e, rows.dtype, weights.dtype),
        interpret=_interpret_mode(interpret),
        name=name,
    )(
        offsets,
        ids,
        count.reshape(1),
        *scalars,
        C.pad_axis(rows, 0, mp),
        _in_hbm(weights, interpret),
    )
    return out[:m]


def _interpret_mode(interpret):
    if interpret not in (False, True, "plain"):
        raise ValueError(f"routed_gmm: interpret must be False, True or 'plain', got {interpret!r}")
    return True if interpret == "plain" else (pltpu.InterpretParams() if interpret else False)


def _in_hbm(weights, interpret):
    """The expert weights pinned to HBM for the kernel's own block DMAs. Unpinned, XLA on v5e
    staged a copy of every expert's weights for the call (compiled Qwen3-30B-A3B v5e-8 tensor=8
    AR step: 2.60 GB read, 1.91x its floor; pinned 1.42 GB, 1.04x). Interpret mode has no
    memory spaces."""
    return weights if interpret else pltpu.with_memory_space_constraint(weights, pltpu.HBM)


def ragged_dot_t(rows, weights, group_sizes):
    """ragged_dot with the weights transposed: rows [M, K] times weights [E, N, K] contracted on
    K (their minor dimension), group e's rows by expert e -> [M, N] (`jax.lax.ragged_dot_general`:
    no transposed copy of the weights)."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    return jax.lax.ragged_dot_general(rows, weights, group_sizes, dims)


@functools.partial(jax.jit, static_argnames=("transposed",))
def gather_gmm(rows, weights, group_sizes, transposed=False):
    """ragged_dot(rows [M, K], weights [E, K, N], group_sizes [E]) -> [M, N] in rows.dtype, over
    the weights of at most min(E, M) experts: those with rows, gathered (`weights[active]`),
    then one ragged_dot with the compacted group sizes. The backend-independent form of
    `routed_gmm`. `transposed`: the weights are [E, N, K] (`ragged_dot_t`)."""
    m, k = rows.shape
    e, _, n = weights.shape
    if transposed:
        e, n, _ = weights.shape
    if m == 0 or n == 0 or e == 0:
        return jnp.zeros((m, n), rows.dtype)
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ids, count = active_experts(sizes, num_slots(e, m))
    compact = jnp.where(jnp.arange(ids.shape[0]) < count, sizes[ids], 0)
    w = jnp.take(weights, ids, axis=0).astype(rows.dtype)
    return (ragged_dot_t if transposed else jax.lax.ragged_dot)(rows, w, compact)
