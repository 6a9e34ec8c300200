"""The training step: `TrainState`, the optimizer (`make_optimizer`), the jitted step with
gradient accumulation (`make_train_step`, `check_grad_accum`) and its layout on a device mesh
(`train_shardings`).

`trainer.train_and_evaluate` runs this step in its loop; `dflash_jax.dry_run` compiles it for
TPU topologies from abstract parameters.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@flax.struct.dataclass
class TrainState:
    step: jnp.ndarray
    params: Any
    opt_state: Any
    rng: jnp.ndarray


def make_optimizer(config, total_steps: int):
    """AdamW (weight decay from config, 0 in the recipe), warmup-cosine, global-norm clip."""
    warmup = max(1, int(round(config.warmup_ratio * total_steps)))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=config.learning_rate * config.end_lr_ratio,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(schedule, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay),
    )
    return tx, schedule


def check_grad_accum(batch_size: int, grad_accum_steps: int, batch_shards: int = 1):
    """One-line ValueError unless `grad_accum_steps` >= 1 divides `batch_size` into
    micro-batches that split evenly over `batch_shards` (the mesh's data x fsdp)."""
    if grad_accum_steps < 1 or batch_size % grad_accum_steps:
        raise ValueError(
            f"grad_accum_steps {grad_accum_steps} must be >= 1 and divide the batch size "
            f"{batch_size}"
        )
    micro = batch_size // grad_accum_steps
    if micro % batch_shards:
        raise ValueError(
            f"micro-batch size {micro} (batch size {batch_size} / grad_accum_steps "
            f"{grad_accum_steps}) is not divisible by the {batch_shards} batch shards of the mesh"
        )


def make_train_step(
    loss_fn: Callable,
    optimizer,
    mesh: Optional[Mesh] = None,
    shardings=None,
    donate: bool = False,
    grad_accum_steps: int = 1,
):
    """jit(step)(state, frozen, batch) -> (state, metrics); loss_fn(params, frozen, batch, key).

    With a mesh and no `shardings`: batch sharded over `data`, everything else replicated; XLA
    inserts the gradient all-reduce. `shardings` = (state, frozen, batch) shardings (see
    `train_shardings`) lay the step out on the mesh that way instead. The step's random key is
    fold_in(state.rng, state.step), so a resumed run draws the same anchors as the uninterrupted
    one. `donate`: the input state's buffers are donated to the new state (one copy of the
    parameters and moments in HBM, not two); the caller must not read the state it passed (nor
    arrays sharing its buffers, e.g. the ones it was `device_put` from) after the call.

    grad_accum_steps > 1: the batch is cut into that many micro-batches along its rows (rows
    i, i + A, i + 2A, ... form micro-batch i, so each keeps the batch's sharding), scanned in
    the one compiled step; one optimizer update per step. See `_accumulated_grads` for what
    the loss must return for this to be the full batch's gradient and metrics.
    """

    def step(state: TrainState, frozen, batch):
        key = jax.random.fold_in(state.rng, state.step)
        # The mesh as the context mesh while tracing: the compiled Pallas training kernel, which
        # GSPMD cannot partition, runs per shard of it (`attention.training_attention`).
        with (
            contextlib.nullcontext()
            if mesh is None
            else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
        ):
            if grad_accum_steps == 1:
                (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                    state.params, frozen, batch, key
                )
            else:
                grads, metrics = _accumulated_grads(
                    loss_fn, state.params, frozen, batch, key, grad_accum_steps, mesh, shardings
                )
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
    donation = dict(donate_argnums=(0,)) if donate else {}
    if mesh is None:
        return jax.jit(step, **donation)
    if shardings is None:
        rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        return jax.jit(step, in_shardings=(rep, rep, data), out_shardings=(rep, rep), **donation)
    state_sh, frozen_sh, batch_sh = shardings
    return jax.jit(
        step,
        in_shardings=(state_sh, frozen_sh, batch_sh),
        out_shardings=(state_sh, NamedSharding(mesh, P())),
        **donation,
    )


def _accumulated_grads(loss_fn, params, frozen, batch, key, steps: int, mesh, shardings):
    """(grads, metrics) of the whole batch from `steps` micro-batches in a `lax.scan`.

    The losses normalise by the batch: loss = sum(w * l) / sum(w), with sum(w) returned as
    metrics["weight_sum"] and every other metric a sum over the batch's rows (drafter_loss,
    target_loss). A mean of the micro-batch losses would weight a micro-batch with few scored
    tokens as much as a full one; instead each micro-batch contributes its loss times its
    weight_sum (its unnormalised sum; a constant of the parameters, so its gradient is
    weight_sum x the micro-batch's gradient), and the float32 sums are divided by the whole
    batch's weight_sum at the end: the full batch's loss and gradient (exactly, up to rounding,
    whenever each micro-batch's weight_sum is 0 or >= the losses' 1e-9 floor). The other
    metrics add up. Randomness: the key is split into one key per row
    (`losses.row_keys`) and each micro-batch gets its rows' keys, so a loss drawing per row
    (drafter_loss) draws what the full batch would.
    """
    from dflash_jax.training.losses import row_keys

    b = jax.tree_util.tree_leaves(batch)[0].shape[0]
    check_grad_accum(b, steps)
    if mesh is None:
        micro_sh = None
    else:
        rows = P("data") if shardings is None else shardings[2].spec
        micro_sh = NamedSharding(mesh, P(None, *rows))

    def split(x):  # [B, ...] -> [steps, B / steps, ...]: micro-batch i = rows i, i + steps, ...
        x = jnp.moveaxis(x.reshape((b // steps, steps) + x.shape[1:]), 1, 0)
        if micro_sh is not None and x.ndim >= 2:
            x = jax.lax.with_sharding_constraint(x, micro_sh)
        return x

    xs = (jax.tree_util.tree_map(split, batch), split(row_keys(key, b)))

    def weighted(p, micro, keys):
        loss, metrics = loss_fn(p, frozen, micro, keys)
        w = jax.lax.stop_gradient(metrics["weight_sum"]).astype(jnp.float32)
        return loss.astype(jnp.float32) * w, metrics

    grad_fn = jax.grad(weighted, has_aux=True)
    f32 = lambda t: jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), t)
    param_sh = None if shardings is None else shardings[0].params

    def constrain(g):
        return g if param_sh is None else jax.lax.with_sharding_constraint(g, param_sh)

    def body(carry, x):
        g_sum, m_sum = carry
        g, m = grad_fn(params, *x)
        m = dict(m, loss=m["loss"].astype(jnp.float32) * m["weight_sum"].astype(jnp.float32))
        g_sum = constrain(jax.tree_util.tree_map(lambda a, c: a + c.astype(jnp.float32), g_sum, g))
        return (g_sum, jax.tree_util.tree_map(jnp.add, m_sum, f32(m))), None

    micro0 = jax.tree_util.tree_map(lambda x: x[0], xs)
    m_shape = jax.eval_shape(lambda: loss_fn(params, frozen, micro0[0], micro0[1])[1])
    zeros = lambda t: jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, jnp.float32), t)
    g0 = constrain(zeros(params))
    (g_sum, m_sum), _ = jax.lax.scan(body, (g0, zeros(m_shape)), xs)
    denom = jnp.maximum(m_sum["weight_sum"], 1e-9)
    grads = jax.tree_util.tree_map(lambda g, p: (g / denom).astype(p.dtype), g_sum, params)
    metrics = dict(m_sum, loss=m_sum["loss"] / denom)
    metrics = jax.tree_util.tree_map(lambda v, s: v.astype(s.dtype), metrics, m_shape)
    return grads, metrics


def train_shardings(
    mesh: Mesh,
    mode: str,
    state,
    frozen,
    target_head_dim: int,
    drafter_head_dim: Optional[int] = None,
):
    """(state, frozen, batch) shardings for `make_train_step` on a ("data", "fsdp", "tensor")
    mesh: the trained parameters and their optimizer moments by the drafter's (or, training a
    target, the target's) FSDP + tensor rules, the frozen target by the target's, step and rng
    replicated, the batch over ("data", "fsdp")."""
    from dflash_jax.parallel import sharding

    if mode == "drafter":
        rules, head_dim = sharding.target_rules(True), drafter_head_dim
    else:
        rules, head_dim = sharding.target_rules(True), target_head_dim
    rep = NamedSharding(mesh, P())
    state_sh = TrainState(
        step=rep,
        rng=rep,
        params=sharding.param_shardings(state.params, mesh, rules, head_dim),
        opt_state=sharding.param_shardings(state.opt_state, mesh, rules, head_dim),
    )
    frozen_sh = (
        None
        if frozen is None
        else sharding.param_shardings(frozen, mesh, sharding.target_rules(True), target_head_dim)
    )
    return state_sh, frozen_sh, sharding.batch_sharding(mesh)
