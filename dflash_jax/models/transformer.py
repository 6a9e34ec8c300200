"""The dense target module: one Flax Linen decoder-only transformer for Qwen3 and Llama-3 targets.

The forward takes new tokens and (optionally) a KV cache, and returns the final-normed hidden
states, the updated cache and the concatenated hidden states of requested layers (the "taps"
DFlash conditions on). Logits are a separate, cheap call (`lm_logits`) so callers project only
the positions they need.

KV cache design (static shapes, as in the gemma sampler):
  k, v:    L-tuples of [B, S, K*D], preallocated to a fixed capacity S (one buffer per
           layer, so each layer's write updates its buffer in place under jit). The heads of a
           slot lie side by side on the last axis: the [B, S, K*D] view the TPU kernels read,
           stored as such. XLA lays a [B, S, K, D] array out with the head axis outside the
           sequence axis, so with more than one KV head per chip the kernels' view of it was a
           relayout copy of every cache every step; attention takes the
           [B, S, K, D] view (`KVCache.heads`) where it needs one.
  lengths: [B] int32         committed tokens per sequence.
New tokens of sequence b are written at slots `lengths[b] + t` (their absolute positions), and a
query at position p attends to slots `j <= p`. That single rule is causal inside a block and hides
whatever a rolled-back step left beyond the committed length, so rolling back is just writing a
smaller `lengths` (O(1), no copy).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional, Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models import attention as attn_lib
from dflash_jax.models import layer_stack
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.layers import (
    MLP,
    Int8Dense,
    QKVProjection,
    RMSNorm,
    masked_attention,
    rope_inv_freq,
)
from dflash_jax.models.moe import SparseMoE


@flax.struct.dataclass
class KVCache:
    """Per-layer keys/values of committed (and possibly stale) positions: the target's cache
    and the drafter's context cache alike.

    k, v: tuples of L arrays [B, S, K*D] (heads side by side on the last axis);
    lengths: [B] int32, committed tokens per sequence; head_dim (static): D; seq_split
    (static): a DFlash drafter's context cache, which a mesh whose `tensor` axis its heads do
    not divide splits by sequence instead (`attention.splits_context`).
    """

    k: tuple
    v: tuple
    lengths: jnp.ndarray
    head_dim: int = flax.struct.field(pytree_node=False)
    seq_split: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def create(cls, cfg, batch: int, capacity: int, dtype=None, stacked: bool = False) -> "KVCache":
        """Zeros for `cfg`: a ModelConfig (a target) or a DrafterConfig (its body's layers).
        `stacked`: k and v are single arrays [L, B, S, K*D] (a scanned layer stack,
        `models/layer_stack.py`) instead of L-tuples."""
        cfg = getattr(cfg, "body", cfg)
        shape = (batch, capacity, cfg.num_kv_heads * cfg.head_dim)
        dtype = cfg.dtype if dtype is None else dtype
        if stacked:
            k = jnp.zeros((cfg.num_layers,) + shape, dtype)
            v = jnp.zeros((cfg.num_layers,) + shape, dtype)
        else:
            k = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
            v = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
        return cls(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32), head_dim=cfg.head_dim)

    @property
    def stacked(self) -> bool:
        """k and v are stacked arrays [L, B, S, K*D], not per-layer tuples."""
        return not isinstance(self.k, (tuple, list))

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k[0].shape[-1] // self.head_dim

    def heads(self, x_BSF):
        """A cache array [B, S, K*D] viewed as [B, S, K, D]."""
        return x_BSF.reshape(*x_BSF.shape[:2], -1, self.head_dim)

    def rollback(self, lengths: jnp.ndarray) -> "KVCache":
        """Forgets everything past `lengths` [B]: O(1) bookkeeping, the slots stay in place."""
        return self.replace(lengths=lengths.astype(jnp.int32))

    def settle(self, lengths) -> "KVCache":
        """After a prefill chunk: nothing to do (the prefill rolls back once at its end; a
        `HybridCache` settles its recurrent state here)."""
        return self

    def pad_pending(self, width: int) -> "KVCache":
        """No pending block to pad (`HybridCache.pad_pending`)."""
        return self


def flat_heads(x_BTKD):
    """[B, T, K, D] -> [B, T, K*D]: new keys or values in the caches' layout."""
    return x_BTKD.reshape(*x_BTKD.shape[:2], -1)


def write_kv(cache_BSF, new_BTF, positions_BT):
    """Scatters new keys (or values) [B,T,...] into a cache [B,S,...] at slots `positions`
    (the trailing dims alike: [K*D] in the caches, [K, D] also works).

    Out-of-range slots are dropped (never clamped onto valid data).
    """
    b = jnp.arange(new_BTF.shape[0])[:, None]
    return cache_BSF.at[b, positions_BT].set(new_BTF.astype(cache_BSF.dtype), mode="drop")


def write_kv_layer(stack_LBSF, new_BTF, positions_BT, layer):
    """`write_kv` into layer `layer` (a traced index) of a stacked cache [L, B, S, ...]: one
    scatter into the stack where it lies (no copy of the layer's slice)."""
    b = jnp.arange(new_BTF.shape[0])[:, None]
    return stack_LBSF.at[layer, b, positions_BT].set(new_BTF.astype(stack_LBSF.dtype), mode="drop")


def split_experts(params: dict):
    """A stacked layer's parameters without its MoE experts (`mlp/experts` [L, E, ...]), and
    the experts: a scan slices its inputs per layer, and a slice of the expert stack handed to
    the routed Pallas kernel is a copy of the layer's experts every step, so the scan passes
    the whole expert stack and the layer index instead (`moe.SparseMoE`). (params, None)
    without experts."""
    mlp = params.get("mlp")
    if not isinstance(mlp, Mapping) or "experts" not in mlp:
        return params, None
    rest = dict(params, mlp={k: v for k, v in mlp.items() if k != "experts"})
    return rest, mlp["experts"]


def join_experts(params: dict, experts):
    """`split_experts`' inverse inside the scan body (a layer's parameters, the whole stack of
    its experts)."""
    if experts is None:
        return params
    return dict(params, mlp=dict(params["mlp"], experts=experts))


def write_layer_cache(
    layer_cache, k_BTF, v_BTF, positions_BT, starts_B, impl, head_dim, seq_split=False
):
    """A layer's new K/V [B, T, K*D] written into its cache: `layer_cache` is (k, v)
    [B, S, K*D] or (k, v, index) into stacked caches [L, B, S, K*D] (written where they lie).
    With `starts_B` the rows are a block at starts[b] (`attention.write_block`: the Pallas DMA
    kernel under a TPU Pallas impl; a tree's nodes too, not at their positions; `seq_split`:
    the cache's `KVCache.seq_split`), else at `positions_BT`. Returns (k, v, the layer index
    or None)."""
    ck, cv = layer_cache[:2]
    li = layer_cache[2] if len(layer_cache) == 3 else None
    if starts_B is not None:
        kw = dict(layer=li, seq_split=seq_split)
        ck = attn_lib.write_block(ck, k_BTF, starts_B, impl, head_dim, **kw)
        cv = attn_lib.write_block(cv, v_BTF, starts_B, impl, head_dim, **kw)
    elif li is not None:
        ck = write_kv_layer(ck, k_BTF, positions_BT, li)
        cv = write_kv_layer(cv, v_BTF, positions_BT, li)
    else:
        ck = write_kv(ck, k_BTF, positions_BT)
        cv = write_kv(cv, v_BTF, positions_BT)
    return ck, cv, li


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    attention_impl: str = "xla"
    moe: bool = False  # the feed-forward is a mixture of experts (`moe.SparseMoE`)

    @nn.compact
    def __call__(
        self,
        x_BTH,
        positions_BT,
        inv_freq,
        layer_cache=None,
        mask_BTT=None,
        attn_chunk: int = 0,
        segment_ids_BT=None,
        cache_starts_B=None,
        tree_mask_BTT=None,
        stack_layer=None,
        seq_split: bool = False,
    ):
        """One pre-norm decoder layer.

        `stack_layer`: in a scanned stack, (this layer's index, L); the experts of a MoE layer
        are then given whole ([L, E, ...], read at the index: `moe.SparseMoE`). `seq_split`:
        the cache's `KVCache.seq_split` (a chain's cache, split by sequence over `tensor` where
        the mesh cannot split its heads: `attention.splits_context`).

        With `layer_cache` and `tree_mask_BTT` (a draft tree's verify), the new K/V are written
        at slots `cache_starts_B[b] + t`, and node t sees the committed slots (j < start) and
        node u iff tree_mask[b, t, u] (`attention.tree_verify_attention`).
        With `layer_cache=(k [B,S,K*D], v [B,S,K*D])` the new K/V are written at `positions`
        and the queries attend to cache slots `j <= position`; it returns the updated pair.
        `cache_starts_B` [B] (optional) says the positions are `starts[b] + arange(T)`: the
        write is then `attention.write_block` (a Pallas DMA kernel under a TPU Pallas impl).
        Without a cache, attention is over the T new tokens with `mask_BTT`, or, with
        `attn_chunk > 0`, causal (and segment-masked) `attention.causal_attention`: a flash
        kernel under a Pallas `attention_impl` on TPU / GPU, else `attention.chunked_causal_attention`
        (`attn_chunk` queries at a time).
        """
        c = self.cfg
        attn = QKVProjection(c, name="self_attn")
        h = RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype, name="input_layernorm")(x_BTH)
        q = attn.queries(h, positions_BT, inv_freq)
        k, v = attn.keys_values(h, positions_BT, inv_freq)
        if layer_cache is None and attn_chunk > 0:
            out = attn_lib.causal_attention(
                q, k, v, positions_BT, segment_ids_BT, self.attention_impl, attn_chunk
            )
            new_cache = None
        elif layer_cache is None:
            out = masked_attention(q, k, v, mask_BTT)
            new_cache = None
        else:
            k4, v4 = k, v
            ck, cv, layer = write_layer_cache(
                layer_cache, flat_heads(k), flat_heads(v), positions_BT, cache_starts_B,
                self.attention_impl, c.head_dim, seq_split,
            )  # fmt: skip
            if tree_mask_BTT is not None:
                out = attn_lib.tree_verify_attention(
                    q, ck, cv, cache_starts_B, k4, v4, tree_mask_BTT, self.attention_impl, layer
                )
            else:
                out = attn_lib.verify_attention(
                    q, ck, cv, positions_BT, self.attention_impl, layer, seq_split
                )
            new_cache = (ck, cv)
        x_BTH = x_BTH + attn.output(out)
        h = RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype, name="post_attention_layernorm")(x_BTH)
        if self.moe:
            x_BTH = x_BTH + SparseMoE(c, self.attention_impl, name="mlp")(h, stack_layer)
        else:
            x_BTH = x_BTH + MLP(c, name="mlp")(h)
        return x_BTH, new_cache


