"""Mixture-of-experts feed-forward blocks (Qwen3-MoE): the router, dropless expert dispatch and
its expert-parallel form.

Routing (transformers' `Qwen3MoeTopKRouter`): logits `x @ W_gate` (no bias) in the compute
dtype, softmax in float32, the top-k experts, their weights divided by the top-k sum when
`norm_topk_prob`, cast back. Output: `sum_k w_k * down_k(silu(gate_k(x)) * up_k(x))`.

Dropless: every (token, expert) pair is computed. A capacity factor would drop pairs of an
expert that more tokens chose than its capacity, so a token's output would depend on the other
tokens of the batch (and of the draft block), and speculative decoding would no longer be
lossless. The N*k pairs are sorted by expert and each expert matmul is one
`jax.lax.ragged_dot` over the sorted rows (a group per expert).

Under a context mesh of several devices (`jax.sharding.set_mesh`, as `generate`
sets for a mesh) the block runs per shard (`shard_map`): tokens over the data axes, the stacked
expert weights [E, ...] over `expert` (expert parallelism) and their SwiGLU width over
`tensor`. Every device routes its data shard's tokens (the router is replicated), computes the
pairs routed to its own experts (the others are sorted past its last group: rows `ragged_dot`
leaves zero) over its slice of the width, and one `psum` over (`expert`, `tensor`) adds the
partial outputs: the block's only collective, an all-reduce of the [tokens, H] output, as
tensor parallelism's after `down_proj`. Tokens never move (no all-to-all): simple and
dropless, at the price of every device sorting all of its data shard's pairs. The trainer's
step and held-out loss are traced under their mesh too (`training.step.make_train_step`,
`training.trainer`), so training runs this path; a program traced without a context mesh gets
plain `expert_ffn`, which the GSPMD partitioner places.

Few rows (`gmm_method`): a decode step has batch x block tokens x top-k rows per device, so most
experts have none, yet `ragged_dot` reads every expert's weights. Up to ROUTED_MAX_ROWS rows
(per device: under the expert-parallel `shard_map`, all the data shard's pairs, those of other
devices' experts sorted past the last group) the expert matmuls read only the experts with
rows (`pallas_kernels/grouped_matmul.py`, both equal to `ragged_dot`): under a TPU Pallas
`impl` the routed kernel (`routed_gmm`: its DMAs fetch the weights of the experts with rows
only, at most min(E, rows) of them, so it never reads more than `ragged_dot`; interpret mode
under "pallas_interpret"); elsewhere, when 3 x rows < E, the gather dispatch (`gather_gmm`:
the weights of the min(E, rows) experts that can have rows gathered, one `ragged_dot` over
them). XLA materializes that gather (compiled for an H200: a [rows, K, N] copy, then the
gemm), so it moves about 3 x rows expert matrices (read, written, read again) against the E
that `ragged_dot` reads (XLA:GPU and XLA:CPU lower it dense over every group): a saving only
when 3 x rows < E (GATHER_FACTOR). More rows
(prefill chunks, training) keep `ragged_dot`: every expert is busy, and the kernel holds all
rows in VMEM. DFLASH_MOE_GMM=ragged (read once per process) keeps `ragged_dot` everywhere,
=gather the gather dispatch also on TPU.
"""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.models import attention as attn_lib
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.layers import MLP, linear

# Up to this many rows (token-expert pairs per device) the expert matmuls skip the experts
# without rows (module docstring): Qwen3-30B-A3B's top-8 gives 512 rows at a batch of 4 blocks
# of 16 tokens. The routed kernel holds all rows [<= 512, K] in VMEM (2 MiB at K = 2048 in
# bfloat16, double-buffered 4 MiB of a 16 MiB scoped VMEM); past it most experts are busy.
ROUTED_MAX_ROWS = 512
# "auto" (the rule of `gmm_method`), "ragged" (ragged_dot everywhere) or "gather" (the gather
# dispatch on TPU too): DFLASH_MOE_GMM.
MOE_GMM = os.environ.get("DFLASH_MOE_GMM", "auto")
# The gather dispatch moves ~GATHER_FACTOR x rows expert matrices (module docstring); it runs
# when that is fewer than the E experts ragged_dot reads.
GATHER_FACTOR = 3


