"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU, attention.

Shapes use the letters B (batch), T (query length), S (key length / cache capacity),
H (hidden width), N (query heads), K (key/value heads), G = N // K, D (head dim).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.models.config import ModelConfig

# The one XLA masked GQA attention lives with the kernels it checks (the library imports the
# kernel package, never the reverse).
from pallas_kernels.reference import gqa_attention as masked_attention  # noqa: F401


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in float32 (as Hugging Face Qwen3/Llama do)."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # HF casts back to the input dtype before the scale multiply.
        return (scale.astype(self.dtype) * x32.astype(self.dtype)).astype(self.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jnp.ndarray:
    """Inverse frequencies [D/2] in float32, with "linear" or "llama3" scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    scaling = cfg.rope_scaling_dict
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, blended, scaled)
    raise ValueError(f"unsupported rope_type {kind!r}")


def apply_rope(x_BTnD: jnp.ndarray, positions_BT: jnp.ndarray, inv_freq: jnp.ndarray):
    """Rotates x [B,T,n,D] by its absolute positions [B,T] (half-split layout, as HF)."""
    angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B,T,D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x = x_BTnD.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTnD.dtype)


def _compiling_for_gpu() -> bool:
    """Whether the program being traced is compiled for a GPU (the devices of
    `pallas_kernels.backend.compiling_for`, else the default backend)."""
    try:
        from pallas_kernels import backend  # lazily: the library works without the kernels
    except ImportError:
        return jax.default_backend() in ("gpu", "cuda", "rocm")
    return backend._is_gpu(backend._platform())


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`jax.lax.dot_general` for the decoder's linears (x [..., in] @ kernel [in, out]), with a
    one-row x padded to two rows (then sliced back) when compiling for a GPU.

    Why: XLA:GPU's algebraic simplifier rewrites a matrix-vector dot whose operands are small
    (under 1M elements in total: SmolLM2's 576 x 1536 MLP weights are 885K) into a broadcast
    multiply and a reduction, and fusion then writes the [in, out] product to HBM and reads it
    back: each weight moved about 4 times a batch-1 decode step (SmolLM2's AR loop at 2.6x its
    HBM floor on an H200). Two rows make the left operand a matrix, which goes to a GEMM that
    reads the weight once. Same values: the extra row is zeros and is dropped
    (tests/test_layers.py against the plain dot; tests/test_gpu_compile.py the compiled loop).
    """
    (lc, _), (lb, _) = dimension_numbers
    kw = dict(precision=precision, preferred_element_type=preferred_element_type)
    one_row = lhs.ndim >= 1 and not lb and lc == (lhs.ndim - 1,) and lhs.size == lhs.shape[-1]
    if not (one_row and _compiling_for_gpu()):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, **kw)
    return pad_row_dot(lhs, rhs, dimension_numbers, **kw)


def pad_row_dot(lhs, rhs, dimension_numbers, **kw):
    """lhs [..., in] (one row) @ rhs through a [2, in] left operand whose second row is zero."""
    row = lhs.reshape(1, lhs.shape[-1])
    two = jnp.concatenate([row, jnp.zeros_like(row)], axis=0)
    (_, rc), _ = dimension_numbers
    out = jax.lax.dot_general(two, rhs, (((1,), rc), ((), ())), **kw)
    return out[:1].reshape(*lhs.shape[:-1], *out.shape[1:])


class Int8Dense(nn.Module):
    """A Dense layer with an int8 kernel [in, out] and a float32 scale per output channel
    (`kernel_scale` [out]): y = (x @ kernel.astype(dtype)) * scale (+ bias), weight-only.

    The convert of the int8 kernel sits next to the dot, so XLA fuses it into the matmul and
    the int8 bytes are what is read from memory (tests/test_quantized.py checks the compiled
    HLO); the scale multiplies the dot's output in float32, rounded once to the compute dtype.
    Why a module of our own and not qwix: `dflash_jax/models/quantization.py`.
    """

    features: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32  # of the bias; the kernel is int8, the scale float32

    @nn.compact
    def __call__(self, x):
        kernel = self.param(
            "kernel", nn.initializers.zeros_init(), (x.shape[-1], self.features), jnp.int8
        )
        scale = self.param("kernel_scale", nn.initializers.ones, (self.features,), jnp.float32)
        # The dot's output in the compute dtype, as nn.Dense's: under tensor parallelism its
        # partial sums are what is all-reduced (a float32 output doubled those bytes on TPU).
        y = dot_general(
            x.astype(self.dtype), kernel.astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ()))
        )
        y = y.astype(jnp.float32) * scale
        if self.use_bias:
            bias = self.param(
                "bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype
            )
            y = y + bias.astype(jnp.float32)
        return y.astype(self.dtype)


def linear(cfg: ModelConfig, features: int, name: str, use_bias: bool = False):
    """A decoder linear of `cfg`: `Int8Dense` when cfg.quantization == "int8", else nn.Dense."""
    if cfg.quantization == "int8":
        return Int8Dense(features, use_bias, cfg.dtype, cfg.param_dtype, name=name)
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        dot_general=dot_general,
        name=name,
    )


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        dense = lambda f, name: linear(c, f, name)
        h = nn.silu(dense(c.intermediate_size, "gate_proj")(x)) * dense(
            c.intermediate_size, "up_proj"
        )(x)
        return dense(c.hidden_size, "down_proj")(h)


class QKVProjection(nn.Module):
    """The q/k/v/o projections and the optional per-head q/k RMSNorm of one attention layer.

    Kept as one module so the target and the drafter share the parameter layout
    (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `q_norm`, `k_norm`) that both checkpoint formats use.
    """

    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        dense = lambda f, name: linear(c, f, name, c.attention_bias)
        self.q_proj = dense(c.num_heads * c.head_dim, "q_proj")
        self.k_proj = dense(c.num_kv_heads * c.head_dim, "k_proj")
        self.v_proj = dense(c.num_kv_heads * c.head_dim, "v_proj")
        self.o_proj = dense(c.hidden_size, "o_proj")
        if c.qk_norm:
            self.q_norm = RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype, name="q_norm")
            self.k_norm = RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype, name="k_norm")

    def queries(self, x_BTH, positions_BT, inv_freq):
        c = self.cfg
        q = self.q_proj(x_BTH).reshape(*x_BTH.shape[:2], c.num_heads, c.head_dim)
        if c.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q, positions_BT, inv_freq)

    def keys_values(self, x_BTH, positions_BT, inv_freq):
        c = self.cfg
        shape = (*x_BTH.shape[:2], c.num_kv_heads, c.head_dim)
        k = self.k_proj(x_BTH).reshape(shape)
        v = self.v_proj(x_BTH).reshape(shape)
        if c.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, positions_BT, inv_freq), v

    def output(self, attn_BTND):
        b, t = attn_BTND.shape[:2]
        return self.o_proj(attn_BTND.reshape(b, t, -1))

    def __call__(self, x_BTH, positions_BT, inv_freq):  # used by init only
        q = self.queries(x_BTH, positions_BT, inv_freq)
        k, v = self.keys_values(x_BTH, positions_BT, inv_freq)
        return self.output(q), k, v
