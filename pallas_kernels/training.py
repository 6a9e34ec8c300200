"""DFlash training attention: layout plumbing + custom_vjp around the kernels.

The differentiable layout transforms (transpose into per-kv-head row tiles,
padding) stay outside the custom_vjp, so JAX differentiates them; the
custom_vjp wraps only the kernel core on the tiled layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _common as C
from . import _training_common as TC
from . import backend as BK
from .reference import default_scale


@dataclasses.dataclass(frozen=True)
class _Cfg:
    lay: TC.Layout
    variant: str
    scale: float
    interpret: object


def _module(variant):
    if variant == BK.TPU:
        from . import tpu_training as m
    elif variant == BK.TRITON:
        from . import triton_training as m
    else:
        raise ValueError(variant)
    return m


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q_t, kc, vc, kb_t, vb_t, a_rows, s_rows):
    o_t, _ = _module(cfg.variant).forward(
        cfg.lay, q_t, kc, vc, kb_t, vb_t, a_rows, s_rows, scale=cfg.scale, interpret=cfg.interpret
    )
    return o_t


def _core_fwd(cfg, q_t, kc, vc, kb_t, vb_t, a_rows, s_rows):
    o_t, lse = _module(cfg.variant).forward(
        cfg.lay, q_t, kc, vc, kb_t, vb_t, a_rows, s_rows, scale=cfg.scale, interpret=cfg.interpret
    )
    return o_t, (q_t, kc, vc, kb_t, vb_t, a_rows, s_rows, o_t, lse)


def _core_bwd(cfg, res, do_t):
    dq, dkc, dvc, dkb, dvb = _module(cfg.variant).backward(
        cfg.lay, res, do_t, scale=cfg.scale, interpret=cfg.interpret
    )
    a_rows, s_rows = res[5], res[6]
    return (
        dq,
        dkc,
        dvc,
        dkb,
        dvb,
        np.zeros(a_rows.shape, jax.dtypes.float0),
        np.zeros(s_rows.shape, jax.dtypes.float0),
    )


_core.defvjp(_core_fwd, _core_bwd)

# Default tiles: TPU likes big tiles (rows x 512 context keys per step),
# Triton classic flash-attention sizes.
_DEFAULTS = {
    BK.TPU: dict(rows_target=256, block_k=512),
    BK.TRITON: dict(rows_target=128, block_k=64),
}


def training_attention(
    q,
    k_ctx,
    v_ctx,
    k_blk,
    v_blk,
    anchors,
    block_valid,
    *,
    block_size,
    ctx_start=None,
    sm_scale=None,
    variant=BK.TPU,
    interpret=False,
    rows_target=None,
    block_k=None,
):
    b, l, hq, d, hkv, g = C.check_gqa(q, k_ctx)
    n = anchors.shape[1]
    if l != n * block_size or k_blk.shape[1] != l:
        raise ValueError(
            f"q/k_blk length ({l}, {k_blk.shape[1]}) must equal N*block_size ({n}*{block_size})"
        )
    if k_ctx.shape[1] == 0:
        # No context at all: one dummy zero slot that no query can see.
        anchors = jnp.zeros_like(anchors)
        ctx_start = None
        k_ctx = C.pad_axis(k_ctx, 1, 1)
        v_ctx = C.pad_axis(v_ctx, 1, 1)
    dflt = _DEFAULTS[variant]
    pow2 = variant == BK.TRITON
    if pow2 and (d & (d - 1) or d < 16):
        # Triton needs power-of-two tiles >= 16: zero-pad the head dim.
        dp = max(16, C.next_pow2(d))
        scale = default_scale(d, sm_scale)
        pad = lambda x: C.pad_axis(x, 3, dp)
        o = training_attention(
            pad(q),
            pad(k_ctx),
            pad(v_ctx),
            pad(k_blk),
            pad(v_blk),
            anchors,
            block_valid,
            block_size=block_size,
            ctx_start=ctx_start,
            sm_scale=scale,
            variant=variant,
            interpret=interpret,
            rows_target=rows_target,
            block_k=block_k,
        )
        return o[..., :d]
    lay = TC.make_layout(
        q.shape,
        hkv,
        k_ctx.shape[1],
        n,
        block_size,
        rows_target=rows_target or dflt["rows_target"],
        block_k=block_k or dflt["block_k"],
        pow2=pow2,
        align=max(C.sublane_multiple(q.dtype), C.sublane_multiple(k_ctx.dtype)),
    )
    cfg = _Cfg(
        lay=lay,
        variant=variant,
        scale=default_scale(d, sm_scale),
        interpret=BK.interpret_arg(variant, interpret),
    )
    q_t = TC.q_to_tiles(q, lay)
    kb_t = TC.blk_to_tiles(k_blk.astype(k_ctx.dtype), lay)
    vb_t = TC.blk_to_tiles(v_blk.astype(v_ctx.dtype), lay)
    a_rows, s_rows = TC.row_limits(anchors, ctx_start, block_valid, lay)
    o_t = _core(cfg, q_t, k_ctx, v_ctx, kb_t, vb_t, a_rows, s_rows)
    return TC.tiles_to_q(o_t, lay)
