"""One trainer for DFlash drafters (`mode="drafter"`) and small targets (`mode="target"`).

(Over ~450 lines on purpose: the step and the one loop around it, whose length is resumption,
preemption, NaN rollback and metrics read one step late; building the run is experiment.py,
the defaults configs/default.py.)

    train_and_evaluate(config, workdir) -> summary dict

builds the experiment (`dflash_jax.training.experiment`: tokenizer, data, models, loss),
restores the newest readable checkpoint, trains with AdamW + warmup-cosine + global-norm
clipping in one jitted step (`make_train_step`) on a device mesh (`config.mesh`:
empty for data parallelism over all local devices, or a `sharding` spec such as "fsdp=8" or
"data=2,fsdp=4": the trained parameters, their AdamW moments and the frozen target are then
sharded by the partition rules of `dflash_jax.sharding`; with several processes, e.g. a pod or
`dflash_jax.launch`, the mesh spans all of them and each reads only its data streams, see
`dflash_jax.distributed`), logs progress / TensorBoard / JSONL,
evaluates (per-position draft accuracy, tau with the real `generate`), saves Orbax checkpoints
(periodic, async, keep-N, on SIGTERM/SIGINT), stops cleanly on a NaN loss, and exports the
result (drafter: z-lab format; target: Hugging Face format with its tokenizer).

In target mode, `unlikelihood.weight > 0` adds sequence-level unlikelihood on the model's own
greedy continuations, decoded each step (`dflash_jax.training.unlikelihood`): a fine-tune
against greedy loops.

Config keys: see configs/default.py; experiment files in `configs/` override them.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dflash_jax import console, distributed
from dflash_jax.target import save_target
from dflash_jax.training.checkpointing import Checkpointer
from dflash_jax.training.experiment import Experiment, build_experiment, log as _log

# The drafter objective that `dflash_jax.dry_run` compiles with `make_train_step`.
from dflash_jax.training.experiment import drafter_loss_fn  # noqa: F401
from dflash_jax.training.metrics import MetricsLogger, format_eta


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
    from dflash_jax import sharding

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


# ----------------------------------------------------------------------------- evaluation


def evaluate(exp: Experiment, params, eval_step, step: int, frozen=None, mesh=None) -> dict:
    """Held-out loss and per-position draft accuracy; tau with the real `generate` (on `mesh`
    when given). `frozen`: the target parameters as placed for training (default exp.frozen)."""
    frozen = exp.frozen if frozen is None else frozen
    out = {}
    if exp.eval_batches:
        acc = None
        for batch in exp.eval_batches:
            m = jax.device_get(eval_step(params, frozen, batch))
            acc = m if acc is None else jax.tree_util.tree_map(np.add, acc, m)
        n = len(exp.eval_batches)
        out["loss"] = float(acc["loss"]) / n
        if exp.mode == "drafter":
            per_k = acc["correct_k"] / np.maximum(acc["count_k"], 1)
            for k in range(1, len(per_k)):
                out[f"acc_k{k:02d}"] = float(per_k[k])
            out["block_accept_len"] = float(acc["accept_sum"] / max(acc["num_blocks"], 1))
        else:
            out["accuracy"] = float(acc["correct"] / max(acc["weight_sum"], 1))
            out["perplexity"] = float(np.exp(min(out["loss"], 50.0)))
    if exp.mode == "drafter" and exp.eval_prompts:
        from dflash_jax.decoding import generate

        res = generate(
            exp.target_for(params),
            exp.drafter_for(params),
            exp.eval_prompts,
            exp.config.eval_max_new_tokens,
            stop_token_ids=exp.stop_ids,
            mesh=mesh,
        )
        out["tau"] = float(res.stats["tau"])
    return out


# ------------------------------------------------------------------------------ main loop


class _StopFlag:
    def __init__(self):
        self.signum = None
        self._old = {}

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        del frame
        self.signum = signum

    def uninstall(self):
        for sig, h in self._old.items():
            signal.signal(sig, h)


def train_and_evaluate(config, workdir: str) -> dict:
    """Runs (or resumes) training in `workdir`. Returns a summary:
    {"status": "done" | "stopped" | "preempted" | "nan" | "data_exhausted" | "regenerated"
     (regen.only), "step",
     "losses": [(step, loss), ...] of this process, "eval": last eval metrics,
     "export": path or None}."""
    from dflash_jax import validation

    validation.check_train_config(config)  # one-line ConfigError before anything runs
    accum = int(config.get("grad_accum_steps", 1))
    check_grad_accum(config.data.batch_size, accum)
    if accum > 1 and config.mode == "target" and config.unlikelihood.weight > 0:
        raise ValueError(
            f"grad_accum_steps {accum} > 1 with unlikelihood.weight "
            f"{config.unlikelihood.weight} > 0: the unlikelihood rows are not accumulated"
        )
    validation.writable_dir(workdir, "workdir")
    if config.regen.output and not os.path.exists(config.regen.output):
        validation.writable_file(config.regen.output, "regen.output")
    workdir = os.path.abspath(workdir)
    regen_only = config.regen.get("only", False)
    if regen_only and (config.mode != "drafter" or config.data.kind != "regenerated"):
        raise ValueError(
            "regen.only needs mode='drafter' and data.kind='regenerated', got "
            f"mode={config.mode!r}, data.kind={config.data.kind!r}"
        )
    os.makedirs(workdir, exist_ok=True)
    exp = build_experiment(config, workdir)
    if regen_only:  # the responses exist now (build_experiment wrote or found them)
        path = config.regen.output or os.path.join(workdir, "regenerated.jsonl")
        _log(f"regen.only: responses in {path}; no training")
        return {
            "status": "regenerated",
            "step": 0,
            "losses": [],
            "eval": {},
            "export": None,
            "regenerated": path,
        }
    total = (
        config.num_train_steps
        if config.num_train_steps > 0
        else exp.steps_per_epoch * config.data.num_epochs
    )
    stop_at = min(total, config.stop_at_step) if config.stop_at_step > 0 else total
    optimizer, schedule = make_optimizer(config, total)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=exp.init_params,
        opt_state=optimizer.init(exp.init_params),
        rng=jax.random.PRNGKey(config.seed),
    )
    # "" is data parallelism over this host's devices: the same rules on a data-only mesh,
    # where every parameter is replicated.
    from dflash_jax import sharding

    mesh_spec = config.get("mesh", "")
    sizes = sharding.parse_mesh(mesh_spec or "data=-1")
    pool = jax.devices() if mesh_spec or distributed.is_multiprocess() else jax.local_devices()
    mesh = sharding.make_mesh(
        **sizes, devices=pool if -1 in sizes.values() else pool[: math.prod(sizes.values())]
    )
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    state_sh, frozen_sh, data_sh = train_shardings(
        mesh,
        exp.mode,
        state,
        exp.frozen,
        exp.target_cfg.head_dim,
        exp.drafter_cfg.body.head_dim if exp.drafter_cfg is not None else None,
    )
    n_dev = mesh.devices.size
    if config.data.batch_size % n_batch:
        raise ValueError(
            f"batch_size {config.data.batch_size} is not divisible by the "
            f"{n_batch} batch shards of the mesh ({n_dev} devices)"
        )
    check_grad_accum(config.data.batch_size, accum, n_batch)
    if exp.repetition_sampler is not None and config.unlikelihood.batch_size % n_batch:
        raise ValueError(
            f"unlikelihood.batch_size {config.unlikelihood.batch_size} is not "
            f"divisible by the {n_batch} batch shards of the mesh"
        )
    # Several processes: each reads only the data streams whose rows its devices hold.
    exp.train_iter = distributed.shard_batches(
        exp.train_iter, data_sh, config.data.get("num_shards", 0)
    )
    ckpt = Checkpointer(
        os.path.join(workdir, "checkpoints"),
        config.checkpoint_every,
        config.keep_checkpoints,
        config.async_checkpoint,
    )
    abstract = jax.tree_util.tree_map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
        jax.eval_shape(lambda: state),
        state_sh,
    )
    try:
        restored = ckpt.restore(abstract)
    except BaseException:  # incompatible: leave every checkpoint as it is
        ckpt.manager.close()
        raise
    if distributed.is_multiprocess():
        steps = distributed.allgather_json(-1 if restored is None else int(restored[2]))
        if len(set(steps)) > 1:
            raise RuntimeError(
                f"processes restored different checkpoint steps {steps} from {ckpt.directory}"
            )
    if restored is not None:
        state, data_state, _ = restored
        exp.train_iter.set_state(data_state)
        _log(f"resumed from step {int(state.step)} ({ckpt.directory})")
    state = distributed.put(state, state_sh)
    frozen = distributed.put(exp.frozen, frozen_sh)
    # The state is donated: each step's input state is dead once the step is called (a
    # non-finite step breaks out with it, unused; exp.init_params may share its buffers: only
    # its sizes are read below).
    train_step = make_train_step(
        exp.loss_fn,
        optimizer,
        mesh,
        (state_sh, frozen_sh, data_sh),
        donate=True,
        grad_accum_steps=accum,
    )
    eval_mesh = mesh if n_dev > 1 else None
    eval_jit = jax.jit(
        lambda p, f, b: exp.loss_fn(p, f, b, jax.random.PRNGKey(1234))[1],
        out_shardings=NamedSharding(mesh, P()),
    )
    eval_step = lambda p, f, b: eval_jit(p, f, distributed.put(b, data_sh))

    n_params = sum(x.size for x in jax.tree_util.tree_leaves(exp.init_params))
    _log(
        f"{config.mode} training: {n_params / 1e6:.2f}M trained params, {total} steps "
        f"({exp.steps_per_epoch}/epoch), batch {config.data.batch_size}x{config.data.seq_len} "
        + (f"in {accum} micro-batches " if accum > 1 else "")
        + f"over {n_dev} device(s) [{jax.devices()[0].platform}, mesh "
        f"{sharding.mesh_str(mesh)}], workdir {workdir}"
    )
    logger = MetricsLogger(
        workdir,
        resume_step=int(state.step),  # no duplicate rows
        enabled=distributed.is_primary(),
    )
    flag = _StopFlag().install()
    step = int(state.step)
    status, last_eval, history = "done", {}, []
    tokens_per_step = config.data.batch_size * config.data.seq_len
    t_window, steps_window, t_start, step_start = time.time(), 0, time.time(), step
    acc_window = None
    profiling = False
    bar = console.progress(total=total, initial=step, desc="train", unit="step")

    def finish(k, metrics, rep_frac) -> bool:
        """The host's part of step k, once its metrics are read: the non-finite loss check,
        the loss history, the log window. False when the loss is not finite (step k is
        dropped: `step` goes back to k - 1, the last good step)."""
        nonlocal status, step, t_window, steps_window, acc_window
        metrics = jax.device_get(metrics)
        if rep_frac is not None:
            metrics = dict(metrics, rep_frac=np.float32(rep_frac))
        loss = float(metrics["loss"]) + float(metrics.get("ul_loss", 0.0))
        if not math.isfinite(loss):
            status, step = "nan", k - 1
            _log(
                f"ERROR: non-finite loss ({loss}) at step {k}; stopping. The last "
                f"good checkpoint (step {ckpt.manager.latest_step()}) is kept; this "
                "state is not saved."
            )
            return False
        history.append((k, loss))
        bar.update(1)
        steps_window += 1
        acc_window = (
            metrics if acc_window is None else jax.tree_util.tree_map(np.add, acc_window, metrics)
        )
        if k % config.log_every == 0 or k == stop_at:
            dt = time.time() - t_window
            rate = steps_window * tokens_per_step / max(dt, 1e-9)
            elapsed = time.time() - t_start
            eta = elapsed / max(k - step_start, 1) * (total - k)
            rec = {
                "loss": acc_window["loss"] / steps_window,
                "grad_norm": acc_window["grad_norm"] / steps_window,
                "learning_rate": float(schedule(k - 1)),
                "tokens_per_s": rate,
            }
            if exp.mode == "drafter":
                per_k = acc_window["correct_k"] / np.maximum(acc_window["count_k"], 1)
                rec["acc_k01"] = float(per_k[1])
                rec["block_accept_len"] = float(
                    acc_window["accept_sum"] / max(acc_window["num_blocks"], 1)
                )
            ul_msg = ""
            if "rep_frac" in acc_window:
                rec.update(
                    {
                        key: float(acc_window[key]) / steps_window
                        for key in ("ul_loss", "ul_p", "rep_frac")
                    }
                )
                ul_msg = (
                    f"ul {rec['ul_loss']:.3f} p_rep {rec['ul_p']:.2f} "
                    f"repeated {100 * rec['rep_frac']:.1f}% "
                )
            logger.write("train", k, rec)
            bar.set_postfix_str(f"loss {rec['loss']:.4f}", refresh=False)
            _log(
                f"step {k}/{total} loss {rec['loss']:.4f} {ul_msg}"
                f"lr {rec['learning_rate']:.2e} gnorm {rec['grad_norm']:.2f} "
                f"{rate:,.0f} tok/s ETA {format_eta(eta)}"
            )
            t_window, steps_window, acc_window = time.time(), 0, None
        return True

    # Metrics are read one step late (as nanodo does): step k's are read after step k + 1 is
    # dispatched, so the host never waits for the device before queueing the next step.
    # Steps whose state is used (evaluation, checkpoint, the last) are read at once, so no
    # state with a non-finite loss is evaluated or saved.
    pending = None  # (step, metrics on device, rep_frac) not read yet
    try:
        while step < stop_at:
            try:
                batch = next(exp.train_iter)
            except StopIteration:
                status = "data_exhausted"
                break
            if config.profile_dir and step == config.profile_start_step:
                jax.profiler.start_trace(config.profile_dir)
                profiling = True
            batch = {k: batch[k] for k in ("input_ids", "loss_mask", "segment_ids")}
            rep_frac = None
            if exp.repetition_sampler is not None:
                ul_batch, rep_frac = exp.repetition_sampler(state.params, step, eval_mesh)
                batch.update(ul_batch)
            batch = distributed.put(batch, data_sh)
            new_state, metrics = train_step(state, frozen, batch)
            if pending is not None:
                ok, pending = finish(*pending), None
                if not ok:
                    break
            if profiling and step + 1 >= config.profile_start_step + config.profile_num_steps:
                jax.block_until_ready(metrics)
                jax.profiler.stop_trace()
                profiling = False
                _log(
                    f"profile of steps {config.profile_start_step}.."
                    f"{step} written to {config.profile_dir}"
                )
            state = new_state
            step += 1
            pending = (step, metrics, rep_frac)
            evaluating = config.eval_every > 0 and (step % config.eval_every == 0 or step == total)
            if evaluating or step % ckpt.every == 0 or step == stop_at:
                ok, pending = finish(*pending), None
                if not ok:
                    break
            if evaluating:
                last_eval = evaluate(exp, state.params, eval_step, step, frozen, eval_mesh)
                logger.write("eval", step, last_eval)
                _log(
                    f"eval step {step}: "
                    + " ".join(
                        f"{k} {v:.3f}"
                        for k, v in last_eval.items()
                        if not k.startswith("acc_k")
                        or k in ("acc_k01", "acc_k02", "acc_k04", "acc_k08")
                    )
                )
            if ckpt.maybe_save(step, state, exp.train_iter.get_state):
                _log(f"checkpoint step {step} -> {ckpt.directory}")
            # A signal to any one process stops all of them after the same step.
            if distributed.any_process(flag.signum is not None):
                if pending is not None and not finish(*pending):
                    break  # (a non-finite loss: stopped, nothing saved)
                pending = None
                status = "preempted"
                _log(
                    f"signal {flag.signum or 'to another process'}: saving step {step} and stopping"
                )
                break
        if pending is not None:  # the data ran out before the last step's read
            finish(*pending)
        if status != "nan" and ckpt.maybe_save(step, state, exp.train_iter.get_state, force=True):
            _log(f"checkpoint step {step} -> {ckpt.directory}")
        if status == "done" and step < total:
            status = "stopped"
    finally:
        bar.close()
        if profiling:
            jax.profiler.stop_trace()
        ckpt.close()
        flag.uninstall()
        logger.close()

    export_path = None
    if config.export and status == "done":
        export_path = export(exp, state.params, os.path.join(workdir, "export"))
        _log(f"exported to {export_path}")
    return {
        "status": status,
        "step": step,
        "losses": history,
        "eval": last_eval,
        "export": export_path,
        "total_steps": total,
    }


def export(exp: Experiment, params, directory: str) -> str:
    """Drafter: z-lab format (`save_drafter`). Target: HF format with the tokenizer beside it."""
    from dflash_jax.drafter import save_drafter

    params = distributed.gather(params)  # all processes take part; process 0 writes
    if exp.mode == "drafter":
        path = os.path.join(directory, "drafter")
        if not distributed.is_primary():
            return path
        save_drafter(exp.drafter_for(params), path)
    else:
        path = os.path.join(directory, "target")
        if not distributed.is_primary():
            return path
        save_target(exp.target_for(params), path)
        if exp.tokenizer is not None and not os.path.exists(os.path.join(path, "tokenizer.json")):
            exp.tokenizer.save(path)
    return path
