"""Pallas kernels for DFlash attention (verify / draft / training) + XLA references.

Public entry points (all tensors [batch, length, heads, head_dim], GQA with
Hq = G * Hkv; softmax in float32; output in q.dtype):

  verify_attention(q, k_cache, v_cache, q_positions, *, sm_scale=None,
                   impl="auto", interpret=False, block_k=None, num_splits=None)
  draft_attention(q, ctx_k, ctx_v, ctx_len, blk_k, blk_v, *, sm_scale=None,
                  impl="auto", interpret=False, block_k=None, num_splits=None)
  draft_attention_lse(q, ctx_k, ctx_v, ctx_len, blk_k, blk_v, blk_seen, *, sm_scale=None,
                      impl="auto", interpret=False) -> (out, lse), float32: one share
                      of a sequence-split context, to be merged
  tree_attention(q, k_cache, v_cache, prefix_len, blk_k, blk_v, blk_mask, *, sm_scale=None,
                 impl="auto", interpret=False, block_k=None, num_splits=None)
  training_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_valid, *,
                     block_size, ctx_start=None, sm_scale=None, impl="auto",
                     interpret=False, block_q_rows=None, block_k=None)

impl: "auto" (Pallas on TPU/GPU, XLA on CPU) | "xla" | "pallas" |
"pallas_tpu" | "pallas_triton" | "cudnn" (GPU: cuDNN fused attention for
verify/draft, XLA reference for training) | "pallas_mosaic_gpu" (not implemented yet);
see pallas_kernels/backend.py, the single place where the choice is made.
interpret=True runs the chosen Pallas variant in interpret mode (TPU kernels
via pltpu.InterpretParams(), Triton kernels via the HLO interpreter).

  kv_update(cache, new, starts, layer=None, *, interpret=False)   (TPU only: kv_update.py)
    cache [B,S,K,D] with rows starts[b]..starts[b]+T-1 set to new [B,T,K,D]
    (out-of-range slots dropped), DMA'd into the cache where it lies in HBM.

verify/draft are inference kernels (forward only); training_attention has a
custom_vjp whose gradients match jax.grad of the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import backend
from . import reference

from .kv_update import kv_update

__all__ = [
    "verify_attention",
    "draft_attention",
    "draft_attention_lse",
    "verify_attention_lse",
    "tree_attention",
    "training_attention",
    "kv_update",
    "reference",
    "backend",
]


def _decode_module(variant):
    if variant == backend.TPU:
        from . import tpu_decode as m
    else:
        from . import triton_decode as m
    return m


# The inference operations as a table. Each: its XLA reference (`reference.<name>`), its cuDNN
# function of the same name when `cudnn` (else the reference on every GPU variant), and how
# its arguments become the one decode kernel's (`_kernel_args`: queries, keys, values, the last
# visible slot per query row, and the block's own K/V / mask); `chunked`: long query blocks run
# in chunks on Triton (see TRITON_MAX_ROWS).
_OPS = {
    "verify_attention": dict(cudnn=True, gpu_kernel=True, chunked=True),
    "draft_attention": dict(cudnn=True, gpu_kernel=True, chunked=False),
    "tree_attention": dict(cudnn=False, gpu_kernel=False, chunked=False),
}


def _kernel_args(op, args, stacked=False):
    """(q, k, v, last visible slot [B,T], extra kernel kwargs) for `op`'s arguments (`stacked`:
    k and v are stacks [L,B,S,Hkv,D] of a scanned layer stack)."""
    if op == "verify_attention":
        q, k, v, q_positions = args
        return q, k, v, q_positions.astype(jnp.int32), {}
    if op == "draft_attention":
        q, k, v, ctx_len, blk_k, blk_v = args
        blk = dict(blk_k=blk_k, blk_v=blk_v)
        if k.shape[1] == 0:  # no context: one dummy slot that nobody sees
            pad = [(0, 0), (0, 1), (0, 0), (0, 0)]
            k, v = jnp.pad(k, pad), jnp.pad(v, pad)
            ctx_len = jnp.zeros_like(ctx_len)
    else:  # tree_attention
        q, k, v, ctx_len, blk_k, blk_v, blk_mask = args
        blk = dict(blk_k=blk_k, blk_v=blk_v, blk_mask=blk_mask)
    ctx_len = jnp.clip(ctx_len.astype(jnp.int32), 0, k.shape[2 if stacked else 1])
    lim = jnp.broadcast_to((ctx_len - 1)[:, None], q.shape[:2])
    return q, k, v, lim, blk


@functools.partial(
    jax.jit, static_argnames=("op", "sm_scale", "variant", "interpret", "block_k", "num_splits")
)
def _attend(*args, layer, op, sm_scale, variant, interpret, block_k, num_splits):
    """`op` (a key of _OPS) on `variant`: the reference, cuDNN, or the TPU / Triton kernel.
    `layer`: the caches (args 1, 2) are stacks and this layer is read (sliced out but on TPU)."""
    spec = _OPS[op]
    if layer is not None and variant != backend.TPU:
        args = (args[0], args[1][layer], args[2][layer], *args[3:])
        layer = None
    if variant == backend.XLA or (variant != backend.TPU and not spec["gpu_kernel"]):
        return getattr(reference, op)(*args, sm_scale=sm_scale)
    if variant == backend.CUDNN:
        from . import cudnn_attention

        return getattr(cudnn_attention, op)(*args, sm_scale=sm_scale)
    q, k, v, lim, blk = _kernel_args(op, args, stacked=layer is not None)
    kw = dict(interpret=backend.interpret_arg(variant, interpret), num_splits=num_splits)
    if layer is not None:
        kw["layer"] = layer
    if block_k is not None:
        kw["block_k"] = block_k

    def decode(q_, lim_):
        return _decode_module(variant).decode_attention(
            q_, k, v, lim_, sm_scale=sm_scale, **blk, **kw
        )

    per_chunk = max(1, TRITON_MAX_ROWS // (q.shape[2] // k.shape[-2]))
    if spec["chunked"] and variant == backend.TRITON and q.shape[1] > per_chunk:
        return _by_query_chunks(decode, q, lim, per_chunk)
    return decode(q, lim)


# The Triton decode kernel holds all T x G query rows of a KV head in one program; past 128 rows
# (a 512-token prefill chunk's verify: 1024 rows at G = 2, 2048 at Qwen3-8B's G = 4) its tiles
# ask for more shared memory than a Hopper block has (320 KB / 576 KB against 227 KB: compiled
# for an abstract H200, RESOURCE_EXHAUSTED). So longer query blocks run in chunks of
# TRITON_MAX_ROWS // G positions, one after another.
TRITON_MAX_ROWS = 128


def _by_query_chunks(fn, q, pos, c):
    """fn(q, pos) over the query axis in chunks of c positions (padded with position -1: rows
    that see nothing), concatenated: the same result as fn on the whole block."""
    b, t = q.shape[:2]
    n = -(-t // c)
    pad = n * c - t
    qs = jnp.pad(q, [(0, 0), (0, pad), (0, 0), (0, 0)]).reshape(b, n, c, *q.shape[2:])
    ps = jnp.pad(pos, [(0, 0), (0, pad)], constant_values=-1).reshape(b, n, c)
    out = jax.lax.map(lambda a: fn(*a), (jnp.swapaxes(qs, 0, 1), jnp.swapaxes(ps, 0, 1)))
    return jnp.swapaxes(out, 0, 1).reshape(b, n * c, *q.shape[2:])[:, :t]


def _run(op, args, sm_scale, impl, interpret, block_k, num_splits, layer=None):
    return _attend(
        *args,
        layer=layer,
        op=op,
        sm_scale=sm_scale,
        variant=backend.resolve(impl, interpret),
        interpret=bool(interpret),
        block_k=block_k,
        num_splits=num_splits,
    )


def verify_attention(
    q,
    k_cache,
    v_cache,
    q_positions,
    *,
    sm_scale=None,
    impl: str = "auto",
    interpret: bool = False,
    block_k: int | None = None,
    num_splits: int | None = None,
    layer=None,
):
    """Target-model verification attention over a KV cache.

    q: [B,T,Hq,D]; k_cache, v_cache: [B,S,Hkv,D] (the block's own K/V already
    written at their positions); q_positions: [B,T] int32.  Query (b,t) sees
    cache slot j iff j <= q_positions[b,t].  Returns [B,T,Hq,D].
    With `layer` (an int scalar) the caches are stacks [L,B,S,Hkv,D] of a scanned layer stack
    and layer `layer` is read: where it lies by the TPU kernel, sliced out on the others.
    """
    args = (q, k_cache, v_cache, q_positions)
    return _run("verify_attention", args, sm_scale, impl, interpret, block_k, num_splits, layer)


def draft_attention(
    q,
    ctx_k,
    ctx_v,
    ctx_len,
    blk_k,
    blk_v,
    *,
    sm_scale=None,
    impl: str = "auto",
    interpret: bool = False,
    block_k: int | None = None,
    num_splits: int | None = None,
):
    """Drafter attention over [context ; block].

    q: [B,T,Hq,D]; ctx_k, ctx_v: [B,C,Hkv,D]; ctx_len: [B] int32;
    blk_k, blk_v: [B,T,Hkv,D].  Query sees context slot j iff j < ctx_len[b]
    and all T block slots (non-causal).  Returns [B,T,Hq,D].
    """
    args = (q, ctx_k, ctx_v, ctx_len, blk_k, blk_v)
    return _run("draft_attention", args, sm_scale, impl, interpret, block_k, num_splits)


def draft_attention_lse(
    q, ctx_k, ctx_v, ctx_len, blk_k, blk_v, blk_seen, *, sm_scale=None, impl="auto",
    interpret=False,
):  # fmt: skip
    """One share of `draft_attention` to be merged with others (a context cache split by
    sequence over chips, each attending over its slots): the block's keys seen only by rows b
    where blk_seen[b] ([B] bool: the one share that holds the block). Returns (out
    [B,T,Hq,D], log-sum-exp [B,T,Hq]), both float32; a row that sees no key gets out 0 and
    lse `_common.NEG`. The TPU decode kernel (the block under a per-row mask, `return_lse`) on
    the TPU variant; the XLA reference elsewhere. interpret: True runs the TPU kernel in
    Pallas' generic interpreter (it runs inside a multi-device shard_map)."""
    variant = backend.resolve(impl, interpret)
    if variant != backend.TPU:
        return reference.draft_attention_lse(
            q, ctx_k, ctx_v, ctx_len, blk_k, blk_v, blk_seen, sm_scale=sm_scale
        )
    from . import tpu_decode

    b, t = q.shape[:2]
    _, k, v, lim, blk = _kernel_args("draft_attention", (q, ctx_k, ctx_v, ctx_len, blk_k, blk_v))
    mask = jnp.broadcast_to(blk_seen.astype(bool)[:, None, None], (b, t, blk_k.shape[1]))
    return tpu_decode.decode_attention(
        q, k, v, lim, **blk, blk_mask=mask, sm_scale=sm_scale, interpret=bool(interpret),
        return_lse=True,
    )  # fmt: skip


