"""One trainer for DFlash drafters (`mode="drafter"`) and small targets (`mode="target"`):
the training loop and the stop flag (SIGTERM/SIGINT) it watches.

    train_and_evaluate(config, workdir) -> summary dict

builds the experiment (`dflash_jax.training.experiment`: tokenizer, data, models, loss),
restores the newest readable checkpoint, trains with AdamW + warmup-cosine + global-norm
clipping in one jitted step (`step.make_train_step`) on a device mesh (`config.mesh`:
empty for data parallelism over all local devices, or a `sharding` spec such as "fsdp=8" or
"data=2,fsdp=4": the trained parameters, their AdamW moments and the frozen target are then
sharded by the partition rules of `dflash_jax.parallel.sharding`; an `expert` axis, e.g.
"data=2,expert=2,fsdp=2", only with a mixture-of-experts target whose experts it divides: they
split over it, and the target pass, traced under the mesh, runs them expert parallel
(`shard_map`, `dflash_jax.models.moe`); with several processes, e.g. a pod or
`dflash_jax.launch`, the mesh spans all of them and each reads only its data streams, see
`dflash_jax.parallel.distributed`), logs progress / TensorBoard / JSONL,
evaluates (`evaluation.evaluate`: per-position draft accuracy, tau with the real `generate`),
saves Orbax checkpoints (periodic, async, keep-N, on SIGTERM/SIGINT), stops cleanly on a NaN
loss, and exports the result (`export.export`; drafter: z-lab format; target: Hugging Face
format with its tokenizer).

The loop's length is resumption, preemption, NaN rollback and metrics read one step late; the
step is step.py, building the run experiment.py, the checks before it preflight.py, the log
window and profiler run_log.py, the defaults configs/default.py.

In target mode, `unlikelihood.weight > 0` adds sequence-level unlikelihood on the model's own
greedy continuations, decoded each step (`dflash_jax.training.unlikelihood`): a fine-tune
against greedy loops.

Config keys: see configs/default.py; experiment files in `configs/` override them.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflash_jax.drafters import registry
from dflash_jax.parallel import distributed
from dflash_jax.support import console, interrupts
from dflash_jax.training.checkpointing import Checkpointer
from dflash_jax.training.evaluation import evaluate
from dflash_jax.training.experiment import Experiment, build_experiment
from dflash_jax.training.export import export
from dflash_jax.training.metrics import MetricsLogger
from dflash_jax.training.preflight import (  # noqa: F401  (trainer.X, as before the split)
    EXPORT_FILES,
    MeshPlan,
    Preflight,
    _check_expert_axis,
    _target_num_experts,
    check_run,
    export_dir,
    preflight,
)
from dflash_jax.training.run_log import (  # noqa: F401
    LOG_WINDOW_KEY,
    _host_value,
    _LogWindow,
    _Profiler,
)
from dflash_jax.training.step import (
    TrainState,
    make_optimizer,
    make_train_step,
    train_shardings,
)


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


# The files an export writes in its directory (a directory by one of these names blocks it).


def make_workdir(workdir: str) -> str:
    """Creates `workdir` (absolute path returned); a failure is one line naming it."""
    workdir = os.path.abspath(workdir)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"cannot create the workdir {workdir}: {e.strerror or e}"
            + (f" ({e.filename})" if e.filename and e.filename != workdir else "")
        ) from None
    return workdir


def train_and_evaluate(config, workdir: str, checked: Optional[Preflight] = None) -> dict:
    """Runs (or resumes) training in `workdir`. Returns a summary:
    {"status": "done" | "stopped" | "preempted" | "nan" | "data_exhausted" | "regenerated"
     (regen.only), "step",
     "losses": [(step, loss), ...] of this process, "eval": last eval metrics,
     "export": path or None}.
    `checked`: what `check_run(config, workdir)` returned for this config, where the caller
    ran it already (the checks are not run again); None: they run first."""
    if checked is None:
        checked = check_run(config, workdir)
    workdir = make_workdir(workdir)
    exp = build_experiment(config, workdir)
    if config.regen.get("only", False):  # the responses exist now (build_experiment wrote them)
        path = config.regen.output or os.path.join(workdir, "regenerated.jsonl")
        distributed.say(f"regen.only: responses in {path}; no training")
        return {
            "status": "regenerated",
            "step": 0,
            "losses": [],
            "eval": {},
            "export": None,
            "regenerated": path,
        }
    run = _setup(config, workdir, exp, checked)
    logger = MetricsLogger(
        workdir,
        resume_step=int(run.state.step),  # no duplicate rows
        enabled=distributed.is_primary(),
    )
    bar = console.progress(total=run.total, initial=int(run.state.step), desc="train", unit="step")
    window = _LogWindow(config, run, logger, bar)
    flag = _StopFlag().install()
    profiler = _Profiler(config)
    try:
        status, step, state, last_eval = _loop(config, run, window, flag, logger, profiler)
        if status != "nan" and run.ckpt.maybe_save(
            step, state, window.data_state(run.exp.train_iter), force=True
        ):
            distributed.say(f"checkpoint step {step} -> {run.ckpt.directory}")
        if status == "done" and step < run.total:
            status = "stopped"
    finally:
        bar.close()
        profiler.close()
        run.ckpt.close()
        flag.uninstall()
        logger.close()

    export_path = None
    # A time-sliced stage (stop_at_step) exports too: the drafter so far, usable at once.
    if config.export and status in ("done", "stopped"):
        export_path = export(exp, state.params, os.path.dirname(export_dir(config, workdir)))
        distributed.say(f"exported to {export_path}")
    return {
        "status": status,
        "step": step,
        "losses": window.history,
        "eval": last_eval,
        "export": export_path,
        "total_steps": run.total,
    }


def _loop(config, run: "_Run", window: "_LogWindow", flag, logger, profiler):
    """The training steps from the restored one to `run.stop_at`: (status, step, state, last
    eval metrics). Metrics are read one step late (as nanodo does): step k's are read after
    step k + 1 is dispatched, so the host never waits for the device before queueing the next
    step; steps whose state is used (evaluation, checkpoint, the last) are read at once, so no
    state with a non-finite loss is evaluated or saved."""
    exp, ckpt = run.exp, run.ckpt
    state, step = run.state, int(run.state.step)
    status, last_eval = "done", {}
    pending = None  # (step, metrics on device, rep_frac) not read yet
    while step < run.stop_at:
        try:
            batch = next(exp.train_iter)
        except StopIteration:
            status = "data_exhausted"
            break
        profiler.maybe_start(step)
        keys = batch
        batch = {k: batch[k] for k in ("input_ids", "loss_mask", "segment_ids")}
        if run.taps is not None:
            got = run.taps(keys)  # a tap cache's taps, or a tap store's taps and top-k
            batch.update(got if isinstance(got, dict) else {"taps": got})
        rep_frac = None
        if exp.repetition_sampler is not None:
            ul_batch, rep_frac = exp.repetition_sampler(state.params, step, run.eval_mesh)
            batch.update(ul_batch)
        new_state, metrics = run.train_step(state, run.frozen, distributed.put(batch, run.data_sh))
        interrupts.release()  # a signal from here on: this step is saved, then exit 3
        if pending is not None:
            ok, pending = window.finish(*pending), None
            if not ok:
                break
        profiler.maybe_stop(step, metrics)
        state = new_state
        step += 1
        pending = (step, metrics, rep_frac)
        evaluating = config.eval_every > 0 and (step % config.eval_every == 0 or step == run.total)
        if evaluating or step % ckpt.every == 0 or step == run.stop_at:
            ok, pending = window.finish(*pending), None
            if not ok:
                break
        if evaluating:
            last_eval = evaluate(exp, state.params, run.eval_step, step, run.frozen, run.eval_mesh)
            logger.write("eval", step, last_eval)
            distributed.say(f"eval step {step}: " + _eval_line(last_eval))
        if ckpt.maybe_save(step, state, window.data_state(exp.train_iter)):
            distributed.say(f"checkpoint step {step} -> {ckpt.directory}")
        # A signal to any one process stops all of them after the same step.
        if distributed.any_process(flag.signum is not None):
            if pending is not None and not window.finish(*pending):
                break  # (a non-finite loss: stopped, nothing saved)
            pending = None
            status = "preempted"
            distributed.say(
                f"signal {flag.signum or 'to another process'}: saving step {step} and stopping"
            )
            break
    if pending is not None:  # the data ran out before the last step's read
        window.finish(*pending)
    if window.bad_step is not None:
        status, step = "nan", window.bad_step - 1
        distributed.say(
            f"ERROR: non-finite loss ({window.bad_loss}) at step {window.bad_step}; stopping. "
            f"The last good checkpoint (step {ckpt.manager.latest_step()}) is kept; this state "
            "is not saved."
        )
    return status, step, state, last_eval


def _eval_line(metrics: dict) -> str:
    return " ".join(
        f"{k} {v:.3f}"
        for k, v in metrics.items()
        if not k.startswith("acc_k") or k in ("acc_k01", "acc_k02", "acc_k04", "acc_k08")
    )


@dataclasses.dataclass(frozen=True)
class _Run:
    """What the loop runs with, fixed before its first step (`_setup`)."""

    exp: Experiment  # the built experiment; its train_iter reads this process's data streams
    total: int  # the run's steps: num_train_steps, else data.num_epochs epochs
    stop_at: int  # the step this stage stops at: stop_at_step (at most total), else total
    schedule: Callable[[int], Any]  # step -> learning rate (the optimizer's optax schedule)
    state: TrainState  # the state the loop starts from (restored, or step 0), placed
    frozen: Any  # the parameters the step does not train (drafter mode: the target's), placed
    data_sh: Any  # the batch's shardings: its rows over the mesh's data x fsdp
    train_step: Callable  # (state, frozen, batch) -> (state, metrics), jitted; state donated
    eval_step: Callable  # (params, frozen, host batch) -> the loss's metrics (`evaluate`)
    eval_mesh: Optional[Mesh]  # the mesh of evaluation and of the unlikelihood sampler (None
    # on one device)
    ckpt: Checkpointer  # this run's checkpoints (WORKDIR/checkpoints)
    # batch -> the target's taps (a tap cache: data.cache_taps), or {"taps", "topk_ids",
    # "topk_logp"} (a tap store: data.tap_store); None: the step runs the target's pass
    taps: Optional[Callable]
    log_window: Optional[dict]  # the restored checkpoint's log window sums (`_LogWindow.saved`)


def _setup(config, workdir: str, exp, checked: Preflight) -> _Run:
    """The one-time setup: step counts, optimizer, the mesh of `checked` and its shardings
    (the expert axis checked here only where the preflight could not read the target's
    experts), the data streams of this process, the checkpoint restored (all processes at the
    same step), the state and frozen parameters placed, the jitted train and eval steps; the
    start-up lines logged."""
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
    mesh = checked.mesh.build()
    if checked.mesh.num_experts is None:  # a target given by hub id: read once it loaded
        _check_expert_axis(checked.mesh, exp.target_cfg.num_experts, ValueError)
    state_sh, frozen_sh, data_sh = train_shardings(
        mesh,
        exp.mode,
        state,
        exp.frozen,
        exp.target_cfg.head_dim,
        None if exp.drafter_cfg is None else registry.of(exp.drafter_cfg).head_dim(exp.drafter_cfg),
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
    state, log_window = _restore(ckpt, exp, state, state_sh)
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
        grad_accum_steps=checked.accum,
    )
    eval_step = _eval_step(exp, mesh, data_sh)
    taps = _tap_source(config, exp, frozen) if config.data.get("cache_taps", False) else None
    if config.data.get("tap_store", ""):
        taps = _store_source(config, exp)
    _log_start(config, exp, workdir, total, checked.accum, mesh)
    _log_expert_placement(exp, mesh, frozen if exp.mode == "drafter" else state.params)
    return _Run(
        exp=exp,
        total=total,
        stop_at=stop_at,
        schedule=schedule,
        state=state,
        frozen=frozen,
        data_sh=data_sh,
        train_step=train_step,
        eval_step=eval_step,
        eval_mesh=mesh if mesh.devices.size > 1 else None,
        ckpt=ckpt,
        taps=taps,
        log_window=log_window,
    )


def _eval_step(exp, mesh, data_sh) -> Callable:
    """(params, frozen, host batch) -> the loss's metrics, jitted on `mesh` (replicated out)."""

    def eval_loss(p, f, b):
        # Traced under the mesh, as the train step is: a MoE target's experts run expert
        # parallel (shard_map, `dflash_jax/models/moe.py`), Pallas kernels per shard.
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return exp.loss_fn(p, f, b, jax.random.PRNGKey(1234))[1]

    eval_jit = jax.jit(eval_loss, out_shardings=NamedSharding(mesh, P()))
    return lambda p, f, b: eval_jit(p, f, distributed.put(b, data_sh))


