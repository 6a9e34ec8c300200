"""Pallas TPU kernel writing a block of new rows into a KV cache that stays in HBM.

`kv_update(cache [B,S,K,D], new [B,T,K,D], starts [B])` returns the cache with
cache[b, starts[b] + t] = new[b, t] for every t whose slot lies in [0, S); rows whose
slot is out of range are dropped, as `cache.at[b, pos].set(new, mode="drop")` does.
`kv_update(stack [L,B,S,K,D], new, starts, layer)` writes layer `layer` of a stacked cache
(a scanned layer stack) the same way, the stack aliased in HBM as a single cache is.

XLA compiles that scatter (or a dynamic-update-slice) on TPU by prefetching the whole
cache into VMEM, updating the T rows there and copying the cache back: a cache-sized
round trip per write. Here the cache is an HBM operand (memory space ANY) aliased to the
output, and the kernel only moves the T new rows of each batch row: one HBM -> HBM DMA
when the start is a multiple of the rows per tile (8 for 32-bit, 16 for bf16) and T too
(prefill chunks), else a read-modify-write of the tile-aligned window of W = T + align - 1
rows (rounded up to the tile) around them, through VMEM (Mosaic slices tiled dims only at
tile offsets). The cache is viewed as [B, S, K*D] (a free reshape), the view the decode
attention kernel (tpu_decode.py) reads, so both see the same layout. Starts >= S (or a
block wholly below 0) write nothing. A capacity S that is not a multiple of the tile
rows falls back to XLA's scatter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(
    starts_ref,
    layer_ref,
    cache_in_ref,
    new_ref,
    cache_ref,
    new_buf,
    win_buf,
    sems,
    *,
    s_len,
    t_len,
    align,
):
    """Grid (B,): batch row b. Its T rows go straight HBM -> HBM when the start is aligned to
    the cache's row tiles; otherwise the tile-aligned window [a0, a0 + W) around them is read
    into VMEM, the rows merged in (a dynamic sublane rotate + select) and the window written
    back: Mosaic slices tiled dims only at tile offsets."""
    del cache_in_ref  # aliased with cache_ref: the rows not written keep their values
    b = pl.program_id(0)
    s = starts_ref[b]
    rows = cache_ref.at[layer_ref[0]]  # [B, S, K*D]: the layer written (0 of an unstacked cache)
    w = win_buf.shape[0]
    direct = t_len % align == 0  # static: whole tiles of new rows (else padded: the window)
    aligned = (s >= 0) & (s % align == 0) & (s + t_len <= s_len) if direct else False

    if direct:

        @pl.when(aligned)
        def _():
            dst = rows.at[b, pl.ds(pl.multiple_of(s, align), t_len)]
            cp = pltpu.make_async_copy(new_ref.at[b], dst, sems.at[0])
            cp.start()
            cp.wait()

    @pl.when(jnp.logical_not(aligned) & (s < s_len) & (s + t_len > 0))
    def _():
        a0 = jnp.clip(s - s % align, 0, s_len - w)
        a0 = pl.multiple_of(a0, align)
        window = rows.at[b, pl.ds(a0, w)]
        t_pad = new_ref.shape[1]  # T rounded up to the tile (the pad rows are never kept)
        read_new = pltpu.make_async_copy(new_ref.at[b], new_buf.at[pl.ds(0, t_pad)], sems.at[0])
        read_old = pltpu.make_async_copy(window, win_buf, sems.at[1])
        read_new.start()
        read_old.start()
        read_new.wait()
        read_old.wait()
        off = s - a0  # slot a0 + i of the window takes new row i - off
        i = jax.lax.broadcasted_iota(jnp.int32, win_buf.shape, 0)
        src = i - off
        keep = (src >= 0) & (src < t_len)
        shifted = pltpu.roll(new_buf[...].astype(jnp.float32), jnp.mod(off, w), 0)
        merged = jnp.where(keep, shifted, win_buf[...].astype(jnp.float32))
        win_buf[...] = merged.astype(win_buf.dtype)
        back = pltpu.make_async_copy(win_buf, window, sems.at[1])
        back.start()
        back.wait()


@functools.partial(jax.jit, static_argnames=("interpret",))
def kv_update(cache, new, starts, layer=None, *, interpret=False):
    """cache [B,S,K,D], new [B,T,K,D] (cast to cache.dtype), starts [B] int: the cache with
    rows starts[b] .. starts[b]+T-1 of batch row b replaced by new[b] (out-of-range slots
    dropped). With `layer` (an int scalar, traced or not) the cache is a stack [L,B,S,K,D]
    (a scanned layer stack, `dflash_jax/models/layer_stack.py`) and only that layer's rows are
    written, where the stack lies. interpret=True runs it in TPU interpret mode
    (`pltpu.InterpretParams()`)."""
    stacked = layer is not None
    if not stacked:
        cache = cache[None]  # [1, B, S, K, D]: a free reshape
        layer = 0
    n_layers, b, s, k, d = cache.shape
    t = new.shape[1]
    if new.shape != (b, t, k, d):
        raise ValueError(f"new rows {new.shape} do not fit a cache {cache.shape[1:]}")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    unstack = (lambda c: c) if stacked else (lambda c: c[0])
    if t == 0 or s == 0:
        return unstack(cache)
    itemsize = jnp.dtype(cache.dtype).itemsize
    align = 8 * max(1, 4 // itemsize)  # rows per tile of the [B, S, K*D] view
    w = min(s, -(-(t + align - 1) // align) * align)  # aligned window holding any T rows
    if s % align:  # the window could not be tile-aligned: XLA's scatter
        pos = starts.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        pos = jnp.where(pos >= 0, pos, s)  # below 0: dropped too (never wrapped)
        rows = jnp.arange(b)[:, None]
        out = cache.at[layer[0], rows, pos].set(new.astype(cache.dtype), mode="drop")
        return unstack(out)
    new = new.astype(cache.dtype).reshape(b, t, k * d)
    t_pad = -(-t // align) * align  # DMA sizes along tiled dims are whole tiles too
    if t_pad != t:
        new = jnp.pad(new, ((0, 0), (0, t_pad - t), (0, 0)))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_kernel, s_len=s, t_len=t, align=align),
        # An HBM output (aliased to the cache operand: HBM too) keeps XLA's memory-space
        # assignment from prefetching the cache into VMEM around the kernel.
        out_shape=pltpu.MemorySpace.HBM(shape=(n_layers, b, s, k * d), dtype=cache.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b,),
            in_specs=[any_spec, any_spec],
            out_specs=any_spec,
            scratch_shapes=[
                pltpu.VMEM((w, k * d), cache.dtype),
                pltpu.VMEM((w, k * d), cache.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        input_output_aliases={2: 0},  # operand 2 (after the scalar prefetch) is the cache
        interpret=pltpu.InterpretParams() if interpret else False,
    )(
        starts.astype(jnp.int32),
        layer,
        cache.reshape(n_layers, b, s, k * d),
        new,
    )
    return unstack(out.reshape(n_layers, b, s, k, d))
