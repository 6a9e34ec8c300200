"""Scale-out on JAX's own machinery: a named mesh, partition rules and the specs they give.

Mesh axes (the first three always, size 1 when unused):
  data    - data parallelism: batches and caches split by sequence.
  fsdp    - fully sharded data parallelism for training: batches split like `data`, and large
            matrices additionally split along their non-tensor axis (gathered per layer by
            GSPMD).
  tensor  - tensor (Megatron) parallelism: attention heads, MLP width and the vocabulary.
  expert  - expert parallelism of a mixture-of-experts target (only in a mesh made with
            expert > 1, so dense meshes and their programs are unchanged): the stacked experts
            [E, ...] split over it, dispatched under `shard_map` (`dflash_jax/models/moe.py`: every
            device routes its tokens, computes its own experts' pairs and one psum over
            expert and tensor adds them). Everything else is replicated over `expert`.

Partition rules are `(regex, PartitionSpec, head_dims)` triples matched with `re.search` on the
'/'-joined parameter path (first match wins; no match = replicated). `head_dims` lists the
dimensions that hold `heads * head_dim` features: they are split only on whole heads. Any
dimension whose size (in heads, for head dims) is not divisible by the mesh axes named for it
falls back to replication, so e.g. 2 KV heads on tensor=4 are replicated while the 4 query
heads are split.

Parameter layouts (Flax Dense kernels are [in, out]):
  q/k/v_proj [H, N*D]: out over tensor      o_proj [N*D, H]: in over tensor
  gate/up    [H, I]:   out over tensor      down   [I, H]:   in over tensor
  embedding  [V, H]:   V over tensor        lm_head [H, V]:  V over tensor
  fc (drafter) [n*H, H]: out over tensor    norms: replicated
  MoE experts gate/up/down [E, I, H]: E over expert, I over tensor (H over fsdp with
  `fsdp=True`; a chip's I slice is never minor, `moe.SparseMoE`); the router gate [H, E]:
  replicated
(fc's input is the concatenation of the target's tapped hidden states: split over tensor, that
sharding would reach back into the target's replicated residual stream, costing all-to-alls,
all-gathers and per-norm all-reduces in every verify layer.)
With `fsdp=True` the other axis of each of those matrices is split over `fsdp`.

Caches ([B, S, K*D] per layer, the target's and the drafter's KVCache): B over the batch axes,
K over tensor; lengths [B] over the batch axes. Batches: leading axis over the batch axes.

Everything else is left to GSPMD: parameters and inputs are placed with `NamedSharding`, the
programs (`decoding.generate_programs`, `training.step.make_train_step`) are `jax.jit`s with
these in/out shardings, and the partitioner inserts the collectives (all-reduce after
o_proj/down, gathers for FSDP). This module holds only meshes, rules and specs: it imports
neither `decoding` nor `training`.

Meshes default to `jax.devices()`, i.e. the devices of every process when several run (a pod
slice); `dflash_jax.parallel.distributed` joins the processes and moves values in and out of such meshes.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflash_jax.models.transformer import KVCache

AXES = ("data", "fsdp", "tensor")
EXPERT = "expert"  # the fourth axis, present only in a mesh made with expert > 1
# Batch-like leading dimensions are split over both data-parallel axes (fsdp is data
# parallelism with sharded weights). With fsdp=1, as in inference meshes, this is just `data`.
BATCH = ("data", "fsdp")

Rule = Tuple[str, P, Tuple[int, ...]]


# ------------------------------------------------------------------------------------- mesh


def make_mesh(
    data: int = 1,
    fsdp: int = 1,
    tensor: int = -1,
    devices: Optional[Sequence[Any]] = None,
    expert: int = 1,
) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh, with a fourth axis "expert" when expert > 1 (or -1).
    One size may be -1: the devices left over.

    Devices default to `jax.devices()` (all hosts). On TPU/GPU the device order comes from
    `mesh_utils.create_device_mesh`, which keeps the tensor axis on the fastest links.
    """
    devices = list(jax.devices() if devices is None else devices)
    names = AXES + ((EXPERT,) if expert != 1 else ())
    sizes = [data, fsdp, tensor] + ([expert] if expert != 1 else [])
    given = " ".join(f"{a}={s}" for a, s in zip(names, sizes))
    if sum(s == -1 for s in sizes) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {given}")
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes) or len(devices) % known:
        raise ValueError(f"mesh {given} does not fit {len(devices)} devices")
    sizes = [len(devices) // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(names, sizes))} needs {math.prod(sizes)} devices, have {len(devices)}"
        )
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(sizes, devices)
    except Exception:  # CPU / unusual topologies: plain row-major order.
        grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def parse_mesh(spec: str) -> Dict[str, int]:
    """'data=2,tensor=4' -> {'data': 2, 'fsdp': 1, 'tensor': 4} (missing axes are 1; an
    empty spec means tensor=-1, all devices tensor-parallel). 'expert=4,data=2' adds
    'expert': 4 (the key only when given)."""
    out = {"data": 1, "fsdp": 1, "tensor": 1}
    if not spec.strip():
        return {"data": 1, "fsdp": 1, "tensor": -1}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if (name not in out and name != EXPERT) or not value.strip():
            raise ValueError(
                f"bad mesh spec {spec!r}: expected 'axis=size,...' with axes {AXES + (EXPERT,)}"
            )
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(
                f"bad mesh spec {spec!r}: the size of {name!r} must be an integer (or -1: the "
                f"devices left over), got {value.strip()!r}"
            ) from None
    return out


