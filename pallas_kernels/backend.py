"""The ONE place that decides which attention implementation runs.

`resolve(impl)` maps the user-facing ``impl`` string plus the platform a
program is compiled for to one of the variant names below.  That platform is
the one of the devices being compiled for, not necessarily the default backend:
a program traced inside ``with compiling_for(mesh):`` (a Mesh, a sharding, a
device list such as an abstract TPU topology's, or a platform name) picks that
platform's kernels, so TPU kernels compile for TPU devices from a CPU-only
process (ahead-of-time, with libtpu installed; see dflash_jax/dry_run.py).
Outside such a block it is `jax.default_backend()`.  `interpret_arg(variant,
interpret)` turns the public ``interpret: bool`` into what ``pl.pallas_call``
expects for that variant.

Variants
--------
``"xla"``         plain-XLA reference (pallas_kernels/reference.py).
``"tpu"``         Pallas TPU (Mosaic TPU) kernels.
``"triton"``      Pallas GPU kernels on the Triton backend.
``"mosaic_gpu"``  Pallas Mosaic GPU kernels -- NOT IMPLEMENTED YET.  JAX
                  deprecates the Triton backend in favour of Mosaic GPU from
                  0.11; when the Triton lowering goes away, add the Mosaic GPU
                  kernels and switch `_default_gpu_variant` below.

Public ``impl`` values
----------------------
``"auto"``            Pallas on TPU/GPU, XLA reference on CPU (and anything else).
``"xla"``             reference.
``"pallas"``          the Pallas variant for the current backend.  On CPU this
                      requires ``interpret=True`` and picks the TPU variant
                      (TPU interpret mode is the more faithful simulator).
``"pallas_tpu"``      force the TPU variant (on CPU: needs interpret=True).
``"pallas_triton"``   force the Triton variant (on CPU: needs interpret=True).
``"pallas_mosaic_gpu"`` placeholder, raises NotImplementedError.

The environment variable ``DFLASH_PALLAS_GPU_BACKEND`` ("triton" or
"mosaic_gpu") overrides the GPU default without code changes.
"""
from __future__ import annotations

import contextlib
import contextvars
import os

import jax

XLA = "xla"
TPU = "tpu"
TRITON = "triton"
MOSAIC_GPU = "mosaic_gpu"

VARIANTS = (XLA, TPU, TRITON, MOSAIC_GPU)
IMPLS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_triton", "pallas_mosaic_gpu")

_MOSAIC_GPU_MSG = (
    "The Pallas Mosaic GPU variant of the DFlash attention kernels is not "
    "implemented yet. Use impl='pallas_triton' (Triton backend, deprecated in "
    "JAX >= 0.11 but still available) or impl='xla'. To add it, implement the "
    "kernels and register them in pallas_kernels/backend.py.")


# The platform of the devices the program being traced will be compiled for
# (None: the default backend). A context variable, so threads do not share it.
_COMPILE_PLATFORM = contextvars.ContextVar("dflash_compile_platform", default=None)


def platform_of(target) -> str:
  """Platform name ("cpu" | "tpu" | "cuda" | "rocm" | ...) of a Mesh, a
  Sharding, a device, a sequence of devices, or a platform name itself."""
  if isinstance(target, str):
    return target
  if isinstance(target, jax.sharding.Mesh):
    return target.devices.flat[0].platform
  if isinstance(target, jax.sharding.Sharding):
    return next(iter(target.device_set)).platform
  if hasattr(target, "platform"):
    return target.platform
  return next(iter(target)).platform


@contextlib.contextmanager
def compiling_for(target):
  """Within this block, kernels are chosen for `target`'s platform (see
  `platform_of`); None leaves the current choice unchanged."""
  if target is None:
    yield
    return
  token = _COMPILE_PLATFORM.set(platform_of(target))
  try:
    yield
  finally:
    _COMPILE_PLATFORM.reset(token)


def _platform() -> str:
  # "cpu" | "gpu" | "cuda" | "rocm" | "tpu"
  return _COMPILE_PLATFORM.get() or jax.default_backend()


def _is_gpu(platform: str) -> bool:
  return platform in ("gpu", "cuda", "rocm")


def _default_gpu_variant() -> str:
  choice = os.environ.get("DFLASH_PALLAS_GPU_BACKEND", TRITON).strip().lower()
  if choice not in (TRITON, MOSAIC_GPU):
    raise ValueError(
        f"DFLASH_PALLAS_GPU_BACKEND must be 'triton' or 'mosaic_gpu', got {choice!r}")
  return choice


def resolve(impl: str = "auto", interpret: bool = False,
            platform: str | None = None) -> str:
  """Returns the variant ("xla" | "tpu" | "triton" | "mosaic_gpu") to run."""
  platform = platform or _platform()
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if impl == "xla":
    return XLA
  if impl == "auto":
    if platform == "tpu":
      return TPU
    if _is_gpu(platform):
      return _check(_default_gpu_variant())
    return XLA
  if impl == "pallas":
    if platform == "tpu":
      return TPU
    if _is_gpu(platform):
      return _check(_default_gpu_variant())
    if interpret:
      return TPU
    raise ValueError(
        f"impl='pallas' has no compiled kernel on platform {platform!r}; pass "
        "interpret=True or use impl='xla'.")
  variant = {"pallas_tpu": TPU, "pallas_triton": TRITON,
             "pallas_mosaic_gpu": MOSAIC_GPU}[impl]
  variant = _check(variant)
  if not interpret:
    ok = (variant == TPU and platform == "tpu") or (
        variant == TRITON and _is_gpu(platform))
    if not ok:
      raise ValueError(
          f"impl={impl!r} cannot be compiled on platform {platform!r}; pass "
          "interpret=True to run it in Pallas interpret mode.")
  return variant


def _check(variant: str) -> str:
  if variant == MOSAIC_GPU:
    raise NotImplementedError(_MOSAIC_GPU_MSG)
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
