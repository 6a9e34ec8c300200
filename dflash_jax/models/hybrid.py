"""Hybrid targets: Qwen3.5 / Qwen3.6 text models (Gated DeltaNet + gated attention).

`config.layer_types` alternates two token mixers (by default three linear layers, then one full):

  linear_attention  a Gated DeltaNet: in_proj_qkv -> depthwise causal conv (kernel K, SiLU) ->
                    q, k (L2-normed, q / sqrt(dk)), v; beta = sigmoid(in_proj_b), per-head log
                    decay g = -exp(A_log) * softplus(in_proj_a + dt_bias); the gated delta rule
                      S_t = exp(g_t) S_{t-1} + k_t delta_t^T,  delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
                      o_t = S_t^T q_t          (S: [dk, dv] per value head; a key head serves
                                               value heads / key heads consecutive value heads)
                    then an RMSNorm gated by silu(in_proj_z), out_proj.
  full_attention    attention with QK-norm, rotary on the first `partial_rotary_factor` of each
                    head, and a sigmoid gate on its output (q_proj is doubled: per head, the
                    query then the gate).
Every RMSNorm outside the DeltaNet scales by (1 + weight) (weights stored zero-centred).

Two forms of the delta rule, the same function: `recurrent_delta_rule` (one position at a time:
autoregressive decode) and `chunked_delta_rule` (C positions at a time: inside a chunk the deltas
solve one unit lower-triangular system, (I + A) Delta = beta V - beta exp(G) K S0, with
A[s, r] = beta_s exp(G_s - G_r) k_s.k_r for r < s and G the chunk's cumulative log decay; the
outputs and the final state are then matmuls). Both return the per-position deltas.

Speculative decoding over recurrent state (`HybridCache`). A verify pass runs the whole block
from the committed state S0 but never overwrites it: the cache keeps the block's per-position
deltas, keys and cumulative decays (and the convolution's inputs) as `pending`. `rollback(lengths)`
then settles the state at each sequence's accepted prefix n (ragged across the batch) in one pass:
  S_n = exp(G_n) S0 + sum_{s < n} exp(G_n - G_s) k_s delta_s^T
(the deltas of positions before n do not depend on later positions), and the convolution window
is rows n .. n+K-2 of [old window; block inputs]. Why this and not a state per position: a state
is Hv x dk x dv floats per linear layer (2 MiB per sequence and layer on Qwen3.5-9B, 48 MiB over
its 24 linear layers); keeping one per block position is 16x that per sequence and step, while
the pending block is T x (conv channels + Hv (dk + dv + 1)) floats (~1 MiB per layer at T=16),
and the settle reads S0 once and writes S_n once: the same state traffic as a plain decode step.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from dflash_jax.models import attention as attn_lib
from dflash_jax.models import layer_stack
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.layers import MLP, apply_rope, linear, masked_attention
from dflash_jax.models.moe import SparseMoE
from dflash_jax.models.transformer import (
    KVCache,
    Transformer,
    flat_heads,
    join_experts,
    split_experts,
    write_layer_cache,
)

_HI = jax.lax.Precision.HIGHEST
DELTA_CHUNK = 64  # positions per chunk of the chunked delta rule


# ---------------------------------------------------------------------------- the delta rule


def recurrent_delta_rule(q, k, v, g, beta, state):
    """The gated delta rule one position at a time.

    q, k [B, T, H, dk] (q already scaled), v [B, T, H, dv], g, beta [B, T, H], state
    [B, H, dk, dv] (float32). Returns (out [B, T, H, dv], final state, deltas [B, T, H, dv])."""

    def one(s, x):
        q_t, k_t, v_t, g_t, b_t = x
        s = s * jnp.exp(g_t)[..., None, None]
        pred = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=_HI)
        delta = b_t[..., None] * (v_t - pred)
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, (jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=_HI), delta)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, (out, delta) = jax.lax.scan(one, state, xs)
    return jnp.moveaxis(out, 0, 1), state, jnp.moveaxis(delta, 0, 1)


def _chunk(q, k, v, g, beta, s0):
    """One chunk of the chunked form; arrays [B, H, C, ...], s0 [B, H, dk, dv]."""
    c = g.shape[-1]
    G = jnp.cumsum(g, axis=-1)  # [B, H, C]
    lower = jnp.tril(jnp.ones((c, c), bool), -1)
    causal = jnp.tril(jnp.ones((c, c), bool))
    diff = G[..., :, None] - G[..., None, :]  # G_t - G_s
    decay_strict = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)
    decay_causal = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
    kk = jnp.einsum("bhsk,bhrk->bhsr", k, k, precision=_HI)
    a = beta[..., None] * decay_strict * kk
    eye = jnp.eye(c, dtype=a.dtype)
    eG = jnp.exp(G)
    rhs = beta[..., None] * (
        v - eG[..., None] * jnp.einsum("bhsk,bhkv->bhsv", k, s0, precision=_HI)
    )
    delta = jax.lax.linalg.triangular_solve(
        eye + a, rhs, left_side=True, lower=True, unit_diagonal=True
    )
    qk = jnp.einsum("bhtk,bhsk->bhts", q, k, precision=_HI) * decay_causal
    out = eG[..., None] * jnp.einsum("bhtk,bhkv->bhtv", q, s0, precision=_HI) + jnp.einsum(
        "bhts,bhsv->bhtv", qk, delta, precision=_HI
    )
    to_end = jnp.exp(G[..., -1:] - G)  # [B, H, C]
    s_end = jnp.exp(G[..., -1])[..., None, None] * s0 + jnp.einsum(
        "bhsk,bhsv->bhkv", k * to_end[..., None], delta, precision=_HI
    )
    return out, s_end, delta


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int = DELTA_CHUNK):
    """The gated delta rule `chunk` positions at a time (a scan over chunks); same arguments
    and results as `recurrent_delta_rule`. T is padded to a multiple of the chunk with g = 0
    and beta = 0, positions that leave the state as it is."""
    b, t, h, _ = k.shape
    c = min(chunk, t)
    pad = (-t) % c
    if pad:
        padw = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = (padw(x) for x in (q, k, v, g, beta))
    n = (t + pad) // c
    # [B, n*C, H, ...] -> [n, B, H, C, ...]
    split = lambda x: jnp.moveaxis(x.reshape(b, n, c, h, *x.shape[3:]), (1, 3), (0, 2))
    xs = tuple(split(x) for x in (q, k, v, g, beta))

    def body(s, x):
        out, s, delta = _chunk(*x, s)
        return s, (out, delta)

    state, (out, delta) = jax.lax.scan(body, state, xs)
    merge = lambda x: jnp.moveaxis(x, (0, 2), (1, 3)).reshape(b, n * c, h, -1)[:, :t]
    return merge(out), state, merge(delta)


def settle_state(state, k, delta, g, n):
    """The delta-rule state after the first n[b] positions of a block run from `state`:
    exp(G_n) S0 + sum_{s<n} exp(G_n - G_s) k_s delta_s^T (k [B,T,H,dk], delta [B,T,H,dv],
    g [B,T,H] the block's log decays, n [B])."""
    t = g.shape[1]
    valid = jnp.arange(t)[None, :] < n[:, None]  # [B, T]
    g = jnp.where(valid[..., None], g, 0.0)
    G = jnp.cumsum(g, axis=1)  # [B, T, H]
    Gn = G[:, -1]  # [B, H]: the decay through the accepted positions
    w = jnp.where(valid[..., None], jnp.exp(Gn[:, None] - G), 0.0)
    return jnp.exp(Gn)[..., None, None] * state + jnp.einsum(
        "bthk,bth,bthv->bhkv", k, w, delta, precision=_HI
    )


def settle_window(window, x, n):
    """The convolution window [B, K-1, C] after the first n[b] of the block's inputs x [B, T, C]."""
    km1 = window.shape[1]
    both = jnp.concatenate([window, x.astype(window.dtype)], axis=1)
    rows = n[:, None] + jnp.arange(km1)[None, :]
    return jnp.take_along_axis(both, rows[..., None], axis=1)


# ---------------------------------------------------------------------------- the cache


@flax.struct.dataclass
class HybridCache:
    """A hybrid target's decoding state.

    kv: the full-attention layers' `KVCache` (one entry per full layer) and the lengths;
    conv: per linear layer, the convolution's last K-1 inputs [B, K-1, C];
    state: per linear layer, the delta-rule state [B, Hv, dk, dv] (float32);
    pending: None, or per linear layer the last forward's block (inputs [B, T, C], keys
      [B, T, Hv, dk], deltas [B, T, Hv, dv], log decays [B, T, Hv]) that `rollback` settles
      at the committed length; base: [B] the lengths before that block.
    After a forward, `conv` and `state` are still those before its block: call `rollback`
    (with the committed lengths, or `lengths` for all of it) before the next forward.

    Stacked (a scanned layer stack, `layer_stack`): kv's k, v [F, B, S, K*D], conv
    [L, B, K-1, C], state [L, B, Hv, dk, dv] and pending's four arrays [L, B, T, ...], one
    entry per full (F) or linear (L) layer in layer order, each updated where it lies.
    """

    kv: KVCache
    conv: tuple
    state: tuple
    pending: Optional[tuple] = None
    base: Optional[jnp.ndarray] = None

    @classmethod
    def create(
        cls, cfg: ModelConfig, batch: int, capacity: int, dtype=None, stacked: bool = False
    ) -> "HybridCache":
        h = cfg.hybrid
        dtype = cfg.dtype if dtype is None else dtype
        shape = (batch, capacity, cfg.num_kv_heads * cfg.head_dim)
        nf, nl = len(h.full_layers), len(h.linear_layers)
        win = (batch, h.linear_conv_kernel_dim - 1, h.conv_dim)
        st = (batch, h.linear_num_value_heads, h.linear_key_head_dim, h.linear_value_head_dim)
        if stacked:
            k, v = jnp.zeros((nf,) + shape, dtype), jnp.zeros((nf,) + shape, dtype)
            conv, state = jnp.zeros((nl,) + win, dtype), jnp.zeros((nl,) + st, jnp.float32)
        else:
            k = tuple(jnp.zeros(shape, dtype) for _ in range(nf))
            v = tuple(jnp.zeros(shape, dtype) for _ in range(nf))
            conv = tuple(jnp.zeros(win, dtype) for _ in range(nl))
            state = tuple(jnp.zeros(st, jnp.float32) for _ in range(nl))
        lengths = jnp.zeros((batch,), jnp.int32)
        kv = KVCache(k=k, v=v, lengths=lengths, head_dim=cfg.head_dim)
        return cls(kv=kv, conv=conv, state=state)

    @property
    def stacked(self) -> bool:
        """The per-layer entries are stacked arrays (a scanned layer stack), not tuples."""
        return not isinstance(self.conv, (tuple, list))

    @property
    def lengths(self):
        return self.kv.lengths

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    @property
    def head_dim(self) -> int:
        return self.kv.head_dim

    @property
    def k(self) -> tuple:
        """The full-attention layers' keys (`KVCache.k`)."""
        return self.kv.k

    @property
    def v(self) -> tuple:
        return self.kv.v

    def rollback(self, lengths) -> "HybridCache":
        """Keeps the first `lengths - base` positions of the pending block (ragged over the
        batch): the recurrent state and the convolution window settle there, the K/V lengths
        are set. Without a pending block only lengths equal to the current ones are valid."""
        lengths = lengths.astype(jnp.int32)
        if self.pending is None:
            return self.replace(kv=self.kv.rollback(lengths))
        n = lengths - self.base
        if self.stacked:  # every linear layer at once: [L, ...]
            x, k, delta, g = self.pending
            conv = jax.vmap(settle_window, in_axes=(0, 0, None))(self.conv, x, n)
            state = jax.vmap(settle_state, in_axes=(0, 0, 0, 0, None))(self.state, k, delta, g, n)
            return HybridCache(kv=self.kv.rollback(lengths), conv=conv, state=state)
        conv, state = [], []
        for window, s0, (x, k, delta, g) in zip(self.conv, self.state, self.pending):
            conv.append(settle_window(window, x, n))
            state.append(settle_state(s0, k, delta, g, n))
        return HybridCache(kv=self.kv.rollback(lengths), conv=tuple(conv), state=tuple(state))

    def settle(self, lengths) -> "HybridCache":
        """After a prefill chunk: the recurrent state at each prompt's end within it
        (`rollback`); the K/V lengths are the prompts' there."""
        return self.rollback(lengths)

    def pad_pending(self, width: int) -> "HybridCache":
        """The pending block padded to `width` positions (never settled: n <= its width), so
        verify passes of different widths return caches of one shape."""
        if self.pending is None:
            return self
        if self.stacked:  # four arrays [L, B, T, ...]
            t = self.pending[0].shape[2]
            padw = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, width - t)] + [(0, 0)] * (x.ndim - 3))
            return self.replace(pending=tuple(padw(x) for x in self.pending))
        t = self.pending[0][0].shape[1]
        padw = lambda x: jnp.pad(x, [(0, 0), (0, width - t)] + [(0, 0)] * (x.ndim - 2))
        return self.replace(pending=tuple(tuple(padw(x) for x in p) for p in self.pending))