def check_expert_axis(expert: int, num_experts: int) -> None:
    """One-line ValueError unless an `expert` axis of size `expert` fits a target with
    `num_experts` experts (0: dense): the axis splits the stacked experts and nothing else, so
    over a dense target every device along it would repeat the others' work, and experts it
    does not divide would be replicated over it (both silently, at the cost of its devices).
    An axis of size 1 (no axis) fits every target."""
    if expert <= 1:
        return
    if num_experts <= 0:
        raise ValueError(
            f"the mesh axis expert={expert} splits a mixture-of-experts target's experts, but "
            "the target is dense (num_experts 0): give its devices to data, fsdp or tensor"
        )
    if num_experts % expert:
        raise ValueError(
            f"the mesh axis expert={expert} does not divide the target's {num_experts} experts "
            f"(use a divisor of {num_experts})"
        )


def mesh_str(mesh) -> str:
    axes = AXES + (EXPERT,)
    return ",".join(f"{a}={mesh.shape[a]}" for a in axes if mesh.shape.get(a, 1) > 1) or "single"


def compiling_for(mesh):
    """Context manager: programs traced inside it pick their attention kernels for the platform
    of `mesh`'s devices (e.g. an abstract TPU topology's on a CPU-only machine), not for the
    default backend (`pallas_kernels.backend.compiling_for`; a no-op without that folder)."""
    return _compiling_for(mesh)


@contextlib.contextmanager
def _compiling_for(mesh):
    # The mesh is also made the context mesh: the compiled Pallas kernels cannot be partitioned
    # by GSPMD, so `attention` runs them per shard (shard_map) over this mesh.
    try:
        from pallas_kernels import backend
    except ImportError:
        backend = None
    with jax.sharding.set_mesh(mesh):
        if backend is None:
            yield
        else:
            with backend.compiling_for(mesh):
                yield


# ---------------------------------------------------------------------------------- rules


def _rules(fsdp: bool) -> Tuple[Rule, ...]:
    f = "fsdp" if fsdp else None
    return (
        # Stacked MoE experts, all [E, I, H] (before the dense gate/up/down rules they match).
        (r"experts/(gate_proj|up_proj|down_proj)/kernel$", P(EXPERT, "tensor", f), ()),
        (r"(q_proj|k_proj|v_proj)/kernel$", P(f, "tensor"), (1,)),
        (r"(q_proj|k_proj|v_proj)/bias$", P("tensor"), (0,)),
        (r"o_proj/kernel$", P("tensor", f), (0,)),
        (r"(gate_proj|up_proj)/kernel$", P(f, "tensor"), ()),
        (r"down_proj/kernel$", P("tensor", f), ()),
        (r"embed_tokens/embedding$", P("tensor", f), ()),
        # DFlash 2's selector codebooks [V, rank]: over the vocabulary like the embedding.
        (r"(predecessor|successor)_codebook$", P("tensor", f), ()),
        # Its convolutions' dynamic-tap projections [H, 2 * taps * groups]: over their outputs.
        (r"kernel_projection/kernel$", P(f, "tensor"), ()),
        (r"lm_head/kernel$", P(f, "tensor"), ()),
        (r"(^|/)fc/kernel$", P(f, "tensor"), ()),
        # A hybrid target's Gated DeltaNet (`models/hybrid.py`): its input projections over
        # their outputs (q | k | v channels, value heads), out_proj over its input, the
        # per-channel convolution and per-head decay parameters with them.
        (r"linear_attn/in_proj_(qkv|z|a|b)/kernel$", P(f, "tensor"), ()),
        (r"linear_attn/out_proj/kernel$", P("tensor", f), ()),
        (r"linear_attn/conv1d$", P("tensor"), ()),
        (r"linear_attn/(A_log|dt_bias)$", P("tensor"), ()),
        (r"(norm|layernorm)/scale$", P(), ()),
        # An int8 kernel's per-output-channel scale [out] follows its kernel's output axis.
        (r"(q_proj|k_proj|v_proj)/kernel_scale$", P("tensor"), (0,)),
        (r"(o_proj|down_proj)/kernel_scale$", P(f), ()),
        (r"(gate_proj|up_proj|lm_head)/kernel_scale$", P("tensor"), ()),
    )


