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
step is step.py, building the run experiment.py, the defaults configs/default.py.

In target mode, `unlikelihood.weight > 0` adds sequence-level unlikelihood on the model's own
greedy continuations, decoded each step (`dflash_jax.training.unlikelihood`): a fine-tune
against greedy loops.

Config keys: see configs/default.py; experiment files in `configs/` override them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflash_jax.drafters import registry
from dflash_jax.parallel import distributed
from dflash_jax.support import console, interrupts
from dflash_jax.training.checkpointing import Checkpointer
from dflash_jax.training.evaluation import evaluate, selector_figures
from dflash_jax.training.experiment import Experiment, build_experiment
from dflash_jax.training.experiment import log as _log
from dflash_jax.training.export import export
from dflash_jax.training.metrics import MetricsLogger, format_eta
from dflash_jax.training import tap_cache
from dflash_jax.training.step import (
    TrainState,
    check_grad_accum,
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


def _mesh_devices(mesh_spec: str):
    """The devices `config.mesh` is built over: all of them for an explicit mesh or several
    processes, this host's otherwise."""
    return jax.devices() if mesh_spec or distributed.is_multiprocess() else jax.local_devices()


def _target_hf_config(config):
    """config.json of a local target_path as a dict; None without one, or when it cannot be
    read without loading (a hub id, an unreadable file: reported when the target loads)."""
    if not config.target_path or not os.path.isdir(config.target_path):
        return None  # a fresh target, or a hub id: resolved (and checked) when it is loaded
    from dflash_jax.models import checkpoint

    try:
        hf = checkpoint.read_config(config.target_path)
    except Exception:  # noqa: BLE001 - reported with the file's name when the target loads
        return None
    return hf if isinstance(hf, dict) else None


def _target_num_layers(config):
    """The number of layers of the run's target: config.json of a local target_path, or the
    fresh target's config.target_model; None when it cannot be known without loading."""
    if not config.target_path:
        return int(config.target_model.num_layers)
    n = (_target_hf_config(config) or {}).get("num_hidden_layers")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _target_num_experts(config):
    """The experts of the run's target's MoE layers (0: dense; a fresh target is dense), from
    a local target_path's config.json; None when it cannot be known without loading."""
    if not config.target_path:
        return 0
    hf = _target_hf_config(config)
    if hf is None:
        return None
    from dflash_jax.models.config import ModelConfig

    try:
        return ModelConfig.from_hf(hf).num_experts
    except Exception:  # noqa: BLE001 - a bad field is reported when the target loads
        return None


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """The device mesh of a training run as `check_run` read and checked it: `config.mesh`
    against the devices, the batch (and its micro-batches) against the mesh's batch shards and,
    where the target's config.json was readable, the expert axis against its experts. `_setup`
    builds the mesh from it (`build`) and checks none of it again."""

    spec: str  # config.mesh as given ("": data parallelism over this host's devices)
    axes: Mapping[str, int]  # the spec parsed (`sharding.parse_mesh`): one size may be -1
    sizes: Mapping[str, int]  # the sizes resolved over `devices`: no -1
    devices: tuple  # the devices the mesh is built over (`_mesh_devices`, as many as it needs)
    n_batch: int  # data x fsdp: the shards of every batch and micro-batch
    # The experts of the target's MoE layers as read without loading it (0: dense; a fresh
    # target is dense), the expert axis checked against them; None: not known before the
    # target loads (a hub id, an unreadable config.json), then `_setup` checks the axis.
    num_experts: Optional[int]

    def build(self) -> Mesh:
        """The `jax.sharding.Mesh` (`sharding.make_mesh`; an `expert` axis where the spec
        names one)."""
        from dflash_jax.parallel import sharding

        return sharding.make_mesh(**self.axes, devices=list(self.devices))


@dataclasses.dataclass(frozen=True)
class Preflight:
    """What `check_run` found: the values the run's setup reuses rather than reading (and
    checking) them again."""

    accum: int  # grad_accum_steps, checked against the batch (and the mesh's batch shards)
    mesh: Optional[MeshPlan]  # None with regen.only (no training: no mesh)


def preflight(config, workdir: str) -> int:
    """Every check of a training run that needs no model and writes nothing (`check_run`).
    Returns grad_accum_steps; `check_run` returns all it found."""
    return check_run(config, workdir).accum


def check_run(config, workdir: str) -> Preflight:
    """Every check of a training run that needs no model and writes nothing: the config's
    values (`checks.check_train_config`), the workdir and regen.output, the data files,
    the mesh against the devices (and the batch against its shards; an `expert` axis against
    the target's experts, `sharding.check_expert_axis`, when its config.json is local), the
    drafter's tapped layers against the target's. A bad value is one line (a ValueError)
    before anything runs or is written (regeneration takes hours on an 8B target). Each check
    runs once: `train_and_evaluate` sets the run up from the result."""
    accum = _check_settings(config, workdir)
    if config.regen.get("only", False):
        return Preflight(accum=accum, mesh=None)  # no training: no mesh
    return Preflight(accum=accum, mesh=_check_mesh(config, accum))


def _check_settings(config, workdir: str) -> int:
    """The checks of `check_run` before the mesh's: the config's values, grad_accum_steps
    against the batch, the output locations, the data files, the tapped layers and the tap
    cache's settings. Returns grad_accum_steps."""
    from dflash_jax.support import checks
    from dflash_jax.support.checks import ConfigError

    checks.check_train_config(config)  # one-line ConfigError before anything runs
    accum = int(config.get("grad_accum_steps", 1))
    check_grad_accum(config.data.batch_size, accum)
    if accum > 1 and config.mode == "target" and config.unlikelihood.weight > 0:
        raise ValueError(
            f"grad_accum_steps {accum} > 1 with unlikelihood.weight "
            f"{config.unlikelihood.weight} > 0: the unlikelihood rows are not accumulated"
        )
    checks.writable_dir(workdir, "workdir")
    if config.export:  # written after training: refused now, not after hours of it
        checks.writable_dir(export_dir(config, workdir), "the export directory", files=EXPORT_FILES)
    if config.regen.output and not os.path.exists(config.regen.output):
        checks.writable_file(config.regen.output, "regen.output")
    if config.regen.get("only", False) and (
        config.mode != "drafter" or config.data.kind != "regenerated"
    ):
        raise ValueError(
            "regen.only needs mode='drafter' and data.kind='regenerated', got "
            f"mode={config.mode!r}, data.kind={config.data.kind!r}"
        )
    if config.data.kind == "files":
        for i, path in enumerate(config.data.paths):
            if not os.path.isfile(path):
                what = "is not a file" if os.path.exists(path) else "does not exist"
                raise ConfigError(
                    f"data.paths[{i}] {path}: the data file named by config.data.paths {what}"
                )
    _check_taps(config)
    tap_cache.check_tap_cache(config)
    return accum


def _check_mesh(config, accum: int) -> MeshPlan:
    """The mesh: its spec, that the devices hold it (before regeneration, not after), its
    expert axis against the target's experts (where they can be read now), the batch, its
    micro-batches and the unlikelihood batch against its batch shards."""
    from dflash_jax.parallel import sharding
    from dflash_jax.support.checks import ConfigError

    # "" is data parallelism over this host's devices: the same rules on a data-only mesh,
    # where every parameter is replicated.
    mesh_spec = config.get("mesh", "")
    try:
        axes = sharding.parse_mesh(mesh_spec or "data=-1")
    except ValueError as e:
        raise ConfigError(f"config.mesh: {e}") from None
    pool = _mesh_devices(mesh_spec)
    known = math.prod(v for v in axes.values() if v != -1)
    if (
        any(v == 0 or v < -1 for v in axes.values())
        or sum(v == -1 for v in axes.values()) > 1
        or (len(pool) % known if -1 in axes.values() else known > len(pool))
    ):
        raise ConfigError(
            f"config.mesh {mesh_spec!r} does not fit the {len(pool)} device(s) "
            f"[{pool[0].platform}] (e.g. --config.mesh=fsdp={len(pool)})"
        )
    sizes = {k: len(pool) // known if v == -1 else v for k, v in axes.items()}
    plan = MeshPlan(
        spec=mesh_spec,
        axes=axes,
        sizes=sizes,
        devices=tuple(pool[: math.prod(sizes.values())]),
        n_batch=sizes["data"] * sizes["fsdp"],
        num_experts=_target_num_experts(config),
    )
    if plan.num_experts is not None:
        _check_expert_axis(plan, plan.num_experts, ConfigError)
    if config.data.batch_size % plan.n_batch:
        raise ConfigError(
            f"data.batch_size {config.data.batch_size} is not divisible by the {plan.n_batch} "
            f"batch shards of config.mesh {mesh_spec or 'data=-1'!r}"
        )
    check_grad_accum(config.data.batch_size, accum, plan.n_batch)
    if (
        config.mode == "target"
        and config.unlikelihood.weight > 0
        and config.unlikelihood.batch_size % plan.n_batch
    ):
        raise ConfigError(
            f"unlikelihood.batch_size {config.unlikelihood.batch_size} is not divisible by "
            f"the {plan.n_batch} batch shards of the mesh"
        )
    return plan


def _check_expert_axis(plan: MeshPlan, num_experts: int, error: type[ValueError]) -> None:
    """The mesh's expert axis against the target's `num_experts`: in `_check_mesh` (a
    ConfigError) where they could be read before loading the target, else once it is loaded,
    in `_setup` (a ValueError: its regeneration ran)."""
    from dflash_jax.parallel import sharding

    try:
        sharding.check_expert_axis(plan.sizes.get("expert", 1), num_experts)
    except ValueError as e:
        raise error(f"config.mesh {plan.spec!r}: {e}") from None


def _check_taps(config) -> None:
    """The drafter's tapped layers against the target's (an IndexError deep in the loss,
    after regeneration, otherwise)."""
    from dflash_jax.support.checks import ConfigError

    ids = tuple(config.drafter.target_layer_ids)
    if config.mode == "drafter" and ids and not config.drafter.init_path:
        n_layers = _target_num_layers(config)
        if n_layers is not None and max(ids) >= n_layers:
            raise ConfigError(
                f"drafter.target_layer_ids {list(ids)} taps layer {max(ids)}, but the target "
                f"has {n_layers} layers (valid ids 0..{n_layers - 1})"
            )


# The files an export writes in its directory (a directory by one of these names blocks it).
EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def export_dir(config, workdir: str) -> str:
    """Where `train_and_evaluate` exports: WORKDIR/export/drafter (or /target)."""
    return os.path.join(workdir, "export", "drafter" if config.mode == "drafter" else "target")


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
        _log(f"regen.only: responses in {path}; no training")
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
            _log(f"checkpoint step {step} -> {run.ckpt.directory}")
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
        _log(f"exported to {export_path}")
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
            _log(f"eval step {step}: " + _eval_line(last_eval))
        if ckpt.maybe_save(step, state, window.data_state(exp.train_iter)):
            _log(f"checkpoint step {step} -> {ckpt.directory}")
        # A signal to any one process stops all of them after the same step.
        if distributed.any_process(flag.signum is not None):
            if pending is not None and not window.finish(*pending):
                break  # (a non-finite loss: stopped, nothing saved)
            pending = None
            status = "preempted"
            _log(f"signal {flag.signum or 'to another process'}: saving step {step} and stopping")
            break
    if pending is not None:  # the data ran out before the last step's read
        window.finish(*pending)
    if window.bad_step is not None:
        status, step = "nan", window.bad_step - 1
        _log(
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
    _log(
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
                _log(
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
    _log(
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
    _log(f"resumed from step {int(state.step)} ({ckpt.directory})")
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
    if experts[0].ndim == 4:  # a scanned stack [L, E, H, I]: the layer axis is never split
        spec, layers = spec[1:], experts[0].shape[0]
    split = ", ".join(
        f"{dim} over {'x'.join((ax,) if isinstance(ax, str) else ax)}"
        if ax
        else f"{dim} replicated"
        for dim, ax in zip("EHI", spec)
    )
    _log(
        f"MoE target: {exp.target_cfg.num_experts} experts (top "
        f"{exp.target_cfg.num_experts_per_tok}) in {layers} layers, "
        f"{exp.target_cfg.num_experts // mesh.shape.get('expert', 1)} per device; "
        f"gate_proj [{split}]"
    )


# The data item of a checkpoint holds the log window's sums under this key, beside the data
# iterator's position.
LOG_WINDOW_KEY = "log_window"


class _LogWindow:
    """The host's part of each step once its metrics are read (`finish`): the non-finite loss
    check, the loss history, and the metrics summed since the last log line, written (metrics
    file, console) every `log_every` steps and at the last step.

    The sums of a window that a checkpoint cuts (a preemption, a stage's stop_at_step) are
    saved with it (`data_state`) and restored (`run.log_window`), so a resumed run logs at the
    next multiple of `log_every` what the uninterrupted run logs there: the mean over the whole
    window. (A stage's last line, at its stop_at_step, reports the part it ran and keeps the
    sums.) Throughput counts only the steps this process timed."""

    def __init__(self, config, run: _Run, logger, bar):
        self.config, self.run, self.logger, self.bar = config, run, logger, bar
        self.history = []  # (step, loss) of this process
        self.bad_step = self.bad_loss = None  # the first step with a non-finite loss
        self.tokens_per_step = config.data.batch_size * config.data.seq_len
        self.t_start = self.t_window = time.time()
        self.step_start = int(run.state.step)
        self.steps, self.acc = 0, None  # the window's steps and summed metrics
        self.timed = 0  # the window's steps run by this process (the rate's)
        saved = getattr(run, "log_window", None)
        if saved:
            self.steps = int(saved["steps"])
            self.acc = {k: _from_json(v) for k, v in saved["sums"].items()}

    def saved(self):
        """The window's sums as JSON (None when empty): what a checkpoint keeps."""
        if not self.steps:
            return None
        return {"steps": self.steps, "sums": {k: _to_json(v) for k, v in self.acc.items()}}

    def data_state(self, train_iter):
        """A checkpoint's data item: the iterator's position and the window's sums (computed
        only when a checkpoint is saved: with several processes the position is a collective)."""

        def get():
            state = dict(train_iter.get_state())
            window = self.saved()
            if window is not None:
                state[LOG_WINDOW_KEY] = window
            return state

        return get

    def finish(self, k, metrics, rep_frac) -> bool:
        """Step k's metrics read; False when its loss is not finite (step k is dropped: the
        loop stops at step k - 1, the last good one)."""
        metrics = jax.device_get(metrics)
        if rep_frac is not None:
            metrics = dict(metrics, rep_frac=np.float32(rep_frac))
        loss = float(metrics["loss"]) + float(metrics.get("ul_loss", 0.0))
        if not math.isfinite(loss):
            self.bad_step, self.bad_loss = k, loss
            return False
        self.history.append((k, loss))
        self.bar.update(1)
        self.steps += 1
        self.timed += 1
        self.acc = (
            metrics if self.acc is None else jax.tree_util.tree_map(np.add, self.acc, metrics)
        )
        if k % self.config.log_every == 0 or k == self.run.total:
            self._write(k)
        elif k == self.run.stop_at:  # a stage's end: its line; the sums go on (checkpoint)
            self._write(k, reset=False)
        return True

    def _write(self, k, reset: bool = True) -> None:
        acc, n, run = self.acc, self.steps, self.run
        # The window is wall time from this write's start to the last one's: anything below
        # that waits is the next window's (reset at the end, a window of 5 steps read as 4
        # steps' time: rates 25% too high, as logged before 2026-12-04).
        now = time.time()
        dt = now - self.t_window
        rate = self.timed * self.tokens_per_step / max(dt, 1e-9)
        eta = (time.time() - self.t_start) / max(k - self.step_start, 1) * (run.total - k)
        rec = {
            "loss": acc["loss"] / n,
            "grad_norm": acc["grad_norm"] / n,
            "learning_rate": _host_value(run.schedule, k - 1),
            "tokens_per_s": rate,
        }
        if run.exp.mode == "drafter":
            per_k = acc["correct_k"] / np.maximum(acc["count_k"], 1)
            rec["acc_k01"] = float(per_k[1])
            rec["block_accept_len"] = float(acc["accept_sum"] / max(acc["num_blocks"], 1))
            rec.update(selector_figures(acc))
        ul_msg = ""
        if "rep_frac" in acc:
            rec.update({key: float(acc[key]) / n for key in ("ul_loss", "ul_p", "rep_frac")})
            ul_msg = (
                f"ul {rec['ul_loss']:.3f} p_rep {rec['ul_p']:.2f} "
                f"repeated {100 * rec['rep_frac']:.1f}% "
            )
        self.logger.write("train", k, rec)
        self.bar.set_postfix_str(f"loss {rec['loss']:.4f}", refresh=False)
        _log(
            f"step {k}/{run.total} loss {rec['loss']:.4f} {ul_msg}"
            f"lr {rec['learning_rate']:.2e} gnorm {rec['grad_norm']:.2f} "
            f"{rate:,.0f} tok/s ETA {format_eta(eta)}"
        )
        self.t_window, self.timed = now, 0
        if reset:
            self.steps, self.acc = 0, None


def _to_json(value):
    """A summed metric (a NumPy scalar or array) as JSON that `_from_json` gives back exactly."""
    a = np.asarray(value)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "values": a.ravel().tolist()}


def _from_json(obj):
    a = np.asarray(obj["values"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"])
    return a[()] if a.ndim == 0 else a


def _host_value(schedule, step: int) -> float:
    """An optax schedule (jnp arithmetic) at `step`, computed on the host's CPU device: on the
    default device it would queue behind the train step just dispatched and wait for it."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu
        return float(schedule(step))
    with jax.default_device(cpu):
        return float(schedule(step))


class _Profiler:
    """config.profile_dir: a trace of steps [profile_start_step, + profile_num_steps)."""

    def __init__(self, config):
        self.config, self.active = config, False

    def maybe_start(self, step) -> None:
        c = self.config
        if c.profile_dir and step == c.profile_start_step:
            jax.profiler.start_trace(c.profile_dir)
            self.active = True

    def maybe_stop(self, step, metrics) -> None:
        c = self.config
        if self.active and step + 1 >= c.profile_start_step + c.profile_num_steps:
            jax.block_until_ready(metrics)
            jax.profiler.stop_trace()
            self.active = False
            _log(f"profile of steps {c.profile_start_step}..{step} written to {c.profile_dir}")

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