def _log_start(config, exp, workdir: str, total: int, accum: int, mesh) -> None:
    """The run's start-up line: what trains, for how long, on which batch and mesh."""
    from dflash_jax.parallel import sharding

    n_params = sum(x.size for x in jax.tree_util.tree_leaves(exp.init_params))
    distributed.say(
        f"{config.mode} training: {n_params / 1e6:.2f}M trained params, {total} steps "
        f"({exp.steps_per_epoch}/epoch), batch {config.data.batch_size}x{config.data.seq_len} "
        + (f"in {accum} micro-batches " if accum > 1 else "")
        + f"over {mesh.devices.size} device(s) [{jax.devices()[0].platform}, mesh "
        f"{sharding.mesh_str(mesh)}], workdir {workdir}"
    )


def _tap_source(config, exp, frozen):
    """batch (with doc_key / doc_offset) -> the target's taps [B, T, F] as a host array: kept
    ones from the tap cache, else the target's pass (then kept). One line when the first
    epoch is kept, with its size."""
    from dflash_jax.models.config import as_dtype
    from dflash_jax.training import tap_cache as tc

    cache = tc.TapCache(as_dtype(config.data.get("cache_taps_dtype", "float32")))
    taps_fn = tc.make_taps_fn(exp.tmod, exp.tap_layers)
    said = [False]

    def taps(batch):
        out = cache.lookup(batch)
        if out is not None:
            if not said[0]:
                said[0] = True
                distributed.say(
                    f"tap cache: {len(cache)} document pieces kept "
                    f"({cache.nbytes / 2**30:.2f} GiB); batches of kept pieces skip the target's pass"
                )
            return out
        out = np.asarray(taps_fn(frozen, batch["input_ids"], batch["segment_ids"]))
        cache.store(batch, out)
        return out

    return taps


