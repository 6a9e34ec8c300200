"""Model configuration shared by the target (Qwen3 / Llama-3) and the DFlash drafter.

One dataclass describes every family: Qwen3 and Llama differ only by switches (`qk_norm`,
RoPE scaling, tied embeddings, bias); MoE and hybrid targets add their fields. Conversion to and
from Hugging Face `config.json` dictionaries: `hf_config`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp

from dflash_jax.models import hf_config
from dflash_jax.models.hf_config import (  # noqa: F401  (models.config's names, as before)
    FULL,
    HYBRID_ARCHS,
    LINEAR,
    SUPPORTED_ARCHITECTURES,
    hybrid_layers,
)


_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


def as_dtype(name_or_dtype) -> jnp.dtype:
    """Maps "float32" / "bfloat16" / "float16" (or a dtype) to a jnp dtype, with a clear error."""
    if isinstance(name_or_dtype, str):
        if name_or_dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {name_or_dtype!r}; expected one of {sorted(_DTYPES)}")
        return jnp.dtype(_DTYPES[name_or_dtype])
    return jnp.dtype(name_or_dtype)


@dataclasses.dataclass(frozen=True)
class HybridSpec:
    """What a hybrid (Qwen3.5 / Qwen3.6) target adds to a transformer's config.

    layer_types: per layer, "linear_attention" (a Gated DeltaNet) or "full_attention" (gated
      attention: a sigmoid output gate from a doubled q_proj, QK-norm, partial rotary).
    linear_*: the Gated DeltaNet's key / value heads and head widths and its depthwise causal
      convolution's kernel (over the concatenated q, k, v channels).
    partial_rotary_factor: the share of each full-attention head that is rotated.
    shared_expert_intermediate_size: the MoE variant's shared expert (0: none).
    """

    layer_types: tuple
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    shared_expert_intermediate_size: int = 0

    def __post_init__(self):
        bad = [t for t in self.layer_types if t not in (LINEAR, FULL)]
        if bad:
            raise ValueError(
                f"layer_types: unknown layer type {bad[0]!r}; expected {LINEAR!r} or {FULL!r}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.linear_conv_kernel_dim < 1:
            raise ValueError("linear_conv_kernel_dim must be >= 1")

    def is_linear(self, i: int) -> bool:
        return self.layer_types[i] == LINEAR

    @property
    def full_layers(self) -> tuple:
        """The full-attention layers (the ones with a K/V cache), in order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layers(self) -> tuple:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q and k (key heads x key width each) and v."""
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer (target or drafter body).

    Attributes:
      arch: "qwen3" or "llama" (informational; behaviour comes from the switches below).
      vocab_size: rows of the embedding table.
      hidden_size: residual width H.
      intermediate_size: SwiGLU width.
      num_layers: decoder layers.
      num_heads: query heads.
      num_kv_heads: key/value heads (GQA when smaller than num_heads).
      head_dim: per-head width (Qwen3 reads it from config; not always H / heads).
      rms_norm_eps: RMSNorm epsilon.
      rope_theta: RoPE base.
      rope_scaling: None or a dict in Hugging Face form (`rope_type` "linear" or "llama3").
      qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
      attention_bias: bias on q/k/v/o projections.
      tie_word_embeddings: LM head shares the embedding matrix.
      max_position_embeddings: the model's context length.
      dtype: compute dtype (float32 on CPU; bfloat16 on accelerators).
      param_dtype: storage dtype of the parameters.
      quantization: None, or "int8": the decoder linears (q/k/v/o, gate/up/down) hold int8
        kernels with a float32 scale per output channel (`layers.Int8Dense`, weight-only).
      quantize_lm_head: the (untied) LM head is int8 too.
      num_experts: 0 for a dense model; else the experts of each MoE layer (Qwen3-MoE).
      num_experts_per_tok: experts each token is routed to (top-k).
      moe_intermediate_size: SwiGLU width of one expert.
      decoder_sparse_step, mlp_only_layers: layer i is MoE iff i is not in mlp_only_layers
        and (i + 1) % decoder_sparse_step == 0 (the others are dense, `intermediate_size`).
      norm_topk_prob: the top-k router weights are divided by their sum.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    arch: str = "qwen3"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Optional[tuple] = None  # a frozen (sorted items) form of the HF dict
    qk_norm: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    quantization: Optional[str] = None
    quantize_lm_head: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    norm_topk_prob: bool = False
    hybrid: Optional[HybridSpec] = None  # a Qwen3.5-style hybrid target (`models/hybrid.py`)
    # The layer stack's layout (`models/layer_stack.py`), not part of the model: the decoder
    # layers' parameters stacked on a leading layer axis and run by one `lax.scan`, so a
    # program compiles one layer body (a hybrid target: one group of its pattern) whatever the
    # depth. Honoured where the layers repeat (`scans_layers`); checkpoints keep their
    # per-layer names either way.
    scan_layers: bool = False

    def __post_init__(self):
        if self.hybrid is not None:
            if len(self.hybrid.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.hybrid.layer_types)} entries for "
                    f"num_hidden_layers={self.num_layers}"
                )
            if self.quantization is not None:
                raise ValueError(
                    "int8 quantization of hybrid (Gated DeltaNet) targets is not supported yet "
                    "(quantization_config / --quantize: load it unquantized)"
                )
            rot = int(self.head_dim * self.hybrid.partial_rotary_factor)
            if rot < 2 or rot % 2:
                raise ValueError(
                    f"partial_rotary_factor={self.hybrid.partial_rotary_factor} x head_dim="
                    f"{self.head_dim} gives {rot} rotary dims; it must be an even number >= 2"
                )
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                    f"[1, num_experts={self.num_experts}]"
                )
            if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
                raise ValueError("moe_intermediate_size and decoder_sparse_step must be >= 1")
            if self.quantization is not None:
                raise ValueError(
                    "int8 quantization of mixture-of-experts targets is not supported "
                    "(load it unquantized)"
                )
        if self.quantization not in (None, "int8"):
            raise ValueError(f"unsupported quantization {self.quantization!r}; supported: int8")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs quantization='int8'")
        if self.quantize_lm_head and self.tie_word_embeddings:
            raise ValueError(
                "quantize_lm_head needs an untied LM head; this model's head is tied (it is "
                "the embedding table, kept in the parameter dtype)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def is_hybrid(self) -> bool:
        return self.hybrid is not None

    @property
    def rotary_dim(self) -> int:
        """The rotated width of each attention head (all of it but on hybrids)."""
        if self.hybrid is None:
            return self.head_dim
        return int(self.head_dim * self.hybrid.partial_rotary_factor)

    @property
    def num_kv_layers(self) -> int:
        """Layers with a K/V cache: every layer, or a hybrid's full-attention ones."""
        return self.num_layers if self.hybrid is None else len(self.hybrid.full_layers)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def layer_period(self) -> int:
        """The layers' repeating pattern: the smallest p dividing `num_layers` such that layer
        i has the structure of layer i % p (the same attention kind, the same feed-forward).
        1 for a dense target or experts in every layer; 4 for Qwen3.5 / 3.6's three Gated
        DeltaNet layers and one gated attention layer; `num_layers` when nothing repeats."""

        def kind(i):
            linear = self.hybrid is not None and self.hybrid.is_linear(i)
            return (linear, self.layer_is_moe(i))

        n = self.num_layers
        for p in range(1, n + 1):
            if n % p == 0 and all(kind(i) == kind(i % p) for i in range(n)):
                return p
        return n

    @property
    def scans_layers(self) -> bool:
        """The decoder layers run as one `lax.scan` over stacked parameters: `scan_layers`
        asked for it and the layers repeat (`layer_period`): a dense target or experts in every
        layer scans one layer (period 1); a hybrid one scans groups of its period (slot j of
        every group stacked: `layer_stack`). A layer pattern that does not repeat at least
        twice, or a dense target with experts in some layers only, runs the loop."""
        if not self.scan_layers or self.num_layers < 2:
            return False
        p = self.layer_period
        if self.hybrid is None:
            return p == 1
        return self.num_layers // p >= 2

    def layer_is_moe(self, i: int) -> bool:
        """Layer i's feed-forward is a mixture of experts (transformers' Qwen3-MoE rule)."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def dense(self) -> "ModelConfig":
        """This config without its experts (every layer dense): a drafter body's base."""
        return dataclasses.replace(
            self,
            num_experts=0,
            num_experts_per_tok=0,
            moe_intermediate_size=0,
            decoder_sparse_step=1,
            mlp_only_layers=(),
            norm_topk_prob=False,
            hybrid=None,
            scan_layers=False,
        )

    @property
    def rope_scaling_dict(self) -> Optional[dict]:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ HF conversion

    @classmethod
    def from_hf(
        cls, hf: dict, *, dtype="float32", param_dtype=None, source: str = "config.json"
    ) -> "ModelConfig":
        """Builds a config from a Hugging Face `config.json` dict (transformers 4.x or 5.x);
        every field read is checked (`hf_config`): one ValueError naming `source`. A hybrid
        (Qwen3.5 / Qwen3.6) config: its text model's fields plus the hybrid layout."""
        arch = hf_config.architecture(hf, source)
        kw = dict(arch=arch, dtype=dtype, param_dtype=param_dtype, source=source)
        if arch not in HYBRID_ARCHS:
            return cls.from_hf_fields(hf, **kw)
        text, factor = hf_config.hybrid_text(hf, arch, source)
        base = cls.from_hf_fields(text, **kw)
        spec, moe = hf_config.hybrid_layout(text, arch, base.num_layers, factor, source)
        try:
            return base.replace(qk_norm=True, hybrid=HybridSpec(**spec), **moe)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_hf_fields(cls, hf: dict, *, arch: str, dtype, param_dtype, source: str):
        """The config of a config.json's fields as family `arch` reads them
        (`hf_config.field_values`; also a drafter config's body)."""
        values = hf_config.field_values(hf, arch, source)
        dt = as_dtype(dtype)
        pdt = as_dtype(param_dtype) if param_dtype is not None else dt
        return cls(**values, dtype=dt, param_dtype=pdt)

    def to_hf(self, torch_dtype: str = "bfloat16") -> dict:
        """The Hugging Face `config.json` dict for this model (transformers 4.x/5.x readable)."""
        return hf_config.config_to_hf(self, torch_dtype)
