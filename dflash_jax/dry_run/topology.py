"""Devices to compile for: abstract TPU devices of a topology name (libtpu, compile-only),
an abstract NVIDIA GPU (the CUDA build of jax, compile-only, no GPU needed) or fake CPU
devices, meshes over them, and the one error type of bad user input."""

from __future__ import annotations

import importlib.util
import math
import os
import re
from typing import Any, Union

from dflash_jax.dry_run.chips import GPU_CHIPS, TPU_CHIPS, gpu_target_config


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


def cuda_plugin_missing() -> bool:
    """Whether the CUDA build of jax (its PJRT plugin: `pip install "jax[cuda12]"`) is absent."""
    return not any(
        importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")
    )


def _cudnn_version():
    """(major, minor, patch) of the cuDNN the CUDA plugin loads (what a GPU machine with this
    install runs); 9.8.0 when it cannot say."""
    try:
        from jax._src.lib import cuda_versions

        v = int(cuda_versions.cudnn_get_version())
        return v // 10000, (v // 100) % 100, v % 100
    except Exception:
        return 9, 8, 0


def _cudnn_checks_the_target() -> None:
    """Makes jax's cuDNN attention check its head dim against the GPU compiled for.

    jax asks the local GPU's compute capability (256-wide heads from Hopper on, else 128:
    `fused_attention_stablehlo.check_compute_capability`); a process without a GPU has none,
    so an abstract H200 would be refused the 256 a real one takes (Qwen3.5's gated-attention
    heads). Where this process has no GPU and a `compiling_for` block names GPU devices, the
    answer is that device kind's compute capability (`GPU_CHIPS`); elsewhere jax's own.
    Installed once, by `gpu_devices`."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fas
    except ImportError:
        return
    original = fas.check_compute_capability
    if getattr(original, "answers_for_the_target", False):
        return
    from pallas_kernels import backend

    def check_compute_capability(capability):
        kind = backend._COMPILE_DEVICE_KIND.get()
        chips = [c for c in GPU_CHIPS.values() if c["device_kind"] == kind]
        if not chips or backend._gpu_device_kind() is not None:
            return original(capability)
        want = tuple(int(x) for x in capability.split("."))
        return tuple(chips[0]["compute_capability"]) >= want

    check_compute_capability.answers_for_the_target = True
    fas.check_compute_capability = check_compute_capability


def gpu_devices(chip: str):
    """The abstract device of one NVIDIA GPU of `GPU_CHIPS` (compile-only: the CUDA plugin's
    topology from our target config, `chips.gpu_target_config`; no GPU needed). Needs the CUDA
    build of jax; on a machine without a GPU run with CUDA_VISIBLE_DEVICES=-1
    JAX_PLATFORMS=cpu so the default backend stays the CPU."""
    import jax

    if cuda_plugin_missing():
        raise UsageError(
            f"compiling for {chip} needs the CUDA build of jax: pip install "
            f'"jax[cuda12]=={jax.__version__}" (compile-only; no GPU needed; run with '
            "CUDA_VISIBLE_DEVICES=-1 JAX_PLATFORMS=cpu on a machine without one)"
        )
    from jax.experimental import topologies

    config = gpu_target_config(GPU_CHIPS[chip], _cudnn_version())
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1")
    except Exception as e:
        raise UsageError(
            f"topology {chip!r} rejected by the CUDA plugin: {str(e).splitlines()[0][:200]}"
        ) from None
    _cudnn_checks_the_target()
    return list(topo.devices)


def topology_devices(topology: str):
    """(devices, chip figures or None) of a topology name: "v5e:2x4", "v4:2x2x1", "v5p:4x4x4",
    "v6e:2x4", ... (abstract TPU devices, compile-only), "h200" / "h100" (one abstract NVIDIA
    GPU, compile-only: `gpu_devices`), or "cpu:N" (N fake CPU devices)."""
    import jax

    chip, _, shape = topology.partition(":")
    if chip in GPU_CHIPS:
        if shape not in ("", "1", "1x1x1"):
            raise UsageError(
                f"topology {topology!r}: one GPU only ({chip} or {chip}:1x1x1; multi-GPU "
                "NVLink topologies are not modelled)"
            )
        return gpu_devices(chip), dict(GPU_CHIPS[chip], chip=chip)
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
            f"v5p:4x4x4), a GPU ({', '.join(sorted(GPU_CHIPS))}), or cpu:8"
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

    from dflash_jax.parallel import sharding

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