def _store_source(config, exp):
    """The tap store of `config.data.tap_store`, checked against this run's target (its
    fingerprint), taps, piece length and every training record's tokens (one line each), as
    the batch -> {"taps", "topk_ids", "topk_logp"} function of the loop: the target never runs."""
    from dflash_jax.training import tap_store as ts

    path = config.data.tap_store
    store = ts.TapStore(
        path,
        expect={
            "target": ts.target_fingerprint(exp.target_cfg, exp.target_params),
            "tap_layers": list(exp.tap_layers),
            "seq_len": int(config.data.seq_len),
        },
    )
    it = exp.train_iter
    if not hasattr(it, "source"):
        raise ts.StoreError("data.tap_store: one data stream only (no data.num_shards > 1)")
    store.check_records(it.source, it.tokenize_fn)
    distributed.say(
        f"tap store {path}: {len(store)} records ({store.dtype} taps of layers "
        f"{store.manifest['tap_layers']}, top-{store.k}); the target's pass is skipped"
    )
    source = ts.StoreSource(store, exp.tap_layers)
    if config.loss.startswith("topk_"):
        return source
    return lambda batch: {"taps": source(batch)["taps"]}


def _restore(ckpt, exp, state, state_sh):
    """(state, log window) of the newest readable checkpoint (the same step on every process):
    the state restored into the state's shardings, the data stream's position set, and the
    metrics summed since the last log line (`_LogWindow.saved`; None when there is none or the
    checkpoint predates them); (`state` unchanged, None) when there is no checkpoint. An
    incompatible checkpoint raises and leaves every checkpoint as it is."""
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
    if restored is None:
        return state, None
    state, data_state, _ = restored
    log_window = data_state.pop(LOG_WINDOW_KEY, None)
    exp.train_iter.set_state(data_state)
    distributed.say(f"resumed from step {int(state.step)} ({ckpt.directory})")
    return state, log_window


def _log_expert_placement(exp, mesh, params) -> None:
    """Where a MoE target's stacked experts live (one line; nothing for a dense target)."""
    from dflash_jax.parallel import sharding

    experts = [
        x
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if exp.target_cfg.is_moe and sharding.path_str(path).endswith("experts/gate_proj/kernel")
    ]
    if not experts:
        return
    spec = tuple(experts[0].sharding.spec) + (None,) * 4
    layers = len(experts)
    if experts[0].ndim == 4:  # a scanned stack [L, E, I, H]: the layer axis is never split
        spec, layers = spec[1:], experts[0].shape[0]
    split = ", ".join(
        f"{dim} over {'x'.join((ax,) if isinstance(ax, str) else ax)}"
        if ax
        else f"{dim} replicated"
        for dim, ax in zip("EIH", spec)
    )
    distributed.say(
        f"MoE target: {exp.target_cfg.num_experts} experts (top "
        f"{exp.target_cfg.num_experts_per_tok}) in {layers} layers, "
        f"{exp.target_cfg.num_experts // mesh.shape.get('expert', 1)} per device; "
        f"gate_proj [{split}]"
    )