# ---------------------------------------------------------------------------- layers


class CenteredRMSNorm(nn.Module):
    """RMSNorm that scales by (1 + weight), in float32, rounded once at the end."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (1.0 + w.astype(jnp.float32))).astype(self.dtype)


class GatedRMSNorm(nn.Module):
    """The DeltaNet's output norm: RMSNorm(x) * weight * silu(gate), per value head."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, gate):
        w = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        y = w.astype(self.dtype) * x32.astype(self.dtype)
        return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(self.dtype)


def _l2norm(x, eps=1e-6):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer (Hugging Face `linear_attn`)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTH, window=None, state=None):
        """x [B, T, H]; window [B, K-1, C] and state [B, Hv, dk, dv] (None: zeros, no cache).
        Returns (out [B, T, H], pending (inputs, keys, deltas, log decays) of this block)."""
        c, h = self.cfg, self.cfg.hybrid
        b, t, _ = x_BTH.shape
        hk, hv = h.linear_num_key_heads, h.linear_num_value_heads
        dk, dv = h.linear_key_head_dim, h.linear_value_head_dim
        ksz = h.linear_conv_kernel_dim
        mixed = linear(c, h.conv_dim, "in_proj_qkv")(x_BTH)
        z = linear(c, hv * dv, "in_proj_z")(x_BTH).reshape(b, t, hv, dv)
        b_in = linear(c, hv, "in_proj_b")(x_BTH)
        a_in = linear(c, hv, "in_proj_a")(x_BTH)
        conv_w = self.param(
            "conv1d",  # Hugging Face `linear_attn.conv1d.weight` [C, 1, K]
            nn.initializers.normal(0.02),
            (h.conv_dim, 1, ksz),
            c.param_dtype,
        )
        dt_bias = self.param("dt_bias", nn.initializers.ones, (hv,), c.param_dtype)
        a_log = self.param(
            "A_log",
            lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0)),
            (hv,),
            c.param_dtype,
        )
        if window is None:
            window = jnp.zeros((b, ksz - 1, h.conv_dim), mixed.dtype)
        xs = jnp.concatenate([window.astype(mixed.dtype), mixed], axis=1)  # [B, K-1+T, C]
        w = conv_w[:, 0, :].astype(jnp.float32)  # [C, K]
        conv = sum(xs[:, j : j + t].astype(jnp.float32) * w[None, None, :, j] for j in range(ksz))
        conv = jax.nn.silu(conv).astype(c.dtype)
        kd = hk * dk
        q = conv[..., :kd].reshape(b, t, hk, dk)
        k = conv[..., kd : 2 * kd].reshape(b, t, hk, dk)
        v = conv[..., 2 * kd :].reshape(b, t, hv, dv).astype(jnp.float32)
        q = _l2norm(q) * dk**-0.5
        k = _l2norm(k)
        if hv != hk:  # each key head serves hv / hk consecutive value heads
            q, k = jnp.repeat(q, hv // hk, axis=2), jnp.repeat(k, hv // hk, axis=2)
        beta = jax.nn.sigmoid(b_in.astype(jnp.float32))
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
            a_in.astype(jnp.float32) + dt_bias.astype(jnp.float32)
        )
        if state is None:
            state = jnp.zeros((b, hv, dk, dv), jnp.float32)
        rule = recurrent_delta_rule if t == 1 else chunked_delta_rule
        out, _, delta = rule(q, k, v, g, beta, state)
        out = GatedRMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype, name="norm")(
            out.astype(c.dtype), z
        )
        out = linear(c, c.hidden_size, "out_proj")(out.reshape(b, t, hv * dv))
        return out, (mixed, k, delta, g)


