"""Attention entry points of the models, switchable between plain XLA and Pallas kernels.

`attention_impl`:
  "xla"    - the einsum references below (default on CPU),
  "pallas" - the kernels of `pallas_kernels/` for the current backend (TPU or Triton GPU),
  "pallas_interpret" - the same kernels in interpret mode (for tests on CPU),
  "auto"   - "pallas" on TPU/GPU, "xla" elsewhere.

Two shapes of attention occur at decode time:
  verify: queries of a block, already written into the target cache, see slots j <= position.
  draft:  drafter block queries see the drafter context slots j < ctx_len and the whole block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.layers import masked_attention

IMPLS = ("xla", "pallas", "pallas_interpret", "auto")


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"attention_impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() in ("tpu", "gpu") else "xla"
    return impl


def _kernels():
    import pallas_kernels  # imported lazily: the library works without the kernels folder

    return pallas_kernels


def verify_attention(q_BTND, k_BSKD, v_BSKD, positions_BT, impl: str = "xla"):
    """Block queries against a cache that already holds them; query at p sees slots j <= p."""
    impl = resolve_impl(impl)
    if impl == "xla":
        s = k_BSKD.shape[1]
        mask = jnp.arange(s)[None, None, :] <= positions_BT[:, :, None]
        return masked_attention(q_BTND, k_BSKD, v_BSKD, mask)
    return _kernels().verify_attention(q_BTND, k_BSKD, v_BSKD, positions_BT, impl="pallas",
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
                                      impl="pallas", interpret=impl == "pallas_interpret")
