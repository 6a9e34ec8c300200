"""Attention entry points of the models, switchable between plain XLA and Pallas kernels.

`attention_impl`:
  "xla"    - the einsum references below (default on CPU),
  "pallas" - the kernels of `pallas_kernels/` for the current backend (TPU or Triton GPU),
  "pallas_interpret" - the same kernels in interpret mode (for tests on CPU),
  "auto"   - "pallas" on TPU/GPU, "xla" elsewhere.
  "pallas_tpu" / "pallas_triton" - one kernel family, whatever the default backend is: what
           `for_devices` turns "pallas"/"auto" into for the devices a program is compiled for,
           so the choice is part of the static configuration (and of the jit caches' keys).

The platform is that of the devices being compiled for (`pallas_kernels.backend.compiling_for`),
not the default backend: TPU kernels compile for abstract TPU devices on a CPU-only machine.

Two shapes of attention occur at decode time:
  verify: queries of a block, already written into the target cache, see slots j <= position.
  draft:  drafter block queries see the drafter context slots j < ctx_len and the whole block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.layers import masked_attention

IMPLS = ("xla", "pallas", "pallas_interpret", "auto", "pallas_tpu", "pallas_triton")


def _compile_platform() -> str:
    try:
        return _kernels().backend._platform()
    except ImportError:
        return jax.default_backend()


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"attention_impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if _compile_platform() in ("tpu", "gpu", "cuda", "rocm") else "xla"
    return impl


def for_devices(impl: str, devices=None) -> str:
    """`impl` made concrete for the devices a program is compiled for (a Mesh, a device list,
    a platform name; None: the default backend): "auto" / "pallas" become "xla",
    "pallas_tpu" or "pallas_triton" by `pallas_kernels.backend.resolve` on that platform."""
    if impl not in IMPLS:
        raise ValueError(f"attention_impl must be one of {IMPLS}, got {impl!r}")
    if impl not in ("auto", "pallas"):
        return impl
    backend = _kernels().backend
    platform = backend.platform_of(devices) if devices is not None else backend._platform()
    variant = backend.resolve(impl, platform=platform)
    return "xla" if variant == backend.XLA else "pallas_" + variant


def _kernels():
    import pallas_kernels  # imported lazily: the library works without the kernels folder

    return pallas_kernels


def _kernel_impl(impl: str) -> str:
    """The `pallas_kernels` impl for one of ours ("pallas_interpret" runs "pallas")."""
    return "pallas" if impl in ("pallas", "pallas_interpret") else impl


def verify_attention(q_BTND, k_BSKD, v_BSKD, positions_BT, impl: str = "xla"):
    """Block queries against a cache that already holds them; query at p sees slots j <= p."""
    impl = resolve_impl(impl)
    if impl == "xla":
        s = k_BSKD.shape[1]
        mask = jnp.arange(s)[None, None, :] <= positions_BT[:, :, None]
        return masked_attention(q_BTND, k_BSKD, v_BSKD, mask)
    return _kernels().verify_attention(q_BTND, k_BSKD, v_BSKD, positions_BT,
                                       impl=_kernel_impl(impl),
                                       interpret=impl == "pallas_interpret")


def draft_attention(q_BTND, ctx_k, ctx_v, ctx_len_B, blk_k, blk_v, impl: str = "xla"):
    """Drafter block queries against [context (j < ctx_len) ; block (all)], non-causal."""
    impl = resolve_impl(impl)
    if impl == "xla":
        b, t = q_BTND.shape[:2]
        c = ctx_k.shape[1]
        ctx_mask = jnp.arange(c)[None, None, :] < ctx_len_B[:, None, None]
        mask = jnp.concatenate(
            [jnp.broadcast_to(ctx_mask, (b, t, c)), jnp.ones((b, t, t), bool)], axis=-1)
        k = jnp.concatenate([ctx_k, blk_k.astype(ctx_k.dtype)], axis=1)
        v = jnp.concatenate([ctx_v, blk_v.astype(ctx_v.dtype)], axis=1)
        return masked_attention(q_BTND, k, v, mask)
    return _kernels().draft_attention(q_BTND, ctx_k, ctx_v, ctx_len_B, blk_k, blk_v,
                                      impl=_kernel_impl(impl),
                                      interpret=impl == "pallas_interpret")