class GatedAttention(nn.Module):
    """A full-attention layer (Hugging Face `self_attn`): QK-norm (1 + weight), partial rotary,
    a sigmoid gate on the output. Parameters q_proj (doubled), k_proj, v_proj, o_proj, q_norm,
    k_norm."""

    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        dense = lambda f, name: linear(c, f, name, c.attention_bias)
        self.q_proj = dense(2 * c.num_heads * c.head_dim, "q_proj")
        self.k_proj = dense(c.num_kv_heads * c.head_dim, "k_proj")
        self.v_proj = dense(c.num_kv_heads * c.head_dim, "v_proj")
        self.o_proj = dense(c.hidden_size, "o_proj")
        self.q_norm = CenteredRMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype, name="q_norm")
        self.k_norm = CenteredRMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype, name="k_norm")

    def _rope(self, x, positions, inv_freq):
        r = self.cfg.rotary_dim
        return jnp.concatenate([apply_rope(x[..., :r], positions, inv_freq), x[..., r:]], -1)

    def project(self, x_BTH, positions_BT, inv_freq):
        """(q [B,T,N,D], gate [B,T,N*D], k [B,T,K,D], v [B,T,K,D])."""
        c = self.cfg
        b, t, _ = x_BTH.shape
        qg = self.q_proj(x_BTH).reshape(b, t, c.num_heads, 2 * c.head_dim)
        q, gate = qg[..., : c.head_dim], qg[..., c.head_dim :].reshape(b, t, -1)
        q = self._rope(self.q_norm(q), positions_BT, inv_freq)
        k = self.k_norm(self.k_proj(x_BTH).reshape(b, t, c.num_kv_heads, c.head_dim))
        k = self._rope(k, positions_BT, inv_freq)
        v = self.v_proj(x_BTH).reshape(b, t, c.num_kv_heads, c.head_dim)
        return q, gate, k, v

    def output(self, attn_BTND, gate):
        b, t = attn_BTND.shape[:2]
        gated = attn_BTND.reshape(b, t, -1) * jax.nn.sigmoid(gate.astype(jnp.float32))
        return self.o_proj(gated.astype(self.cfg.dtype))

    def __call__(self, x_BTH, positions_BT, inv_freq):  # used by init only
        q, gate, k, v = self.project(x_BTH, positions_BT, inv_freq)
        return self.output(q, gate), k, v