def verify_attention_lse(q, k_cache, v_cache, q_positions, *, sm_scale=None, impl="auto",
                         interpret=False):  # fmt: skip
    """One share of `verify_attention` to be merged with others (a target cache split by
    sequence over chips, each attending over its slots with the query positions shifted by its
    first slot: a negative one sees nothing there). Returns (out [B,T,Hq,D], log-sum-exp
    [B,T,Hq]), float32; a row that sees no key gets out 0 and lse `_common.NEG`. The TPU decode
    kernel (`return_lse`) on the TPU variant; the XLA reference elsewhere. interpret: as
    `draft_attention_lse`'s."""
    variant = backend.resolve(impl, interpret)
    if variant != backend.TPU:
        return reference.verify_attention_lse(q, k_cache, v_cache, q_positions, sm_scale=sm_scale)
    from . import tpu_decode

    return tpu_decode.decode_attention(
        q, k_cache, v_cache, q_positions.astype(jnp.int32), sm_scale=sm_scale,
        interpret=bool(interpret), return_lse=True,
    )  # fmt: skip


def tree_attention(
    q,
    k_cache,
    v_cache,
    prefix_len,
    blk_k,
    blk_v,
    blk_mask,
    *,
    sm_scale=None,
    impl: str = "auto",
    interpret: bool = False,
    block_k: int | None = None,
    num_splits: int | None = None,
    layer=None,
):
    """A draft tree's verify attention: the committed prefix of a KV cache and the tree's own
    keys under its ancestor mask.

    q: [B,T,Hq,D] (the T tree nodes); k_cache, v_cache: [B,S,Hkv,D]; prefix_len: [B] int32;
    blk_k, blk_v: [B,T,Hkv,D] (the nodes' K/V); blk_mask: [B,T,T] bool. Query t sees cache
    slot j iff j < prefix_len[b] and node u iff blk_mask[b, t, u]. The TPU kernel is the
    decode kernel with the mask laid out per query row, keys on the lane axis; the GPU
    variants (Triton, cuDNN) have no tree kernel yet and run the XLA reference.
    Returns [B,T,Hq,D]. `layer`: as `verify_attention`'s.
    """
    args = (q, k_cache, v_cache, prefix_len, blk_k, blk_v, blk_mask)
    return _run("tree_attention", args, sm_scale, impl, interpret, block_k, num_splits, layer)