def route(x_NH, router_HE, top_k: int, norm_topk_prob: bool):
    """Qwen3-MoE routing of tokens x [N, H]. Returns (weights [N, k] in x's dtype, experts
    [N, k] int32)."""
    logits = jnp.dot(x_NH, router_HE.astype(x_NH.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(logits.dtype), experts.astype(jnp.int32)


def gmm_method(rows: int, experts: int, impl: str = "xla") -> str:
    """How `expert_ffn` multiplies `rows` sorted token-expert pairs by `experts` stacked experts
    under the attention `impl` (module docstring): "ragged" (`jax.lax.ragged_dot`), "routed"
    (the Pallas TPU kernel `routed_gmm`), "routed_interpret" (it in interpret mode) or "gather"
    (`gather_gmm`)."""
    if MOE_GMM not in ("auto", "ragged", "gather"):
        raise ValueError(f"DFLASH_MOE_GMM must be auto, ragged or gather, got {MOE_GMM!r}")
    if MOE_GMM == "ragged" or rows == 0 or rows > ROUTED_MAX_ROWS:
        return "ragged"
    impl = attn_lib.resolve_impl(impl)
    if MOE_GMM == "auto":
        if impl == "pallas_interpret":
            return "routed_interpret"
        if impl == "pallas_tpu" or (impl == "pallas" and attn_lib._compile_platform() == "tpu"):
            return "routed"
    return "gather" if GATHER_FACTOR * rows < experts else "ragged"


def _grouped_matmul(method: str, sizes, layer=None, transposed=False):
    """(rows [M, K], weights [E, K, N]) -> [M, N] in rows' dtype: the rows of group e (sorted,
    `sizes` [E] of them) times weights[e], rows past the groups 0, by `method`
    (`gmm_method`). `transposed`: the weights are [E, N, K], contracted on their minor
    dimension (the gate and up projections, `SparseMoE`). With `layer`, the weights are a
    scanned layer stack [L, E, ...]: the routed kernel reads layer `layer` in place, the XLA
    forms index it."""
    pick = (lambda w: w) if layer is None else (lambda w: w[layer])
    from pallas_kernels import grouped_matmul as gm  # the kernels folder, imported when used

    if method == "ragged":
        dot = gm.ragged_dot_t if transposed else jax.lax.ragged_dot
        return lambda x, w: dot(x, pick(w).astype(x.dtype), sizes)
    if method == "gather":
        return lambda x, w: gm.gather_gmm(x, pick(w), sizes, transposed=transposed)
    # Interpret mode (CPU): Pallas' generic interpreter, which runs under the expert-parallel
    # shard_map too (the TPU interpret mode, single-device, is what tests/test_grouped_matmul.py
    # holds the kernel to).
    interpret = "plain" if method == "routed_interpret" else False
    return lambda x, w: gm.routed_gmm(
        x, w, sizes, interpret=interpret, layer=layer, transposed=transposed
    )


def expert_ffn(
    x_NH, weights_Nk, experts_Nk, gate_EIH, up_EIH, down_EIH, first=0, impl="xla", layer=None
):
    """Dropless mixture of SwiGLU experts over tokens x [N, H] (module docstring). Every expert
    kernel is [E, I, H] (`SparseMoE`): gate and up contracted on H, their minor dimension.

    `first`: the global id of expert 0 of the stacked weights (an expert-parallel shard holds
    experts first .. first + E - 1); pairs routed to other experts contribute nothing here.
    `impl`: the attention impl, which with the number of pairs picks the grouped matmul
    (`gmm_method`). `layer`: the expert weights are a scanned layer stack [L, E, ...] and this
    is layer `layer` (`_grouped_matmul`).
    """
    k = experts_Nk.shape[1]
    num_local = gate_EIH.shape[-3]
    local = experts_Nk.reshape(-1) - first  # [N*k]
    mine = (local >= 0) & (local < num_local)
    group = jnp.where(mine, local, num_local)  # other experts' pairs: after the last group
    order = jnp.argsort(group, stable=True)
    sizes = jnp.bincount(group, length=num_local + 1)[:num_local].astype(jnp.int32)
    token = order // k
    rows = x_NH[token]
    dt = x_NH.dtype
    method = gmm_method(rows.shape[0], num_local, impl)
    gmm_t = _grouped_matmul(method, sizes, layer, transposed=True)
    gate = gmm_t(rows, gate_EIH)
    up = gmm_t(rows, up_EIH)
    y = _grouped_matmul(method, sizes, layer)(nn.silu(gate) * up, down_EIH)
    w = jnp.where(mine[order], weights_Nk.reshape(-1)[order], 0).astype(dt)
    return jnp.zeros_like(x_NH).at[token].add(y * w[:, None])


def _mesh_shape():
    mesh = jax.sharding.get_abstract_mesh()
    return mesh, ({} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes)))