class HybridLayer(nn.Module):
    cfg: ModelConfig
    index: int
    attention_impl: str = "xla"

    @nn.compact
    def __call__(
        self,
        x_BTH,
        positions_BT,
        inv_freq,
        layer_cache=None,
        mask_BTT=None,
        starts=None,
        stack_layer=None,
        seq_split: bool = False,
    ):
        """One pre-norm layer. A linear layer's `layer_cache` is (window, state) or None and it
        returns (x, pending); a full layer's is (k, v), or (k, v, index) into stacked caches
        [F, B, S, K*D] (written and read where they lie), or None (then `mask_BTT` is the
        causal mask) and it returns (x, (k, v) or None). `stack_layer`: a MoE layer's experts
        given as a scanned stack's and its index there (`transformer.split_experts`).
        `seq_split`: the full layers' `KVCache.seq_split` (`transformer.DecoderLayer`)."""
        c = self.cfg
        h = CenteredRMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype, name="input_layernorm")(x_BTH)
        if c.hybrid.is_linear(self.index):
            window, state = (None, None) if layer_cache is None else layer_cache
            out, new = GatedDeltaNet(c, name="linear_attn")(h, window, state)
        else:
            attn = GatedAttention(c, name="self_attn")
            q, gate, k, v = attn.project(h, positions_BT, inv_freq)
            if layer_cache is None:
                out, new = masked_attention(q, k, v, mask_BTT), None
            else:
                impl = self.attention_impl
                ck, cv, li = write_layer_cache(
                    layer_cache, flat_heads(k), flat_heads(v), positions_BT, starts, impl,
                    c.head_dim, seq_split,
                )  # fmt: skip
                out = attn_lib.verify_attention(q, ck, cv, positions_BT, impl, li, seq_split)
                new = (ck, cv)
            out = attn.output(out, gate)
        x_BTH = x_BTH + out
        h = CenteredRMSNorm(
            c.rms_norm_eps, c.dtype, c.param_dtype, name="post_attention_layernorm"
        )(x_BTH)
        if c.layer_is_moe(self.index):
            x_BTH = x_BTH + SparseMoE(c, self.attention_impl, name="mlp")(h, stack_layer)
        else:
            x_BTH = x_BTH + MLP(c, name="mlp")(h)
        return x_BTH, new