def target_rules(fsdp: bool = False) -> Tuple[Rule, ...]:
    """Rules for the target's and the drafter's parameters (the drafter's layers are named
    as the target's, plus fc [n*H, H]): tensor parallel; `fsdp` adds the other axis."""
    return _rules(fsdp)


def path_str(path) -> str:
    """'/'-joined key path of a pytree leaf (dict keys, attribute names, sequence indices)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _axis_size(mesh, axes) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh.shape[a] for a in axes)


def fit_spec(
    shape: Sequence[int],
    spec: P,
    mesh,
    head_dims: Iterable[int] = (),
    head_dim: Optional[int] = None,
) -> P:
    """`spec` padded/truncated to `len(shape)`, with every dimension that the mesh axes do not
    divide evenly (in whole heads for `head_dims`, when `head_dim` is known) replicated.

    A spec whose rank exceeds the array's (e.g. a rule matching an optimizer scalar) is dropped
    entirely: the array is replicated.
    """
    entries = tuple(spec)
    if len(entries) > len(shape):
        return P()
    entries = entries + (None,) * (len(shape) - len(entries))
    head_dims = set(head_dims)
    out = []
    for d, (size, axes) in enumerate(zip(shape, entries)):
        # Drop size-1 mesh axes: they shard nothing, and specs stay readable.
        axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)  # "expert": absent or 1
        n = _axis_size(mesh, axes)
        units = size
        if d in head_dims and head_dim:
            units = size // head_dim if size % head_dim == 0 else 0
        if not axes or not units or units % n:
            out.append(None)
        else:
            out.append(axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def param_specs(params, mesh, rules: Sequence[Rule], head_dim: Optional[int] = None):
    """PartitionSpecs for a pytree of arrays (or ShapeDtypeStructs), by the first matching
    rule; unmatched leaves are replicated. A rule that names more dimensions than the
    parameter it matches has (one layer's, for a stacked one) is a ValueError naming both: a
    layout the rules do not know, never a silent replication. (Scalars, such as an optimizer's
    step count, are replicated.)"""
    compiled = [(re.compile(pat), spec, hd) for pat, spec, hd in rules]

    def one(path, leaf):
        name = path_str(path)
        shape = np.shape(leaf)
        # A stacked layer group (`models/layer_stack.py`): the rules speak of one layer; the
        # leading layer axis is never split.
        stacked = re.search(r"(^|/)layers/", name) is not None
        for pat, spec, hd in compiled:
            if pat.search(name):
                inner = shape[1:] if stacked else shape
                if inner and len(tuple(spec)) > len(inner):
                    raise ValueError(
                        f"sharding rule {pat.pattern!r} -> {spec} has {len(tuple(spec))} "
                        f"dimensions; parameter {name} has shape {tuple(shape)}"
                        + (" (a stacked layer group: [layers, ...])" if stacked else "")
                    )
                if stacked:
                    inner = fit_spec(shape[1:], spec, mesh, hd, head_dim)
                    return P(None, *inner) if tuple(inner) else P()
                return fit_spec(shape, spec, mesh, hd, head_dim)
        return P()

    return jax.tree_util.tree_map_with_path(one, params)


def param_shardings(params, mesh, rules: Sequence[Rule], head_dim: Optional[int] = None):
    """NamedShardings for a pytree of parameters (or optimizer state mirroring them)."""
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s),
        param_specs(params, mesh, rules, head_dim),
        is_leaf=lambda x: isinstance(x, P),
    )


def shard_params(
    params,
    mesh,
    rules: Optional[Sequence[Rule]] = None,
    head_dim: Optional[int] = None,
    fsdp: bool = False,
):
    """`jax.device_put`s `params` onto the mesh (default rules: `target_rules(fsdp)`)."""
    rules = target_rules(fsdp) if rules is None else rules
    return jax.device_put(params, param_shardings(params, mesh, rules, head_dim))


def batch_spec(shape: Sequence[int], mesh, axis: int = 0) -> P:
    """Split dimension `axis` over the batch axes (replicated when not divisible)."""
    spec = [None] * len(shape)
    if len(shape) > axis:
        spec[axis] = BATCH
    return fit_spec(shape, P(*spec), mesh)


def batch_sharding(mesh, shape: Optional[Sequence[int]] = None, axis: int = 0):
    """NamedSharding of a batch: leading axis over ("data", "fsdp"). With `shape`, falls back
    to replication when the batch does not divide."""
    if shape is None:
        return NamedSharding(mesh, P(BATCH))
    return NamedSharding(mesh, batch_spec(shape, mesh, axis))


def cache_specs(cache, mesh):
    """Specs for a KVCache (the target's or the drafter's context cache; arrays or shapes):
    k/v [B,S,K*D] -> B over the batch axes, the K heads over tensor (each replicated when not
    divisible, in whole heads; a cache marked `seq_split` (a DFlash context cache, a chain
    loop's target cache) whose heads tensor does not divide: its S slots over tensor instead,
    `attention.splits_context`); lengths [B]
    over batch. A hybrid target's `HybridCache`: its
    full layers' KVCache as above, the convolution windows [B, K-1, C] over batch, the
    delta-rule states [B, Hv, dk, dv] over batch and their value heads over tensor."""
    if hasattr(cache, "kv"):  # a HybridCache (between steps: nothing pending)
        state = lambda shape: fit_spec(shape, P(BATCH, "tensor"), mesh)
        conv = lambda shape: batch_spec(shape, mesh)
        if cache.stacked:  # [L, ...]: the layer axis unsplit
            return cache.replace(
                kv=cache_specs(cache.kv, mesh),
                conv=P(None, *conv(np.shape(cache.conv)[1:])),
                state=P(None, *state(np.shape(cache.state)[1:])),
            )
        return cache.replace(
            kv=cache_specs(cache.kv, mesh),
            conv=tuple(conv(np.shape(x)) for x in cache.conv),
            state=tuple(state(np.shape(x)) for x in cache.state),
        )
    kv = lambda x: fit_spec(
        np.shape(x), P(BATCH, None, "tensor"), mesh, head_dims=(2,), head_dim=cache.head_dim
    )
    if getattr(cache, "seq_split", False) and not cache.stacked:
        from dflash_jax.models.attention import kv_layer_bytes, splits_context

        x = cache.k[0]
        layer = kv_layer_bytes(mesh.shape, np.shape(x), x.dtype)
        if splits_context(mesh.shape, cache.num_kv_heads, cache.capacity, layer):
            # A cache whose heads `tensor` does not divide: its slots instead.
            kv = lambda x: fit_spec(np.shape(x), P(BATCH, "tensor"), mesh)
    if getattr(cache, "stacked", False):  # [L, B, S, K*D]: the layer axis unsplit
        one = lambda x: P(None, *kv(jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype)))
        return cache.replace(
            k=one(cache.k), v=one(cache.v), lengths=batch_spec(np.shape(cache.lengths), mesh)
        )
    return cache.replace(
        k=tuple(kv(x) for x in cache.k),
        v=tuple(kv(x) for x in cache.v),
        lengths=batch_spec(np.shape(cache.lengths), mesh),
    )


def cache_sharding(cache, mesh):
    """NamedShardings for a KVCache / ContextCache pytree (see `cache_specs`)."""
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s),
        cache_specs(cache, mesh),
        is_leaf=lambda x: isinstance(x, P),
    )


def decode_state_sharding(state, mesh):
    """NamedShardings for `decoding.DecodeState`: caches as above, per-sequence buffers over
    the batch axes, scalars and the PRNG key replicated."""
    ns = lambda s: NamedSharding(mesh, s)
    cache = cache_sharding(state.cache, mesh)
    # The drafter's context, whatever its kind: a KVCache in it (DFlash's context, EAGLE-3's
    # own cache) as a cache, its other arrays (prompt lookup's token ids, EAGLE-3's pending
    # feature) per sequence over the batch axes; None (autoregressive) stays None.
    is_cache = lambda x: isinstance(x, KVCache)
    ctx = jax.tree_util.tree_map(
        lambda x: cache_sharding(x, mesh) if is_cache(x) else ns(batch_spec(x.shape, mesh)),
        state.ctx,
        is_leaf=is_cache,
    )
    return state.replace(
        cache=cache,
        ctx=ctx,
        tokens=ns(batch_spec(state.tokens.shape, mesh)),
        num_out=ns(batch_spec(state.num_out.shape, mesh)),
        done=ns(batch_spec(state.done.shape, mesh)),
        step=ns(P()),
        accepted=ns(batch_spec(state.accepted.shape, mesh)),
        drafts=ns(batch_spec(state.drafts.shape, mesh, axis=1)),
        key=ns(P()),
        max_new=ns(P()),
    )


def with_shardings(tree, shardings):
    """ShapeDtypeStructs of `tree` (arrays or shapes) carrying `shardings`: abstract inputs for
    `.lower()` without allocating anything."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings
    )
