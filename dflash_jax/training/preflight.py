"""The trainer's checks before any compute (`check_run`: the settings, the mesh plan, the
taps and the expert axis), one line each, and what they resolve (`Preflight`), which the
trainer's setup reuses."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping, Optional

import jax
from jax.sharding import Mesh

from dflash_jax.parallel import distributed
from dflash_jax.training import tap_cache
from dflash_jax.training.step import (
    check_grad_accum,
)


EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def export_dir(config, workdir: str) -> str:
    """Where `train_and_evaluate` exports: WORKDIR/export/drafter (or /target)."""
    return os.path.join(workdir, "export", "drafter" if config.mode == "drafter" else "target")


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
    values (`config_checks.check_train_config`), the workdir and regen.output, the data files,
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
    from dflash_jax.training import config_checks

    config_checks.check_train_config(config)  # one-line ConfigError before anything runs
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