def hybrid_inv_freq(cfg: ModelConfig):
    """Inverse frequencies [rotary_dim / 2] of the rotated part of each head."""
    r = cfg.rotary_dim
    return 1.0 / (cfg.rope_theta ** (jnp.arange(0, r, 2, dtype=jnp.float32) / r))


class HybridTransformer(Transformer):
    """A Qwen3.5 / Qwen3.6 text model with the target's entry points (`Transformer`):
    __call__ (with a `HybridCache` or none), taps, embed, logits. Trees are refused."""

    def decoder_layers(self) -> list:
        c = self.cfg
        return [
            HybridLayer(c, i, self.attention_impl, name=f"layers_{i}") for i in range(c.num_layers)
        ]

    def final_norm(self) -> nn.Module:
        c = self.cfg
        return CenteredRMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype, name="norm")

    def slot_modules(self, attention_impl: Optional[str] = None) -> list:
        """The layer bodies of one group of a scanned stack, slot j built as layer j (unbound:
        applied to each group's slice of `layers/slot_{j}`)."""
        c = self.cfg
        impl = self.attention_impl if attention_impl is None else attention_impl
        return [HybridLayer(c, j, impl, parent=None) for j in range(c.layer_period)]

    def _init_stack(self, rng):
        """Random parameters of every group, `layers/slot_{j}` [G, ...] (`layer_stack`)."""
        c = self.cfg
        x = jnp.zeros((1, 1, c.hidden_size), c.dtype)
        pos = jnp.zeros((1, 1), jnp.int32)
        mask = jnp.ones((1, 1, 1), bool)
        mods = self.slot_modules("xla")  # as `Transformer._init_stack`: XLA ops under vmap

        def group(r):
            rs = jax.random.split(r, len(mods))
            return {
                layer_stack.slot_key(j): m.init(rs[j], x, pos, hybrid_inv_freq(c), None, mask)[
                    "params"
                ]
                for j, m in enumerate(mods)
            }

        return jax.vmap(group)(jax.random.split(rng, c.num_layers // c.layer_period))

    def _scan_groups(self, x, positions_BT, inv_freq, cache, tap_layers, mask, starts):
        """The stacked groups as one `lax.scan`: group g runs its slots' layers g * p + j in
        order, the full layers reading and writing the stacked K/V at their index, the linear
        layers their window and state slices. Returns the residual stream, the new (k, v)
        stacks or None, the pending block [L, B, T, ...] or None and the taps {layer: x}."""
        c = self.cfg
        p = c.layer_period
        groups = c.num_layers // p
        mods = self.slot_modules()
        lin = [j for j in range(p) if c.hybrid.is_linear(j)]
        full = [j for j in range(p) if not c.hybrid.is_linear(j)]
        tap_layers = tuple(tap_layers)
        slot_of = np.full((groups, p), -1, np.int32)
        for t, i in enumerate(tap_layers):
            slot_of[i // p, i % p] = t
        tapbuf = jnp.zeros((max(len(tap_layers), 1),) + x.shape, x.dtype)
        by_group = lambda a: a.reshape((groups, a.shape[0] // groups) + a.shape[1:])
        kv = conv = state = None
        if cache is not None:
            kv = (cache.kv.k, cache.kv.v)
            conv, state = by_group(cache.conv), by_group(cache.state)

        split = {j: split_experts(self.stack[layer_stack.slot_key(j)]) for j in range(p)}
        stripped = {layer_stack.slot_key(j): split[j][0] for j in range(p)}

        def body(carry, xs):
            x, kv, tapbuf = carry
            params, g, slots, conv_g, state_g = xs
            pending = []
            for j, mod in enumerate(mods):
                if j in lin:
                    s = lin.index(j)
                    lc = None if conv_g is None else (conv_g[s], state_g[s])
                else:
                    lc = None if kv is None else (kv[0], kv[1], g * len(full) + full.index(j))
                experts = split[j][1]
                x, new = mod.apply(
                    {"params": join_experts(params[layer_stack.slot_key(j)], experts)},
                    x,
                    positions_BT,
                    inv_freq,
                    lc,
                    mask,
                    starts,
                    None if experts is None else (g, groups),
                )
                if j in lin:
                    pending.append(new)
                elif kv is not None:
                    kv = new
                if tap_layers:
                    at = jnp.maximum(slots[j], 0)
                    keep = jax.lax.dynamic_index_in_dim(tapbuf, at, 0, keepdims=False)
                    tapbuf = jax.lax.dynamic_update_index_in_dim(
                        tapbuf, jnp.where(slots[j] >= 0, x, keep), at, 0
                    )
            ys = None
            if cache is not None:  # this group's pending blocks, slot by slot: 4 x [nl, ...]
                ys = tuple(jnp.stack([pd[m] for pd in pending]) for m in range(4))
            return (x, kv, tapbuf), ys

        xs = (stripped, jnp.arange(groups, dtype=jnp.int32), jnp.asarray(slot_of), conv, state)
        (x, kv, tapbuf), ys = jax.lax.scan(body, (x, kv, tapbuf), xs)
        pending = None
        if ys is not None:  # [G, nl, B, T, ...] -> [L, B, T, ...] in layer order
            pending = tuple(a.reshape((-1,) + a.shape[2:]) for a in ys)
        return x, kv, pending, {i: tapbuf[t] for t, i in enumerate(tap_layers)}

    def verify_tree(self, *args, **kwargs):
        raise ValueError(
            "draft trees (tree_budget) over a hybrid (Gated DeltaNet) target are not supported: "
            "a tree needs the recurrent state per path; use a chain"
        )

    def _layers(self, ids_BT, positions_BT, cache, tap_layers, mask, starts, tree_mask_BTT=None):
        if tree_mask_BTT is not None:
            self.verify_tree()
        c = self.cfg
        t = ids_BT.shape[1]
        inv_freq = hybrid_inv_freq(c)
        x = self.embed(ids_BT)
        if cache is not None and cache.pending is not None:
            raise ValueError("a HybridCache with a pending block: rollback() it first")
        if c.scans_layers:
            x, kv, pending, taps = self._scan_groups(
                x, positions_BT, inv_freq, cache, tap_layers, mask, starts
            )
            new_k, new_v = (None, None) if kv is None else kv
            return self._finish_hybrid(x, cache, new_k, new_v, pending, t, tap_layers, taps)
        taps, new_k, new_v, pending = {}, [], [], []
        fi = li = 0
        for i, layer in enumerate(self.layers):
            if cache is None:
                layer_cache = None
            elif c.hybrid.is_linear(i):
                layer_cache = (cache.conv[li], cache.state[li])
            else:
                layer_cache = (cache.kv.k[fi], cache.kv.v[fi])
            split = cache is not None and cache.kv.seq_split
            x, new = layer(x, positions_BT, inv_freq, layer_cache, mask, starts, seq_split=split)
            if c.hybrid.is_linear(i):
                pending.append(new)
                li += 1
            else:
                if cache is not None:
                    new_k.append(new[0])
                    new_v.append(new[1])
                fi += 1
            if i in tap_layers:
                taps[i] = x
        return self._finish_hybrid(
            x, cache, tuple(new_k), tuple(new_v), tuple(pending), t, tap_layers, taps
        )

    def _finish_hybrid(self, x, cache, new_k, new_v, pending, t, tap_layers, taps):
        """The final norm, the cache with its new K/V, lengths and pending block, the taps."""
        if self.is_initializing() and not self.cfg.tie_word_embeddings:
            self.lm_head(x)
        hidden = self.norm(x)
        new_cache = None
        if cache is not None:
            kv = cache.kv.replace(k=new_k, v=new_v, lengths=cache.lengths + t)
            new_cache = cache.replace(kv=kv, pending=pending, base=cache.lengths)
        tap_out = None
        if tap_layers:
            tap_out = jnp.concatenate([taps[i] for i in tap_layers], axis=-1)
        return hidden, new_cache, tap_out

    def taps(
        self, input_ids_BT, tap_layers, positions_BT=None, segment_ids_BT=None, attn_chunk=512
    ):
        """The frozen target pass of drafter training: taps [B, T, n*H] of one sequence per row
        (packed rows are refused: the recurrent state would run across documents)."""
        if segment_ids_BT is not None:
            raise ValueError(
                "packed training rows (segment_ids) over a hybrid (Gated DeltaNet) target are "
                "not supported: the recurrent state would run across documents"
            )
        tap_layers = tuple(tap_layers)
        b, t = input_ids_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
        mask = positions_BT[:, None, :] <= positions_BT[:, :, None]
        return self._layers(input_ids_BT, positions_BT, None, tap_layers, mask, None)[2]
