"""Devices to compile for: abstract TPU devices of a topology name (libtpu, compile-only) or
fake CPU devices, meshes over them, and the one error type of bad user input."""

from __future__ import annotations

import importlib.util
import math
import os
import re
from typing import Any, Union

from dflash_jax.dry_run.chips import TPU_CHIPS


class UsageError(ValueError):
    """Bad user input: the CLI prints the one line and exits with code 2."""


def ensure_cpu_devices(n: int = 8) -> None:
    """Asks for `n` fake CPU devices. Effective only before JAX initializes its backends."""
    import jax

    try:
        if jax.config.jax_num_cpu_devices in (-1, None) or jax.config.jax_num_cpu_devices < n:
            jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # backends already up: the caller must have set XLA_FLAGS
        pass


def cpu_device_count(topology: str):
    """N of a "cpu:N" topology ("cpu": 8); None for any other (a TPU) topology. A bad N is
    a UsageError."""
    chip, sep, shape = topology.partition(":")
    if chip != "cpu":
        return None
    if not sep and not shape:
        return 8
    if not re.fullmatch(r"\d+", shape.strip()) or int(shape) < 1:
        raise UsageError(
            f"topology {topology!r}: cpu:N wants a number of CPU devices N >= 1, e.g. cpu:8"
        )
    return int(shape)


def is_cpu(topology: str) -> bool:
    return topology.partition(":")[0] == "cpu"


def libtpu_missing() -> bool:
    return importlib.util.find_spec("libtpu") is None


def topology_devices(topology: str):
    """(devices, chip figures or None) of a topology name: "v5e:2x4", "v4:2x2x1", "v5p:4x4x4",
    "v6e:2x4", ... (abstract TPU devices, compile-only), or "cpu:N" (N fake CPU devices)."""
    import jax

    chip, _, shape = topology.partition(":")
    if chip == "cpu":
        n = cpu_device_count(topology)
        devices = jax.devices("cpu")
        if len(devices) < n:
            raise UsageError(
                f"topology {topology!r} needs {n} CPU devices but JAX has "
                f"{len(devices)}: start Python with XLA_FLAGS="
                f"--xla_force_host_platform_device_count={n}"
            )
        return devices[:n], None
    if chip not in TPU_CHIPS or not re.fullmatch(r"\d+(x\d+){1,2}", shape):
        raise UsageError(
            f"unknown topology {topology!r}: use <chip>:<shape> with chip one of "
            f"{sorted(TPU_CHIPS)} (e.g. v5e:2x4, v6e:2x4, v4:2x2x1, v5p:2x2x1, "
            "v5p:4x4x4), or cpu:8"
        )
    if libtpu_missing():
        import jax as _jax

        raise UsageError(
            f"compiling for {topology} needs libtpu: pip install "
            f'"jax[tpu]=={_jax.__version__}" (compile-only; no TPU needed)'
        )
    # Compile-only clients in several processes at once (parallel tests, other users): libtpu's
    # lockfile is for processes that own a real TPU.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    dims = [int(d) for d in shape.split("x")] + [1]
    spec = TPU_CHIPS[chip]
    host = tuple(min(h, d) for h, d in zip(spec["host"], dims[:3]))
    try:
        topo = topologies.get_topology_desc(
            platform="tpu",
            topology_name=topology,
            chips_per_host_bounds=host,
            **spec["topology_kw"],
        )
    except Exception as e:  # e.g. a shape the chip does not come in
        raise UsageError(
            f"topology {topology!r} rejected by libtpu: {str(e).splitlines()[0][:200]}"
        ) from None
    return list(topo.devices), dict(spec, chip=chip)


def resolve_mesh(mesh: Union[str, dict, Any], devices=None):
    """A Mesh from "tensor=8" / {"tensor": 8} / a Mesh over `devices` (default: the first
    devices of `jax.devices()` it needs). A mesh the devices cannot hold is a UsageError."""
    import jax

    from dflash_jax import sharding

    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    try:
        spec = sharding.parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh)
    except ValueError as e:
        raise UsageError(str(e)) from None
    n = math.prod(v for v in spec.values() if v != -1)
    if devices is None:
        devices = jax.devices()
        if len(devices) < n:
            raise UsageError(
                f"mesh {mesh!r} needs {n} devices but JAX sees {len(devices)}. For a dry run "
                "on CPU start Python with XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                "(or call dflash_jax.dry_run.ensure_cpu_devices(8) before any other JAX call)."
            )
        if -1 not in spec.values():
            devices = devices[:n]
    try:
        return sharding.make_mesh(**spec, devices=devices)
    except ValueError as e:
        raise UsageError(
            f"mesh {mesh!r} does not match the {len(devices)} devices of the "
            f"topology ({e}); e.g. --mesh=tensor={len(devices)}"
        ) from None


def platform_name(mesh) -> str:
    d = mesh.devices.flat[0]
    return f"{d.platform}:{mesh.size}"