def moe_ffn(x_BTH, weights_BTk, experts_BTk, gate_EIH, up_EIH, down_EIH, impl="xla", layer=None):
    """`expert_ffn` over [B, T, H] tokens: on one device, or per shard of the context mesh
    (`jax.sharding.set_mesh`) when it has several devices: tokens over the data axes (where
    the batch divides), experts over `expert` and their width over `tensor` (where those
    divide), one psum over the axes that split the experts (module docstring). `impl`: the
    attention impl (`gmm_method`). `layer`: the weights are a layer stack [L, E, ...]."""
    b, t, h = x_BTH.shape
    k = experts_BTk.shape[-1]
    mesh, shape = _mesh_shape()
    e, i, _ = gate_EIH.shape[-3:]
    if mesh.empty or mesh.size == 1:
        out = expert_ffn(
            x_BTH.reshape(-1, h),
            weights_BTk.reshape(-1, k),
            experts_BTk.reshape(-1, k),
            gate_EIH,
            up_EIH,
            down_EIH,
            impl=impl,
            layer=layer,
        )
        return out.reshape(b, t, h)
    from jax.sharding import PartitionSpec as P

    data = tuple(a for a in ("data", "fsdp") if shape.get(a, 1) > 1)
    n_data = 1
    for a in data:
        n_data *= shape[a]
    bax = data if data and b % n_data == 0 else None
    n_exp = shape.get("expert", 1)
    expert = "expert" if n_exp > 1 and e % n_exp == 0 else None
    tensor = "tensor" if shape.get("tensor", 1) > 1 and i % shape["tensor"] == 0 else None
    reduce_axes = tuple(a for a in (expert, tensor) if a)
    per_shard = e // n_exp if expert else e

    def local(x, w, ids, g, u, d, li=None):
        first = jax.lax.axis_index("expert") * per_shard if expert else 0
        out = expert_ffn(
            x.reshape(-1, h), w.reshape(-1, k), ids.reshape(-1, k), g, u, d, first, impl, li
        )
        out = out.reshape(x.shape)
        return jax.lax.psum(out, reduce_axes) if reduce_axes else out

    tok = P(bax)
    lead = () if layer is None else (None,)  # a layer stack's axis, never split
    experts = P(*lead, expert, tensor, None)  # every expert kernel [E, I, H]
    specs = (tok, tok, tok, experts, experts, experts)
    args = (x_BTH, weights_BTk, experts_BTk, gate_EIH, up_EIH, down_EIH)
    if layer is not None:  # the layer index, replicated
        specs, args = specs + (P(),), args + (jnp.asarray(layer, jnp.int32),)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=tok, check_vma=False)(*args)


