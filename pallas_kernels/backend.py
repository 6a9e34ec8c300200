"""The ONE place that decides which attention implementation runs.

`resolve(impl)` maps the user-facing ``impl`` string plus the platform a
program is compiled for to one of the variant names below.  That platform is
the one of the devices being compiled for, not necessarily the default backend:
a program traced inside ``with compiling_for(mesh):`` (a Mesh, a sharding, a
device list such as an abstract TPU topology's, or a platform name) picks that
platform's kernels, so TPU kernels compile for TPU devices from a CPU-only
process (ahead-of-time, with libtpu installed; see dflash_jax/dry_run/).
Outside such a block it is `jax.default_backend()`.  On a GPU the device kind of
the devices compiled for picks the variant too (an abstract H200's gets what a
real H200 gets); outside a block naming devices, the local GPU's.  `interpret_arg(variant,
interpret)` turns the public ``interpret: bool`` into what ``pl.pallas_call``
expects for that variant.

Variants
--------
``"xla"``         plain-XLA reference (pallas_kernels/reference.py).
``"tpu"``         Pallas TPU (Mosaic TPU) kernels.
``"triton"``      Pallas GPU kernels on the Triton backend.
``"cudnn"``       GPU verify/draft through cuDNN's fused attention
                  (`jax.nn.dot_product_attention(implementation="cudnn")`,
                  cudnn_attention.py); training attention runs the XLA
                  reference under this variant.
``"mosaic_gpu"``  Pallas Mosaic GPU kernels -- NOT IMPLEMENTED YET.

GPU default (`_default_gpu_variant`): JAX deprecates the Pallas Triton
backend from 0.11 in favour of Mosaic GPU, which targets Hopper (sm_90) and
later.  So: Triton on jax < 0.11; on jax >= 0.11 cuDNN for Hopper/Blackwell
device kinds (the path JAX maintains for them until Mosaic GPU kernels
exist here) and Triton for older GPUs while jax still ships it; cuDNN
wherever `jax.experimental.pallas.triton` is gone.

Public ``impl`` values
----------------------
``"auto"``            Pallas on TPU/GPU, XLA reference on CPU (and anything else).
``"xla"``             reference.
``"pallas"``          the Pallas variant for the current backend.  On CPU this
                      requires ``interpret=True`` and picks the TPU variant
                      (TPU interpret mode is the more faithful simulator).
``"pallas_tpu"``      force the TPU variant (on CPU: needs interpret=True).
``"pallas_triton"``   force the Triton variant (on CPU: needs interpret=True).
``"cudnn"``           force the cuDNN variant (GPU only; no interpret mode).
``"pallas_mosaic_gpu"`` placeholder, raises NotImplementedError.

The environment variable ``DFLASH_PALLAS_GPU_BACKEND`` ("triton", "cudnn" or
"mosaic_gpu") overrides the GPU default without code changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re

import jax

XLA = "xla"
TPU = "tpu"
TRITON = "triton"
MOSAIC_GPU = "mosaic_gpu"
CUDNN = "cudnn"

VARIANTS = (XLA, TPU, TRITON, MOSAIC_GPU, CUDNN)
IMPLS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_triton", "pallas_mosaic_gpu", "cudnn")

_MOSAIC_GPU_MSG = (
    "The Pallas Mosaic GPU variant of the DFlash attention kernels is not "
    "implemented yet. Use impl='pallas_triton' (Triton backend, deprecated in "
    "JAX >= 0.11 but still available), impl='cudnn' or impl='xla'. To add it, "
    "implement the kernels and register them in pallas_kernels/backend.py."
)


# The platform and device kind of the devices the program being traced will be
# compiled for (None: the default backend's, the local GPU's). Context variables, so
# threads do not share them.
_COMPILE_PLATFORM = contextvars.ContextVar("dflash_compile_platform", default=None)
_COMPILE_DEVICE_KIND = contextvars.ContextVar("dflash_compile_device_kind", default=None)


def platform_of(target) -> str:
    """Platform name ("cpu" | "tpu" | "cuda" | "rocm" | ...) of a Mesh, a
    Sharding, a device, a sequence of devices, or a platform name itself."""
    if isinstance(target, str):
        return target
    return _first_device(target).platform


def _first_device(target):
    if isinstance(target, jax.sharding.Mesh):
        return target.devices.flat[0]
    if isinstance(target, jax.sharding.Sharding):
        return next(iter(target.device_set))
    if hasattr(target, "platform"):
        return target
    return next(iter(target))


def device_kind_of(target) -> str | None:
    """device_kind ("NVIDIA H200", "TPU v5 lite", ...) of the devices of a Mesh, a Sharding,
    a device or a sequence of devices (an abstract topology's included); None for a platform
    name or a device without one."""
    if target is None or isinstance(target, str):
        return None
    return getattr(_first_device(target), "device_kind", None)


@contextlib.contextmanager
def compiling_for(target):
    """Within this block, kernels are chosen for `target`'s platform and device kind (see
    `platform_of`, `device_kind_of`: a GPU's kind picks the GPU variant); None leaves the
    current choice unchanged."""
    if target is None:
        yield
        return
    token = _COMPILE_PLATFORM.set(platform_of(target))
    kind_token = _COMPILE_DEVICE_KIND.set(device_kind_of(target))
    try:
        yield
    finally:
        _COMPILE_DEVICE_KIND.reset(kind_token)
        _COMPILE_PLATFORM.reset(token)


def _platform() -> str:
    # "cpu" | "gpu" | "cuda" | "rocm" | "tpu"
    return _COMPILE_PLATFORM.get() or jax.default_backend()


def _is_gpu(platform: str) -> bool:
    return platform in ("gpu", "cuda", "rocm")


def jax_version() -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:3])


def triton_deprecated() -> bool:
    """JAX deprecates the Pallas Triton backend (for Mosaic GPU) from 0.11 on."""
    return jax_version() >= (0, 11)


@functools.cache
def triton_available() -> bool:
    """Whether this jax still ships the Pallas Triton backend."""
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Hopper (sm_90) and Blackwell (sm_100+) data-centre parts, by device_kind.
_SM90_PLUS = re.compile(r"\b(GH200|H100|H200|H800|H20|B100|B200|GB200|B300|GB300)\b")


def is_sm90_or_later(device_kind: str | None) -> bool:
    return bool(device_kind and _SM90_PLUS.search(device_kind))


def _gpu_device_kind() -> str | None:
    """device_kind of the first local GPU, None when this process has none."""
    try:
        return jax.local_devices(backend="gpu")[0].device_kind
    except (RuntimeError, ValueError):  # no GPU backend in this process
        return None


def _compile_device_kind() -> str | None:
    """device_kind of the GPU the program is compiled for: that of the devices of the
    enclosing `compiling_for` block if it names devices, else the first local GPU's."""
    return _COMPILE_DEVICE_KIND.get() or _gpu_device_kind()


def _default_gpu_variant(device_kind: str | None = None) -> str:
    """GPU variant for impl="auto"/"pallas" (policy: module docstring) on a GPU of
    `device_kind` (None: the one compiled for, `_compile_device_kind`)."""
    choice = os.environ.get("DFLASH_PALLAS_GPU_BACKEND", "").strip().lower()
    if choice:
        if choice not in (TRITON, MOSAIC_GPU, CUDNN):
            raise ValueError(
                "DFLASH_PALLAS_GPU_BACKEND must be 'triton', 'cudnn' or "
                f"'mosaic_gpu', got {choice!r}"
            )
        return choice
    if not triton_available():
        return CUDNN
    if triton_deprecated() and is_sm90_or_later(device_kind or _compile_device_kind()):
        return CUDNN
    return TRITON


def resolve(
    impl: str = "auto",
    interpret: bool = False,
    platform: str | None = None,
    device_kind: str | None = None,
) -> str:
    """Returns the variant ("xla" | "tpu" | "triton" | "cudnn") to run on `platform` (None:
    the one compiled for) and, on a GPU, on `device_kind` (None: the one compiled for)."""
    platform = platform or _platform()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        return XLA
    if impl == "auto":
        if platform == "tpu":
            return TPU
        if _is_gpu(platform):
            return _check(_default_gpu_variant(device_kind))
        return XLA
    if impl == "pallas":
        if platform == "tpu":
            return TPU
        if _is_gpu(platform):
            return _check(_default_gpu_variant(device_kind))
        if interpret:
            return TPU
        raise ValueError(
            f"impl='pallas' has no compiled kernel on platform {platform!r}; pass "
            "interpret=True or use impl='xla'."
        )
    variant = {
        "pallas_tpu": TPU,
        "pallas_triton": TRITON,
        "pallas_mosaic_gpu": MOSAIC_GPU,
        "cudnn": CUDNN,
    }[impl]
    variant = _check(variant)
    if variant == CUDNN and (interpret or not _is_gpu(platform)):
        raise ValueError(
            f"impl='cudnn' runs on a GPU only (platform {platform!r}, interpret="
            f"{interpret}); use impl='xla' or a Pallas variant with interpret=True."
        )
    if not interpret:
        ok = (variant == TPU and platform == "tpu") or (
            variant in (TRITON, CUDNN) and _is_gpu(platform)
        )
        if not ok:
            raise ValueError(
                f"impl={impl!r} cannot be compiled on platform {platform!r}; pass "
                "interpret=True to run it in Pallas interpret mode."
            )
    return variant


def _check(variant: str) -> str:
    if variant == MOSAIC_GPU:
        raise NotImplementedError(_MOSAIC_GPU_MSG)
    if variant == TRITON and not triton_available():
        raise ValueError(
            f"jax {jax.__version__} no longer ships the Pallas Triton backend; use "
            "impl='cudnn' (GPU), 'auto' or 'xla'."
        )
    return variant


def interpret_arg(variant: str, interpret: bool):
    """Value for ``pl.pallas_call(..., interpret=...)``."""
    if not interpret:
        return False
    if variant == TPU:
        # TPU interpret mode: simulates VMEM/SMEM, DMAs, scalar prefetch and
        # checks out-of-bounds accesses.
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.InterpretParams()
    return True  # Triton-style kernels: generic HLO interpreter.