class Transformer(nn.Module):
    """Qwen3 / Llama-3 / Qwen3-MoE decoder. Parameter names follow the Hugging Face layout
    (a Qwen3-MoE layer's experts stacked, `moe.SparseMoE`).

    Entry points, one per use:
      __call__(input_ids [B,T], positions [B,T]=None, cache=None, tap_layers=(), segment_ids=None)
        -> (hidden [B,T,H] after the final norm, cache or None, taps [B,T,n*H] or None):
        training and evaluation without a cache; the prefill and a chain's verify with one
      verify_tree(input_ids, positions, cache, tree_mask, tap_layers=()): a draft tree's verify
      taps(input_ids, tap_layers, positions=None, segment_ids=None): the frozen target pass of
        drafter training, the taps only
      embed(input_ids), logits(hidden): the embedding and the LM head

    With a cache, positions default to `cache.lengths + arange(T)` and the returned cache has
    `lengths + T`: the caller rolls back what it does not commit.

    `tap_layers` are 0-based decoder-layer indices; tap i is the residual stream after layer i
    (Hugging Face `hidden_states[i + 1]`).
    """

    cfg: ModelConfig
    attention_impl: str = "xla"

    def setup(self):
        c = self.cfg
        self.embed_tokens = nn.Embed(
            c.vocab_size,
            c.hidden_size,
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            name="embed_tokens",
        )
        if c.scans_layers:
            self.layers = None
            self.stack = self.param(layer_stack.STACKED, self._init_stack)
        else:
            self.layers = self.decoder_layers()
        self.norm = self.final_norm()
        if c.quantize_lm_head:
            self.lm_head = Int8Dense(c.vocab_size, False, c.dtype, c.param_dtype, name="lm_head")
        elif not c.tie_word_embeddings:
            self.lm_head = nn.Dense(
                c.vocab_size,
                use_bias=False,
                dtype=c.dtype,
                param_dtype=c.param_dtype,
                name="lm_head",
            )

    def decoder_layers(self) -> list:
        """The decoder layers, built in `setup` (a hybrid target builds its own)."""
        c = self.cfg
        return [
            DecoderLayer(c, self.attention_impl, c.layer_is_moe(i), name=f"layers_{i}")
            for i in range(c.num_layers)
        ]

    def layer_module(self, attention_impl: Optional[str] = None) -> "DecoderLayer":
        """The one layer body of a stacked group (unbound: applied to each layer's slice)."""
        c = self.cfg
        impl = self.attention_impl if attention_impl is None else attention_impl
        return DecoderLayer(c, impl, c.layer_is_moe(0), parent=None)

    def _init_stack(self, rng):
        """Random parameters of every layer, stacked [L, ...] (`layer_stack`): each layer
        initialised under vmap through XLA ops (the parameters do not depend on the kernels,
        and a TPU kernel's memory-space constraint has no batching rule)."""
        c = self.cfg
        x = jnp.zeros((1, 1, c.hidden_size), c.dtype)
        pos = jnp.zeros((1, 1), jnp.int32)
        mask = jnp.ones((1, 1, 1), bool)
        init = lambda r: self.layer_module("xla").init(r, x, pos, rope_inv_freq(c), None, mask)
        return jax.vmap(lambda r: init(r)["params"])(jax.random.split(rng, c.num_layers))

    def _scan(
        self,
        x,
        positions_BT,
        inv_freq,
        cache,
        tap_layers,
        mask,
        starts,
        tree_mask_BTT,
        depth=None,
        attn_chunk=0,
        segment_ids_BT=None,
    ):
        """The stacked layers 0 .. depth-1 (all by default) as one `lax.scan`. Returns the
        residual stream, the new (k, v) stacks or None, and the taps {layer: x}."""
        c = self.cfg
        n = c.num_layers if depth is None else depth
        params, experts = split_experts(self.stack)
        if n < c.num_layers:
            params = jax.tree_util.tree_map(lambda a: a[:n], params)
        layer = self.layer_module()
        tap_layers = tuple(tap_layers)
        slot_of = np.full((n,), -1, np.int32)
        for j, i in enumerate(tap_layers):
            if i < n:
                slot_of[i] = j
        tapbuf = jnp.zeros((max(len(tap_layers), 1),) + x.shape, x.dtype)

        def body(carry, xs):
            x, kv, tapbuf = carry
            p, i, slot = xs
            layer_cache = None if kv is None else (kv[0], kv[1], i)
            x, kv = layer.apply(
                {"params": join_experts(p, experts)},
                x,
                positions_BT,
                inv_freq,
                layer_cache,
                mask,
                attn_chunk,
                segment_ids_BT,
                cache_starts_B=starts,
                tree_mask_BTT=tree_mask_BTT,
                stack_layer=None if experts is None else (i, c.num_layers),
            )
            if tap_layers:
                at = jnp.maximum(slot, 0)
                keep = jax.lax.dynamic_index_in_dim(tapbuf, at, 0, keepdims=False)
                tapbuf = jax.lax.dynamic_update_index_in_dim(
                    tapbuf, jnp.where(slot >= 0, x, keep), at, 0
                )
            return (x, kv, tapbuf), None

        kv = None if cache is None else (cache.k, cache.v)
        xs = (params, jnp.arange(n, dtype=jnp.int32), jnp.asarray(slot_of))
        (x, kv, tapbuf), _ = jax.lax.scan(body, (x, kv, tapbuf), xs)
        return x, kv, {i: tapbuf[j] for j, i in enumerate(tap_layers)}

    def final_norm(self) -> nn.Module:
        c = self.cfg
        return RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype, name="norm")

    def embed(self, input_ids_BT):
        return self.embed_tokens(input_ids_BT)

    def logits(self, hidden_BTH, rows=None):
        """Float32 logits [B,T,V] from final-normed hidden states; with `rows` (int [K]) only
        those rows of the head, [B,T,K] (a drafter's draft vocabulary)."""
        if self.cfg.tie_word_embeddings:
            w = self.embed_tokens.embedding
            w = (w if rows is None else jnp.take(w, rows, axis=0)).astype(self.cfg.dtype)
            return jnp.einsum(
                "bth,vh->btv",
                hidden_BTH.astype(self.cfg.dtype),
                w,
                preferred_element_type=jnp.float32,
            )
        head = self.lm_head.variables["params"]
        w = head["kernel"]
        if rows is not None:
            w = jnp.take(w, rows, axis=1)
        w = w.astype(self.cfg.dtype)  # an int8 head: converted inside the dot
        out = jnp.einsum(
            "bth,hv->btv", hidden_BTH.astype(self.cfg.dtype), w, preferred_element_type=jnp.float32
        )
        if "kernel_scale" in head:  # an int8 head: its float32 dot times the per-column scale
            scale = head["kernel_scale"]
            out = out * (scale if rows is None else jnp.take(scale, rows, axis=-1))
        return out

    def __call__(
        self,
        input_ids_BT,
        positions_BT=None,
        cache: Optional[KVCache] = None,
        tap_layers: Sequence[int] = (),
        segment_ids_BT=None,
    ):
        """The forward: without a cache, causal over the block (within `segment_ids_BT`'s
        documents when given: packed training rows); with a cache, the block appended to it
        (the prefill and a chain's verify), positions `cache.lengths + arange(T)` by default.
        Returns (hidden, cache or None, taps or None)."""
        b, t = input_ids_BT.shape
        starts = None  # with a cache and default positions: each row writes a contiguous block
        if positions_BT is None:
            base = 0 if cache is None else cache.lengths[:, None]
            positions_BT = base + jnp.arange(t, dtype=jnp.int32)[None, :]
            starts = None if cache is None else cache.lengths
        mask = None
        if cache is None:
            mask = positions_BT[:, None, :] <= positions_BT[:, :, None]
            if segment_ids_BT is not None:
                mask &= segment_ids_BT[:, None, :] == segment_ids_BT[:, :, None]
        return self._layers(input_ids_BT, positions_BT, cache, tap_layers, mask, starts)

    def verify_tree(self, input_ids_BT, positions_BT, cache: KVCache, tree_mask_BTT, tap_layers=()):
        """A draft tree's verify: the T nodes at `positions_BT` (committed length + depth),
        written at slots `cache.lengths + t`; node t sees the committed slots and node u iff
        `tree_mask_BTT[b, t, u]`. Returns (hidden, cache, taps or None) as `__call__`."""
        return self._layers(
            input_ids_BT, positions_BT, cache, tap_layers, None, cache.lengths, tree_mask_BTT
        )

    def _layers(self, ids_BT, positions_BT, cache, tap_layers, mask, starts, tree_mask_BTT=None):
        c = self.cfg
        t = ids_BT.shape[1]
        inv_freq = rope_inv_freq(c)
        x = self.embed(ids_BT)
        if c.scans_layers:
            x, kv, by_layer = self._scan(
                x, positions_BT, inv_freq, cache, tap_layers, mask, starts, tree_mask_BTT
            )
            return self._finish(x, cache, kv, t, tap_layers, by_layer)
        taps = []
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else (cache.k[i], cache.v[i])
            x, layer_cache = layer(
                x,
                positions_BT,
                inv_freq,
                layer_cache,
                mask,
                cache_starts_B=starts,
                tree_mask_BTT=tree_mask_BTT,
                seq_split=cache is not None and cache.seq_split,
            )
            if cache is not None:
                new_k.append(layer_cache[0])
                new_v.append(layer_cache[1])
            if i in tap_layers:
                taps.append((i, x))
        kv = None if cache is None else (tuple(new_k), tuple(new_v))
        return self._finish(x, cache, kv, t, tap_layers, dict(taps))

    def _finish(self, x, cache, kv, t, tap_layers, by_layer):
        """The final norm, the cache with its new K/V and lengths, the concatenated taps."""
        if self.is_initializing() and not self.cfg.tie_word_embeddings:
            self.lm_head(x)  # create lm_head params
        hidden = self.norm(x)
        new_cache = None
        if cache is not None:
            new_cache = cache.replace(k=kv[0], v=kv[1], lengths=cache.lengths + t)
        tap_out = None
        if tap_layers:
            tap_out = jnp.concatenate([by_layer[i] for i in tap_layers], axis=-1)
        return hidden, new_cache, tap_out

    def taps(
        self, input_ids_BT, tap_layers, positions_BT=None, segment_ids_BT=None, attn_chunk=512
    ):
        """The frozen target pass of drafter training (no cache): the taps [B, T, n*H] only.
        The forward stops at the last tapped layer (the layers above it, the final norm and the
        LM head are never computed) and its causal attention is `attention.causal_attention`
        under `attention_impl` (splash attention on TPU, Pallas Triton flash attention on GPU,
        `attn_chunk` queries at a time in XLA otherwise), never a dense [B, N, T, T] score
        tensor."""
        tap_layers = tuple(tap_layers)
        if not tap_layers:
            raise ValueError("taps needs tap_layers")
        b, t = input_ids_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
        inv_freq = rope_inv_freq(self.cfg)
        x = self.embed(input_ids_BT)
        if self.cfg.scans_layers:  # the stack up to the last tap
            _, _, taps = self._scan(
                x,
                positions_BT,
                inv_freq,
                None,
                tap_layers,
                None,
                None,
                None,
                depth=max(tap_layers) + 1,
                attn_chunk=attn_chunk,
                segment_ids_BT=segment_ids_BT,
            )
            return jnp.concatenate([taps[i] for i in tap_layers], axis=-1)
        taps = {}
        for i in range(max(tap_layers) + 1):
            x, _ = self.layers[i](x, positions_BT, inv_freq, None, None, attn_chunk, segment_ids_BT)
            if i in tap_layers:
                taps[i] = x
        return jnp.concatenate([taps[i] for i in tap_layers], axis=-1)