class SparseMoE(nn.Module):
    """A Qwen3-MoE sparse feed-forward block. Parameters: the router `gate/kernel` [H, E]
    (Hugging Face `mlp.gate.weight` [E, H]) and the experts stacked on a leading axis, all
    three [E, I, H]: `experts/{gate_proj,up_proj}/kernel` as the checkpoints store each expert
    ([out, in], contracted on H, their minor dimension) and `experts/down_proj/kernel` as
    [in, out] (Hugging Face stores one expert at a time, `mlp.experts.e.{gate,up,down}_proj
    .weight`; `checkpoint.py` stacks them at load and splits them at save). So a chip's slice
    of the expert width I (over `tensor`) never is the minor dimension: TPU's default layout
    stores an array whose minor dimension is not a multiple of 128 lanes transposed, and the
    kernels would copy every expert back each call (`pallas_kernels/grouped_matmul.py`).
    `impl`: the attention impl (it picks the grouped matmul of few rows, `gmm_method`)."""

    cfg: ModelConfig
    impl: str = "xla"

    @nn.compact
    def __call__(self, x_BTH, stack_layer=None):
        """`stack_layer` (index, L): this block's experts are given as a scanned stack's
        [L, E, ...] (the whole stack, not a slice: the routed kernel reads the layer in place)
        and this is layer `index` of it (`transformer.split_experts`)."""
        layer, lead = (None, ()) if stack_layer is None else (stack_layer[0], (stack_layer[1],))
        c = self.cfg
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        x = x_BTH.astype(c.dtype)
        init = nn.initializers.lecun_normal()
        router = _Kernel((h, e), c.param_dtype, init, name="gate")()
        weights, ids = route(x.reshape(-1, h), router, c.num_experts_per_tok, c.norm_topk_prob)
        experts = Experts(e, h, i, c.param_dtype, lead, name="experts")()
        k = c.num_experts_per_tok
        out = moe_ffn(
            x,
            weights.reshape(*x.shape[:2], k),
            ids.reshape(*x.shape[:2], k),
            experts["gate_proj"],
            experts["up_proj"],
            experts["down_proj"],
            self.impl,
            layer,
        )
        shared = 0 if c.hybrid is None else c.hybrid.shared_expert_intermediate_size
        if shared:  # Qwen3.5-MoE: a shared expert for every token, scaled by its own gate
            y = MLP(c.replace(intermediate_size=shared), name="shared_expert")(x)
            gate = jax.nn.sigmoid(linear(c, 1, "shared_expert_gate")(x).astype(jnp.float32))
            out = out.astype(jnp.float32) + gate * y.astype(jnp.float32)
        return out.astype(c.dtype)


class Experts(nn.Module):
    """The stacked expert weights: `{gate_proj,up_proj,down_proj}/kernel`."""

    num_experts: int
    hidden: int
    width: int
    param_dtype: jnp.dtype
    lead: tuple = ()  # (L,): a scanned stack's, given whole (`SparseMoE`)

    @nn.compact
    def __call__(self):
        e, h, i = self.num_experts, self.hidden, self.width
        # LeCun normal over each expert's fan-in: H for gate / up ([.., I, H], input minor), I
        # for down ([.., I, H], input second-minor).
        fan_in_h = nn.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=(0,))
        fan_in_i = nn.initializers.lecun_normal(batch_axis=(0,))
        out = {}
        for name, init in (("gate_proj", fan_in_h), ("up_proj", fan_in_h), ("down_proj", fan_in_i)):
            out[name] = _Kernel(self.lead + (e, i, h), self.param_dtype, init, name=name)()
        return out


class _Kernel(nn.Module):
    shape: tuple
    param_dtype: jnp.dtype
    init: object

    @nn.compact
    def __call__(self):
        return self.param("kernel", self.init, self.shape, self.param_dtype)