def training_attention(
    q,
    k_ctx,
    v_ctx,
    k_blk,
    v_blk,
    anchors,
    block_valid,
    *,
    block_size: int,
    ctx_start=None,
    sm_scale=None,
    impl: str = "auto",
    interpret: bool = False,
    block_q_rows: int | None = None,
    block_k: int | None = None,
):
    """DFlash training attention (differentiable w.r.t. q, k_ctx, v_ctx, k_blk, v_blk).

    q: [B,N*bs,Hq,D]; k_ctx, v_ctx: [B,S,Hkv,D]; k_blk, v_blk: [B,N*bs,Hkv,D];
    anchors: [B,N] int32; block_valid: [B,N] bool; ctx_start: optional [B,N]
    int32 (None = 0).  Block n's queries see context slot j iff
    ctx_start[b,n] <= j < anchors[b,n] and the bs keys of their own block
    (packed rows: ctx_start = first position of the anchor's document); rows of
    invalid blocks output 0 (zero gradients).  Context tiles wholly outside
    every window of a query tile are skipped.  Returns [B,N*bs,Hq,D].
    """
    variant = backend.resolve(impl, interpret)
    if variant in (backend.XLA, backend.CUDNN):  # no fused cuDNN training path (yet)
        return reference.training_attention(
            q,
            k_ctx,
            v_ctx,
            k_blk,
            v_blk,
            anchors,
            block_valid,
            block_size=block_size,
            ctx_start=ctx_start,
            sm_scale=sm_scale,
        )
    from . import training

    return training.training_attention(
        q,
        k_ctx,
        v_ctx,
        k_blk,
        v_blk,
        anchors,
        block_valid,
        block_size=block_size,
        ctx_start=ctx_start,
        sm_scale=sm_scale,
        variant=variant,
        interpret=interpret,
        rows_target=block_q_rows,
        block_k=block_k,
    )
