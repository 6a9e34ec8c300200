"""Attention entry points of the models, switchable between plain XLA and Pallas kernels.

`attention_impl`:
  "xla"    - the einsum references below (default on CPU),
  "pallas" - the kernels of `pallas_kernels/` for the current backend (TPU or Triton GPU),
  "pallas_interpret" - the same kernels in interpret mode (for tests on CPU),
  "auto"   - "pallas" on TPU/GPU, "xla" elsewhere.
  "pallas_tpu" / "pallas_triton" / "pallas_cudnn" - one kernel family, whatever the default
           backend is: what `for_devices` turns "pallas"/"auto" into for the devices a program
           is compiled for, so the choice is part of the static configuration (and of the jit
           caches' keys).

The platform is that of the devices being compiled for (`pallas_kernels.backend.compiling_for`),
not the default backend: TPU kernels compile for abstract TPU devices on a CPU-only machine.

Two shapes of attention occur at decode time:
  verify: queries of a block, already written into the target cache, see slots j <= position.
  draft:  drafter block queries see the drafter context slots j < ctx_len and the whole block.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from dflash_jax.models.layers import masked_attention
from dflash_jax.support.checks import ATTENTION_IMPLS

# The implementations a user may name (ATTENTION_IMPLS) and those they resolve to per platform.
IMPLS = ATTENTION_IMPLS + ("pallas_tpu", "pallas_triton", "pallas_cudnn")


def _compile_platform() -> str:
    try:
        return _kernels().backend._platform()
    except ImportError:
        return jax.default_backend()


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"attention_impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if _compile_platform() in ("tpu", "gpu", "cuda", "rocm") else "xla"
    return impl


def for_devices(impl: str, devices=None) -> str:
    """`impl` made concrete for the devices a program is compiled for (a Mesh, a device list,
    a platform name; None: the default backend): "auto" / "pallas" become "xla",
    "pallas_tpu" or "pallas_triton" by `pallas_kernels.backend.resolve` on that platform."""
    if impl not in IMPLS:
        raise ValueError(f"attention_impl must be one of {IMPLS}, got {impl!r}")
    if impl not in ("auto", "pallas"):
        return impl
    backend = _kernels().backend
    platform = backend.platform_of(devices) if devices is not None else backend._platform()
    variant = backend.resolve(impl, platform=platform, device_kind=backend.device_kind_of(devices))
    return "xla" if variant == backend.XLA else "pallas_" + variant


def _kernels():
    import pallas_kernels  # imported lazily: the library works without the kernels folder

    return pallas_kernels


def _kernel_impl(impl: str) -> str:
    """The `pallas_kernels` impl for one of ours ("pallas_interpret" runs "pallas";
    "pallas_cudnn", what `for_devices` makes of "pallas" under DFLASH_PALLAS_GPU_BACKEND=cudnn
    or on jax >= 0.11 on Hopper, runs the kernels' "cudnn")."""
    if impl == "pallas_cudnn":
        return "cudnn"
    return "pallas" if impl in ("pallas", "pallas_interpret") else impl


def _batch_axes(shape, batch: int):
    """The spec entry that splits a batch of `batch` rows over the mesh's data-parallel axes
    (`shape`: {axis: size}; "data" and "fsdp", those over 1), as the caches are; None where there
    are none or they do not divide the batch."""
    data = tuple(a for a in ("data", "fsdp") if shape.get(a, 1) > 1)
    return data if data and batch % math.prod(shape[a] for a in data) == 0 else None


def _per_shard(fn, args, batch_dims, head_dims):
    """fn(*args) run per shard of the context mesh (`jax.sharding.set_mesh`) when it has more
    than one device: compiled Pallas kernels are opaque to GSPMD, which cannot partition them.
    Each arg is split on its batch dim (the data-parallel axes, as the caches are) and on its
    head dim over `tensor` when both the query and the KV heads divide (GQA groups stay whole);
    batch_dims / head_dims give each arg's dims (None: not split). Output: like args[0]."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(*args)
    from jax.sharding import PartitionSpec as P

    shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
    tensor = shape.get("tensor", 1)
    heads = [a.shape[d] for a, d in zip(args, head_dims) if d is not None]
    bax = _batch_axes(shape, args[0].shape[batch_dims[0]])
    hax = "tensor" if tensor > 1 and all(h % tensor == 0 for h in heads) else None

    def spec(x, bd, hd):
        entries = [None] * x.ndim
        if bd is not None:
            entries[bd] = bax
        if hd is not None:
            entries[hd] = hax
        return P(*entries)

    specs = tuple(spec(x, bd, hd) for x, bd, hd in zip(args, batch_dims, head_dims))
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(*args)


# A split by sequence costs two small all-reduces a layer a pass (the log-sum-exp merge: 16 us
# on an 8-chip ring at the HBM model's 1 us a hop, `dry_run.hbm.ICI_HOP_LATENCY_S`) and saves
# reading (1 - 1/tensor) of the layer's K/V: worth it from about 13 MB saved on v5e
# (819 GB/s) and 22 MB on v5p-8 (4 chips, 2.76 TB/s). So a cache splits only where one
# layer's K and V on a chip, unsplit, hold at least this: Qwen3.5-9B's full layers at 32K
# (136 MB) split; Qwen3-30B-A3B's at 4K (8.9 MB) do not (split, 96 more collectives took its
# projected v5e-8 AR step from 2.72 to 3.01 ms).
SEQ_SPLIT_MIN_BYTES = 32 << 20


def kv_layer_bytes(mesh_shape, shape, dtype) -> int:
    """One layer's K and V on a chip, not split by sequence: twice a cache array's bytes
    (`shape` [B, S, ...]) with its batch over the mesh's data axes where they divide it."""
    mesh_shape = dict(mesh_shape)
    b, axes = shape[0], _batch_axes(mesh_shape, shape[0])
    if axes is not None:
        b //= math.prod(mesh_shape[a] for a in axes)
    return 2 * b * math.prod(shape[1:]) * jnp.dtype(dtype).itemsize


def splits_context(mesh_shape, kv_heads: int, capacity: int, layer_bytes: int) -> bool:
    """Whether a cache ([B, C, K*D] with `KVCache.seq_split`: a DFlash drafter's context cache,
    or a target's cache in a chain decode loop) is split by sequence over the mesh's `tensor`
    axis (`mesh_shape`: {axis: size}): when its K heads do not divide `tensor` (a head split
    would leave the whole cache on every chip: Qwen3.5-9B's full-attention layers and its
    drafter, 4 heads of 256 over tensor=8), its C slots do, and a layer's K and V on a chip
    (`layer_bytes`, `kv_layer_bytes`) reach SEQ_SPLIT_MIN_BYTES. Each chip then holds
    C / tensor consecutive slots and attends over them; the shares merge by log-sum-exp
    (`draft_attention`, `verify_attention`)."""
    t = dict(mesh_shape).get("tensor", 1)
    return t > 1 and kv_heads % t != 0 and capacity % t == 0 and layer_bytes >= SEQ_SPLIT_MIN_BYTES


def _context_split_mesh(x, kv_heads: int):
    """(abstract mesh, batch axes spec entry, slots per chip) when the context mesh splits a
    cache array `x` [B, C, ...] of `kv_heads` heads by sequence (`splits_context`), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
    b, capacity = x.shape[:2]
    if not splits_context(shape, kv_heads, capacity, kv_layer_bytes(shape, x.shape, x.dtype)):
        return None
    return mesh, _batch_axes(shape, b), capacity // shape["tensor"]


def _merge_shares(o, lse, dtype):
    """The attention over all chips' keys from each chip's share (out [B,T,Hq,D], log-sum-exp
    [B,T,Hq], float32) inside a shard_map over `tensor`: two all-reduces, the largest
    log-sum-exp and the weighted outputs with their weights ([B, T, Hq, D + 1])."""
    w = jnp.exp(lse - jax.lax.pmax(lse, "tensor"))  # [B, T, Hq]
    total = jax.lax.psum(jnp.concatenate([w[..., None] * o, w[..., None]], axis=-1), "tensor")
    return (total[..., :-1] / total[..., -1:]).astype(dtype)


def _split_verify_attention(split, q, k, v, positions_BT, impl: str):
    """`verify_attention` over a target cache split by sequence over `tensor`
    (`splits_context`): each chip attends its queries (all heads) over its C / tensor slots,
    the positions shifted by its first slot (`pallas_kernels.verify_attention_lse`: the TPU
    kernel, or the XLA reference), merged by log-sum-exp (`_merge_shares`)."""
    from jax.sharding import PartitionSpec as P

    mesh, bax, local = split
    kimpl, interpret = _kernel_impl(impl), impl == "pallas_interpret"

    def share(q, k, v, pos):
        shifted = pos.astype(jnp.int32) - jax.lax.axis_index("tensor") * local
        o, lse = _kernels().verify_attention_lse(q, k, v, shifted, impl=kimpl, interpret=interpret)
        return _merge_shares(o, lse, q.dtype)

    seq = P(bax, "tensor")
    specs = (P(bax), seq, seq, P(bax))
    return jax.shard_map(share, mesh=mesh, in_specs=specs, out_specs=P(bax), check_vma=False)(
        q, k, v, positions_BT
    )


def _split_draft_attention(split, q, ctx_k, ctx_v, ctx_len_B, blk_k, blk_v, impl: str):
    """`draft_attention` over a context split by sequence over `tensor` (`splits_context`):
    each chip attends its queries (all heads) over its C / tensor slots, the block's keys on
    chip 0 only (`pallas_kernels.draft_attention_lse`: the TPU kernel, or the XLA reference),
    and the shares merge by log-sum-exp (`_merge_shares`)."""
    from jax.sharding import PartitionSpec as P

    mesh, bax, local = split
    kimpl, interpret = _kernel_impl(impl), impl == "pallas_interpret"

    def share(q, ck, cv, n, bk, bv):
        i = jax.lax.axis_index("tensor")
        n_here = jnp.clip(n.astype(jnp.int32) - i * local, 0, local)
        o, lse = _kernels().draft_attention_lse(
            q, ck, cv, n_here, bk, bv, jnp.broadcast_to(i == 0, n.shape), impl=kimpl,
            interpret=interpret,
        )  # fmt: skip
        return _merge_shares(o, lse, q.dtype)

    seq = P(bax, "tensor")
    specs = (P(bax), seq, seq, P(bax), P(bax), P(bax))
    return jax.shard_map(share, mesh=mesh, in_specs=specs, out_specs=P(bax), check_vma=False)(
        q, ctx_k, ctx_v, ctx_len_B, blk_k, blk_v
    )


# Cache writes under a TPU Pallas impl go through the Pallas DMA kernel
# (`pallas_kernels.kv_update`: the cache stays in HBM, only the new rows' tile-aligned window is
# read and written) unless DFLASH_KV_UPDATE=xla (read once per process). Compiled for Qwen3-8B
# at 32K context, the projected DFlash step falls from 19.95 to 13.18 ms on v5e-8 (AR 9.74 ->
# 9.48) and from 7.78 to 4.81 ms on v5p-8 (AR 4.86 -> 4.27): docs/tpu_dry_run.md.
KV_UPDATE = os.environ.get("DFLASH_KV_UPDATE", "pallas")


def uses_kv_kernel(impl: str) -> bool:
    """Whether `write_block` writes through the Pallas TPU kernel (`pallas_kernels.kv_update`)
    under `impl`: unless KV_UPDATE is "xla" (DFLASH_KV_UPDATE=xla), a TPU Pallas impl on the
    platform compiled for, or "pallas_interpret"."""
    if KV_UPDATE != "pallas":
        return False
    impl = resolve_impl(impl)
    if impl in ("pallas_interpret", "pallas_tpu"):
        return True
    return impl == "pallas" and _compile_platform() == "tpu"


def _heads(x, head_dim: int):
    """A cache array as [B, S, K, D]: the caches' [B, S, K*D] storage viewed per head (a
    reshape XLA folds into the kernels' own [B, S, K*D] view), a 4-D array as it is."""
    return x if x.ndim == 4 else x.reshape(*x.shape[:2], -1, head_dim)


def write_block(
    cache_BSF, new_BTF, starts_B, impl: str = "xla", head_dim: int = 0, layer=None,
    seq_split: bool = False,
):  # fmt: skip
    """cache [B,S,K*D] (or [B,S,K,D]) with rows starts[b] .. starts[b]+T-1 of row b set to new
    rows of the same trailing shape (slots outside [0, S) dropped, as `model.write_kv` does).
    With `layer` (an int, traced or not) the cache is a stack [L,B,S,K*D] of a scanned layer
    stack and that layer is written, in place.
    Under a TPU Pallas impl the Pallas kernel DMAs the T rows into the cache where it lies in
    HBM (XLA's scatter or dynamic-update-slice round-trips the whole cache through VMEM on
    TPU), per shard of the context mesh (batch over data/fsdp, whole KV heads over tensor:
    `head_dim` says where a [B,S,K*D] head ends); else the XLA scatter. `seq_split`: the
    cache's `KVCache.seq_split` (a drafter's context cache, or a target's), split by sequence
    over `tensor` where `splits_context` says so: each chip writes the rows that fall in its
    slots."""
    if seq_split and layer is None:
        heads = cache_BSF.shape[2] if cache_BSF.ndim == 4 else cache_BSF.shape[2] // head_dim
        split = _context_split_mesh(cache_BSF, heads)
        if split is not None:
            return _split_write_block(split, cache_BSF, new_BTF, starts_B, impl, head_dim)
    lead = () if layer is None else (layer,)
    if not uses_kv_kernel(impl):
        t = new_BTF.shape[1]
        positions = starts_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        b = jnp.arange(new_BTF.shape[0])[:, None]
        new = new_BTF.astype(cache_BSF.dtype)
        return cache_BSF.at[(*lead, b, positions)].set(new, mode="drop")
    if cache_BSF.ndim == 3 + len(lead) and not head_dim:
        raise ValueError("write_block of a [B, S, K*D] cache through the kernel needs head_dim")
    interpret = resolve_impl(impl) == "pallas_interpret"
    if lead:
        kernel = lambda c, n, s, i: _kernels().kv_update(c, n, s, i, interpret=interpret)
        cache = (
            cache_BSF
            if cache_BSF.ndim == 5
            else cache_BSF.reshape(*cache_BSF.shape[:3], -1, head_dim)
        )
        new = _heads(new_BTF.astype(cache_BSF.dtype), cache.shape[-1])
        args = (cache, new, starts_B.astype(jnp.int32), jnp.asarray(layer, jnp.int32))
        dims = ((1, 0, 0, None), (3, 2, None, None))
    else:
        kernel = lambda c, n, s: _kernels().kv_update(c, n, s, interpret=interpret)
        cache = _heads(cache_BSF, head_dim)
        new = _heads(new_BTF.astype(cache_BSF.dtype), cache.shape[-1])
        args = (cache, new, starts_B.astype(jnp.int32))
        dims = ((0, 0, 0), (2, 2, None))
    out = kernel(*args) if interpret else _per_shard(kernel, args, *dims)
    return out.reshape(cache_BSF.shape)


def _split_write_block(split, cache_BSF, new_BTF, starts_B, impl, head_dim):
    """`write_block` into a cache split by sequence over `tensor`: each chip writes
    the rows whose slots fall in its C / tensor (its starts shifted by its first slot; the
    others dropped, as out-of-range slots are), in place, by the kernel or the scatter."""
    from jax.sharding import PartitionSpec as P

    mesh, bax, local = split

    def share(cache, new, starts):
        shifted = starts.astype(jnp.int32) - jax.lax.axis_index("tensor") * local
        if not uses_kv_kernel(impl):
            pos = shifted[:, None] + jnp.arange(new.shape[1], dtype=jnp.int32)[None]
            pos = jnp.where(pos >= 0, pos, local)  # below the share: dropped, never wrapped
            b = jnp.arange(new.shape[0])[:, None]
            return cache.at[b, pos].set(new.astype(cache.dtype), mode="drop")
        # The kernel here, on the chip's share (no nested per-shard split).
        interpret = resolve_impl(impl) == "pallas_interpret"
        heads = _heads(cache, head_dim)
        out = _kernels().kv_update(
            heads, _heads(new.astype(cache.dtype), heads.shape[-1]), shifted, interpret=interpret
        )
        return out.reshape(cache.shape)

    seq = P(bax, "tensor")
    return jax.shard_map(
        share, mesh=mesh, in_specs=(seq, P(bax), P(bax)), out_specs=seq, check_vma=False
    )(cache_BSF, new_BTF, starts_B)


def decode_attention_xla(q_B1ND, k_BSKD, v_BSKD, mask_B1S):
    """One query per row against the cache, as multiply-and-reduce loops that read K and V
    once where they lie. The same function as `masked_attention` (float32 softmax); XLA:CPU
    lowers that einsum form to batched dots whose [B, K] batch dimensions are not leading in
    the cache, copying the whole cache to a transposed layout in every layer of every step
    (2.6x slower at batch 64 and 1024 slots: the autoregressive loop on CPU)."""
    b, _, n, d = q_B1ND.shape
    kh = k_BSKD.shape[2]
    g = n // kh
    q = q_B1ND.reshape(b, 1, kh, g, d).astype(jnp.float32) * (d**-0.5)  # [B, 1, K, G, D]
    k = k_BSKD.astype(jnp.float32)[:, :, :, None, :]  # [B, S, K, 1, D]
    logits = jnp.sum(q * k, axis=-1)  # [B, S, K, G]
    mask = mask_B1S[:, 0, :, None, None]
    logits = jnp.where(mask, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=1)
    probs = jnp.where(mask, probs, 0.0)
    out = jnp.sum(probs[..., None] * v_BSKD.astype(jnp.float32)[:, :, :, None, :], axis=1)
    return out.reshape(b, 1, n, d).astype(q_B1ND.dtype)


def _reads_stack(impl: str) -> bool:
    """Whether the attention under `impl` (resolved) reads a layer of a stacked cache where it
    lies: the TPU kernels (compiled for a TPU, or interpreted); others take the layer's slice."""
    if impl in ("pallas_interpret", "pallas_tpu"):
        return True
    return impl == "pallas" and _compile_platform() == "tpu"


def _layer_of(k_LBSF, v_LBSF, layer, head_dim: int):
    """A stacked cache [L,B,S,K*D] (or [L,B,S,K,D]) viewed per head [L,B,S,K,D]."""
    view = lambda x: x if x.ndim == 5 else x.reshape(*x.shape[:3], -1, head_dim)  # noqa: E731
    return view(k_LBSF), view(v_LBSF)


def verify_attention(
    q_BTND, k_BSF, v_BSF, positions_BT, impl: str = "xla", layer=None, seq_split: bool = False
):
    """Block queries against a cache that already holds them; query at p sees slots j <= p.
    The cache: [B,S,K*D] (the caches' storage) or [B,S,K,D]; D is the queries'. With `layer`
    (an int, traced or not) the caches are stacks [L,B,S,K*D] and that layer is read: where it
    lies by the TPU kernel (its index maps take the layer), sliced out elsewhere. `seq_split`:
    the cache's `KVCache.seq_split`; where `splits_context` says so, each chip attends over its
    slots and the shares merge by log-sum-exp (`_split_verify_attention`)."""
    impl = resolve_impl(impl)
    d = q_BTND.shape[-1]
    if seq_split and layer is None:
        k4, v4 = _heads(k_BSF, d), _heads(v_BSF, d)
        split = _context_split_mesh(k4, k4.shape[2])
        if split is not None:
            return _split_verify_attention(split, q_BTND, k4, v4, positions_BT, impl)
    if layer is not None and not _reads_stack(impl):
        k_BSF, v_BSF, layer = k_BSF[layer], v_BSF[layer], None
    if layer is not None:
        k, v = _layer_of(k_BSF, v_BSF, layer, d)
        kernel = lambda q, k, v, pos, i: _kernels().verify_attention(
            q, k, v, pos, impl=_kernel_impl(impl), interpret=impl == "pallas_interpret", layer=i
        )
        args = (q_BTND, k, v, positions_BT, jnp.asarray(layer, jnp.int32))
        if impl == "pallas_interpret":
            return kernel(*args)
        return _per_shard(kernel, args, (0, 1, 1, 0, None), (2, 3, 3, None, None))
    k_BSKD, v_BSKD = _heads(k_BSF, d), _heads(v_BSF, d)
    if impl == "xla":
        s = k_BSKD.shape[1]
        mask = jnp.arange(s)[None, None, :] <= positions_BT[:, :, None]
        if q_BTND.shape[1] == 1:  # an autoregressive step
            return decode_attention_xla(q_BTND, k_BSKD, v_BSKD, mask)
        return masked_attention(q_BTND, k_BSKD, v_BSKD, mask)
    kernel = lambda q, k, v, pos: _kernels().verify_attention(
        q, k, v, pos, impl=_kernel_impl(impl), interpret=impl == "pallas_interpret"
    )
    if impl == "pallas_interpret":
        return kernel(q_BTND, k_BSKD, v_BSKD, positions_BT)
    return _per_shard(kernel, (q_BTND, k_BSKD, v_BSKD, positions_BT), (0, 0, 0, 0), (2, 2, 2, None))


def tree_verify_mask(tree_mask_BTT, starts_B, capacity: int):
    """[B, T, S] visibility of cache slots to the T tree nodes written at slots starts[b] + t:
    every committed slot (j < start) and, inside the tree, the node's ancestors and itself."""
    t = tree_mask_BTT.shape[1]
    rel = jnp.arange(capacity, dtype=jnp.int32)[None, None, :] - starts_B[:, None, None]
    inside = (rel >= 0) & (rel < t)
    idx = jnp.broadcast_to(jnp.clip(rel, 0, t - 1), (tree_mask_BTT.shape[0], t, capacity))
    return (rel < 0) | (inside & jnp.take_along_axis(tree_mask_BTT, idx, axis=2))


def tree_verify_attention(
    q_BTND, k_BSF, v_BSF, starts_B, blk_k, blk_v, tree_mask_BTT, impl: str = "xla", layer=None
):
    """A draft tree's verify: the T nodes' queries against the committed cache slots
    (j < starts[b]) and the nodes' own K/V blk_k / blk_v [B,T,K,D] under the ancestor mask
    [B,T,T] (the cache already holds the nodes at slots starts[b] + t: the XLA path reads them
    there with one [B, T, S] mask; the kernels take them as a masked block,
    `pallas_kernels.tree_attention`: the TPU kernel, XLA on GPU so far)."""
    impl = resolve_impl(impl)
    d = q_BTND.shape[-1]
    if layer is not None and not _reads_stack(impl):
        k_BSF, v_BSF, layer = k_BSF[layer], v_BSF[layer], None
    if layer is not None:  # a stack read where it lies (`verify_attention`)
        k, v = _layer_of(k_BSF, v_BSF, layer, d)
        kernel = lambda q, k, v, n, bk, bv, m, i: _kernels().tree_attention(
            q, k, v, n, bk, bv, m, impl=_kernel_impl(impl),
            interpret=impl == "pallas_interpret", layer=i,
        )  # fmt: skip
        args = (q_BTND, k, v, starts_B, blk_k, blk_v, tree_mask_BTT, jnp.asarray(layer, jnp.int32))
        if impl == "pallas_interpret":
            return kernel(*args)
        dims = ((0, 1, 1, 0, 0, 0, 0, None), (2, 3, 3, None, 2, 2, None, None))
        return _per_shard(kernel, args, *dims)
    k_BSKD, v_BSKD = _heads(k_BSF, d), _heads(v_BSF, d)
    if impl == "xla":
        mask = tree_verify_mask(tree_mask_BTT, starts_B, k_BSKD.shape[1])
        return masked_attention(q_BTND, k_BSKD, v_BSKD, mask)
    kernel = lambda q, k, v, n, bk, bv, m: _kernels().tree_attention(
        q, k, v, n, bk, bv, m, impl=_kernel_impl(impl), interpret=impl == "pallas_interpret"
    )
    args = (q_BTND, k_BSKD, v_BSKD, starts_B, blk_k, blk_v, tree_mask_BTT)
    if impl == "pallas_interpret":
        return kernel(*args)
    return _per_shard(kernel, args, (0,) * 7, (2, 2, 2, None, 2, 2, None))


def ring_positions(lengths_B, slots: int):
    """[B, slots]: the absolute position held by each slot of a ring cache in which position
    j lives in slot j % slots and positions < lengths were written in order (the latest
    `slots` of them remain); negative where the slot holds nothing yet. With lengths <= slots
    slot s holds position s: a ring that never wrapped is a plain cache."""
    last = lengths_B[:, None].astype(jnp.int32) - 1
    s = jnp.arange(slots, dtype=jnp.int32)[None]
    return last - jnp.mod(last - s, slots)


def window_draft_attention(
    q_BTND, ctx_k, ctx_v, ctx_len_B, blk_k, blk_v, window=None, causal: bool = False
):
    """A sliding-window (or block-causal) drafter layer's decode attention (XLA): the block's
    query t sits at position p = ctx_len + t and sees context position j when p - j < window,
    block position r when |t - r| < window (and r <= t when causal). The context cache is a
    ring (`ring_positions`: a plain cache whose capacity covers the context is one), so it may
    hold only the last `window` positions."""
    b, t = q_BTND.shape[:2]
    pos = ring_positions(ctx_len_B, ctx_k.shape[1])  # [B, C]
    qpos = ctx_len_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
    ctx_mask = jnp.broadcast_to(pos[:, None, :] >= 0, (b, t, pos.shape[1]))
    r = jnp.arange(t)
    blk_mask = jnp.ones((t, t), bool)
    if window is not None:
        ctx_mask &= qpos[:, :, None] - pos[:, None, :] < window
        blk_mask &= jnp.abs(r[:, None] - r[None, :]) < window
    if causal:
        blk_mask &= r[None, :] <= r[:, None]
    mask = jnp.concatenate([ctx_mask, jnp.broadcast_to(blk_mask, (b, t, t))], axis=-1)
    k = jnp.concatenate([ctx_k, blk_k.astype(ctx_k.dtype)], axis=1)
    v = jnp.concatenate([ctx_v, blk_v.astype(ctx_v.dtype)], axis=1)
    return masked_attention(q_BTND, k, v, mask)


def draft_attention(
    q_BTND, ctx_k, ctx_v, ctx_len_B, blk_k, blk_v, impl: str = "xla", window=None, causal=False,
    seq_split: bool = False,
):  # fmt: skip
    """Drafter block queries against [context (j < ctx_len) ; block (all)], non-causal.
    ctx_k / ctx_v: [B,C,K*D] (the context cache's storage) or [B,C,K,D]; blk_k / blk_v
    [B,T,K,D]. window: a sliding layer's window (`window_draft_attention`, XLA under every
    impl: the kernels take the full context). `seq_split`: the context is a DFlash context
    cache, split by sequence over `tensor` where `splits_context` says so (each chip attends
    over its slots, merged by log-sum-exp: `_split_draft_attention`)."""
    impl = resolve_impl(impl)
    d = q_BTND.shape[-1]
    ctx_k, ctx_v = _heads(ctx_k, d), _heads(ctx_v, d)
    if window is not None or causal:
        return window_draft_attention(q_BTND, ctx_k, ctx_v, ctx_len_B, blk_k, blk_v, window, causal)
    split = None
    if seq_split:
        split = _context_split_mesh(ctx_k, ctx_k.shape[2])
    if split is not None:
        return _split_draft_attention(split, q_BTND, ctx_k, ctx_v, ctx_len_B, blk_k, blk_v, impl)
    if impl == "xla":
        b, t = q_BTND.shape[:2]
        c = ctx_k.shape[1]
        ctx_mask = jnp.arange(c)[None, None, :] < ctx_len_B[:, None, None]
        mask = jnp.concatenate(
            [jnp.broadcast_to(ctx_mask, (b, t, c)), jnp.ones((b, t, t), bool)], axis=-1
        )
        k = jnp.concatenate([ctx_k, blk_k.astype(ctx_k.dtype)], axis=1)
        v = jnp.concatenate([ctx_v, blk_v.astype(ctx_v.dtype)], axis=1)
        return masked_attention(q_BTND, k, v, mask)
    kernel = lambda q, ck, cv, n, bk, bv: _kernels().draft_attention(
        q, ck, cv, n, bk, bv, impl=_kernel_impl(impl), interpret=impl == "pallas_interpret"
    )
    args = (q_BTND, ctx_k, ctx_v, ctx_len_B, blk_k, blk_v)
    if impl == "pallas_interpret":
        return kernel(*args)
    return _per_shard(kernel, args, (0, 0, 0, 0, 0, 0), (2, 2, 2, None, 2, 2))


def training_attention(
    q,
    k_ctx,
    v_ctx,
    k_blk,
    v_blk,
    anchors_BN,
    valid_BN,
    block_size: int,
    ctx_start_BN=None,
    impl: str = "pallas",
):
    """The fused Pallas drafter-training attention (`pallas_kernels.training_attention`;
    differentiable in q, k_ctx, v_ctx, k_blk, v_blk), run per shard of the context mesh like
    the decode kernels: the compiled kernel (forward and backward) is opaque to GSPMD, so on a
    sharded mesh each device runs it on its rows (batch over data/fsdp) and heads (tensor).
    q: [B,N*bs,Hq,D]; k_ctx, v_ctx: [B,S,Hkv,D]; k_blk, v_blk: [B,N*bs,Hkv,D]; anchors_BN,
    valid_BN, ctx_start_BN (optional): [B,N]. impl: "pallas" or "pallas_interpret" (direct)."""
    interpret = impl == "pallas_interpret"

    def kernel(q_, kc, vc, kb, vb, a, v, *start):
        return _kernels().training_attention(
            q_,
            kc,
            vc,
            kb,
            vb,
            a,
            v,
            block_size=block_size,
            ctx_start=start[0] if start else None,
            impl="pallas",
            interpret=interpret,
        )

    args = (q, k_ctx, v_ctx, k_blk, v_blk, anchors_BN, valid_BN) + (
        () if ctx_start_BN is None else (ctx_start_BN,)
    )
    if interpret:
        return kernel(*args)
    return _per_shard(kernel, args, (0,) * len(args), (2, 2, 2, 2, 2) + (None,) * (len(args) - 5))


def causal_kernel(impl: str) -> str:
    """The kernel `causal_attention` runs for `impl` on the platform compiled for:
    "splash" (TPU), "triton" (GPU, where jax ships the Pallas Triton backend), "splash_interpret"
    (impl "pallas_interpret", any platform) or "xla" (chunked; impl "xla", CPU, and GPUs whose
    jax has no Pallas Triton backend)."""
    impl = resolve_impl(impl)
    if impl == "xla":
        return "xla"
    if impl == "pallas_interpret":
        return "splash_interpret"
    platform = _compile_platform()
    if impl == "pallas_tpu" or (impl == "pallas" and platform == "tpu"):
        return "splash"
    gpu = platform in ("gpu", "cuda", "rocm")
    if impl == "pallas_triton" or (impl == "pallas" and gpu):
        return "triton" if gpu and _kernels().backend.triton_available() else "xla"
    return "xla"


def chunked_causal_attention(
    q_BTND, k_BTKD, v_BTKD, positions_BT, segment_ids_BT=None, chunk: int = 512
):
    """Causal (and segment-masked) GQA attention over T tokens, `chunk` queries at a time.

    Equal to `masked_attention` with the mask `pos[k] <= pos[q]` (and same segment), but the
    float32 scores are [B, K, G, chunk, T] per step of a `lax.map` (memory linear in T), never
    the dense [B, N, T, T]. Used by the frozen target pass of drafter training (no gradient).
    """
    b, t, n, d = q_BTND.shape
    chunk = max(1, min(int(chunk), t))
    m = -(-t // chunk)
    pad = m * chunk - t
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids_BT is None else segment_ids_BT

    def chunked(x):  # [B, T, ...] -> [m, B, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((b, m, chunk) + x.shape[2:]), 1, 0)

    def one(args):
        q, pos, sg = args
        mask = (positions_BT[:, None, :] <= pos[:, :, None]) & (seg[:, None, :] == sg[:, :, None])
        return masked_attention(q, k_BTKD, v_BTKD, mask)

    out = jax.lax.map(one, (chunked(q_BTND), chunked(positions_BT), chunked(seg)))
    return jnp.moveaxis(out, 0, 1).reshape(b, m * chunk, n, d)[:, :t]


def causal_attention(
    q_BTND, k_BTKD, v_BTKD, positions_BT, segment_ids_BT=None, impl: str = "xla", chunk: int = 512
):
    """Causal, segment-masked GQA self-attention of T tokens (the frozen target pass of drafter
    training), never with a dense [B, N, T, T] score tensor. Kernel by `causal_kernel(impl)`:

      "xla"    `chunked_causal_attention`: `chunk` queries at a time (float32 scores
               [B, K, G, chunk, T] per step), mask `pos[k] <= pos[q]` and same segment.
      "splash" TPU splash attention (`pallas_kernels.causal_attention`), per shard of the
               context mesh (batch over data/fsdp, heads over tensor) since GSPMD cannot
               partition a Mosaic kernel; T padded to a multiple of 128 inside.
      "triton" GPU Pallas Triton flash attention (jax's `pallas.ops.gpu.attention.mha`), per
               shard likewise; K/V repeated to the query heads, T padded to a multiple of 128.
               cuDNN (`jax.nn.dot_product_attention`) is not used: it has no segment ids, only
               a dense mask.
      "splash_interpret" the splash kernel in Pallas interpret mode, unsharded (tests on CPU).

    The kernels are causal by token index within the row, which equals the position rule
    whenever each segment is one contiguous run whose positions increase with the index: the
    rows of `dflash_jax.data.packing` (right padding as segment 0, positions restarting per
    document or 0..T-1) are. They read no positions.
    q [B,T,N,D]; k, v [B,T,K,D]; positions, segment_ids [B,T] (segment_ids None: one segment).
    """
    kernel = causal_kernel(impl)
    if kernel == "xla":
        return chunked_causal_attention(q_BTND, k_BTKD, v_BTKD, positions_BT, segment_ids_BT, chunk)
    from pallas_kernels import causal_attention as causal

    seg = (
        jnp.zeros(q_BTND.shape[:2], jnp.int32)
        if segment_ids_BT is None
        else segment_ids_BT.astype(jnp.int32)
    )
    if kernel == "splash_interpret":
        return causal.splash_causal_attention(q_BTND, k_BTKD, v_BTKD, seg, interpret=True)
    fn = causal.splash_causal_attention if kernel == "splash" else causal.triton_causal_attention
    return _per_shard(fn, (q_BTND, k_BTKD, v_BTKD, seg), (0, 0, 0, 0), (2, 2, 2, None))
