"""Model configuration shared by the verifier (Qwen3 / Llama-3) and the DFlash drafter.

One dataclass describes both families: Qwen3 and Llama differ only by switches
(`qk_norm`, RoPE scaling, tied embeddings, bias). Conversion to and from Hugging Face
`config.json` dictionaries lives here too, so that the reader of `checkpoint.py` finds only
tensor plumbing there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax.numpy as jnp

from dflash_jax.models.quantization import (
    INT8_METHOD,
    parse_quantization_config,
    quantization_config,
)

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # Hybrid targets (`models/hybrid.py`): Gated DeltaNet and gated-attention layers. The
    # published checkpoints are the vision-language models; their text model is what loads.
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe")
LINEAR, FULL = "linear_attention", "full_attention"
# Mixture-of-experts fields of other families that this code does not implement: a config
# that sets one (to a value that matters) is refused, one line naming the field.
_UNSUPPORTED_MOE_FIELDS = (
    ("shared_expert_intermediate_size", "a shared expert (Qwen2-MoE style)"),
    ("n_shared_experts", "shared experts"),
    ("num_shared_experts", "shared experts"),
    ("moe_shared_expert_intermediate_size", "a shared expert"),
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


def hybrid_layers(num_layers: int, full_every: int = 4) -> tuple:
    """Qwen3.5's default layer kinds: every `full_every`-th layer full attention, the rest
    Gated DeltaNets (transformers' `full_attention_interval`)."""
    return tuple(LINEAR if (i + 1) % full_every else FULL for i in range(num_layers))


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
    """Hyper-parameters of a decoder-only transformer (verifier or drafter body).

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
        every field read is checked (`_from_hf_fields`): one ValueError naming `source`."""
        if not isinstance(hf, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(hf).__name__}")
        archs = hf.get("architectures") or []
        if not isinstance(archs, list):
            archs = [archs]
        arch = None
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                arch = SUPPORTED_ARCHITECTURES[a]
        if arch is None:
            model_type = hf.get("model_type")
            if model_type in ("qwen3", "llama", "qwen3_moe") and not archs:
                arch = model_type
            elif not archs and model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
                arch = model_type[: -len("_text")]
            else:
                raise ValueError(
                    f"{source}: unsupported architecture {archs or model_type!r}; supported: "
                    f"{sorted(SUPPORTED_ARCHITECTURES)}"
                )
        if arch in HYBRID_ARCHS:
            return cls._from_hybrid_hf(
                hf, arch=arch, dtype=dtype, param_dtype=param_dtype, source=source
            )
        return cls._from_hf_fields(
            hf, arch=arch, dtype=dtype, param_dtype=param_dtype, source=source
        )

    @classmethod
    def _from_hybrid_hf(cls, hf: dict, *, arch: str, dtype, param_dtype, source: str):
        """A Qwen3.5 / Qwen3.6 config.json: the text model's fields (under `text_config` in
        the published vision-language configs), each checked, plus the hybrid layout."""
        text = hf.get("text_config", hf)
        if not isinstance(text, dict):
            raise ValueError(f"{source}: text_config must be an object, got {type(text).__name__}")
        text = dict(text)
        if "tie_word_embeddings" not in text and "tie_word_embeddings" in hf:
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        text.setdefault("tie_word_embeddings", False)
        if arch == "qwen3_5_moe":  # every layer is routed; the dense width is the shared expert's
            text.setdefault("intermediate_size", text.get("shared_expert_intermediate_size"))
        rope = text.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"{source}: rope_parameters must be an object")
        factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ValueError(f"{source}: partial_rotary_factor must be in (0, 1], got {factor!r}")
        base = cls._from_hf_fields(
            text, arch=arch, dtype=dtype, param_dtype=param_dtype, source=source
        )
        n = base.num_layers
        types = text.get("layer_types")
        if types is None:
            every = text.get("full_attention_interval", 4)
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise ValueError(f"{source}: full_attention_interval must be an integer >= 1")
            types = list(hybrid_layers(n, every))
        if not isinstance(types, list) or len(types) != n:
            raise ValueError(
                f"{source}: layer_types must be a list of {n} entries (num_hidden_layers), "
                f"got {repr(types)[:80]}"
            )
        ints = {}
        for key, default in (
            ("linear_num_key_heads", 16),
            ("linear_num_value_heads", 32),
            ("linear_key_head_dim", 128),
            ("linear_value_head_dim", 128),
            ("linear_conv_kernel_dim", 4),
        ):
            value = text.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{source}: {key} must be an integer >= 1, got {value!r}")
            ints[key] = value
        moe = {}
        shared = 0
        if arch == "qwen3_5_moe":
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                value = text.get(key)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{source}: {key} must be an integer >= 1, got {value!r}")
            if text["num_experts_per_tok"] > text["num_experts"]:
                raise ValueError(
                    f"{source}: num_experts_per_tok={text['num_experts_per_tok']} > "
                    f"num_experts={text['num_experts']}"
                )
            shared = text.get("shared_expert_intermediate_size") or 0
            if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
                raise ValueError(
                    f"{source}: shared_expert_intermediate_size must be an integer >= 0"
                )
            moe = dict(
                num_experts=text["num_experts"],
                num_experts_per_tok=text["num_experts_per_tok"],
                moe_intermediate_size=text["moe_intermediate_size"],
                norm_topk_prob=True,  # the Qwen3.5 router always renormalizes its top-k
            )
        try:
            spec = HybridSpec(
                layer_types=tuple(types),
                partial_rotary_factor=float(factor),
                shared_expert_intermediate_size=shared,
                **ints,
            )
            return base.replace(qk_norm=True, hybrid=spec, **moe)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def _from_hf_fields(cls, hf: dict, *, arch: str, dtype, param_dtype, source: str):
        """The fields this code reads, each checked as the CLI flags are (positive integers,
        finite positive numbers, booleans, heads divisible by key/value heads): a bad value
        is one ValueError naming `source` and the field."""
        if not isinstance(hf, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(hf).__name__}")

        def need(key):
            if key not in hf:
                raise ValueError(f"{source}: missing required field {key!r}")
            return hf[key]

        def pos_int(key, value):  # as validation.int_param(lo=1), which imports this module
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"{source}: {key} must be an integer, got {repr(value)[:60]} ({type(value).__name__})"
                )
            if value < 1:
                raise ValueError(f"{source}: {key} must be >= 1, got {value}")
            return value

        def pos_float(key, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(
                    f"{source}: {key} must be a number, got {repr(value)[:60]} ({type(value).__name__})"
                )
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{source}: {key} must be a finite number > 0, got {value}")
            return float(value)

        def flag(key, default):
            value = hf.get(key, default)
            if value is None:
                return default
            if not isinstance(value, bool):
                raise ValueError(f"{source}: {key} must be true or false, got {value!r}")
            return value

        def table(key):
            value = hf.get(key)
            if value is not None and not isinstance(value, dict):
                raise ValueError(
                    f"{source}: {key} must be an object or null, got {type(value).__name__}"
                )
            return value

        hidden = pos_int("hidden_size", need("hidden_size"))
        heads = pos_int("num_attention_heads", need("num_attention_heads"))
        kv = hf.get("num_key_value_heads")
        kv = heads if kv is None else pos_int("num_key_value_heads", kv)
        if heads % kv:
            raise ValueError(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv}"
            )
        head_dim = hf.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(
                    f"{source}: hidden_size={hidden} is not a multiple of "
                    f"num_attention_heads={heads} (and there is no head_dim)"
                )
            head_dim = hidden // heads
        head_dim = pos_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"{source}: head_dim must be even for RoPE, got {head_dim}")
        # transformers 5.x moves rope_theta / rope_scaling into `rope_parameters`.
        rope_params = table("rope_parameters") or {}
        rope_theta = pos_float(
            "rope_theta", hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        )
        scaling = table("rope_scaling")
        if scaling is None and rope_params:
            rtype = rope_params.get("rope_type", rope_params.get("type", "default"))
            if rtype != "default":
                scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = dict(scaling)
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            scaling["rope_type"] = rtype
            scaling.pop("type", None)
            if rtype == "default":
                scaling = None
            elif rtype not in ("linear", "llama3"):
                raise ValueError(
                    f"{source}: unsupported rope_scaling type {rtype!r}; "
                    "supported: default, linear, llama3"
                )
            else:
                pos_float("rope_scaling.factor", scaling.get("factor"))
                for key in ("low_freq_factor", "high_freq_factor"):
                    if rtype == "llama3" and key in scaling:
                        pos_float(f"rope_scaling.{key}", scaling[key])
                if rtype == "llama3" and "original_max_position_embeddings" in scaling:
                    pos_int(
                        "rope_scaling.original_max_position_embeddings",
                        scaling["original_max_position_embeddings"],
                    )
        max_pos = hf.get("max_position_embeddings")
        moe = {}
        if arch == "qwen3_moe":
            moe = cls._moe_fields(hf, source, pos_int, flag)
        dt = as_dtype(dtype)
        # FP8 checkpoints are dequantized at load (a plain model); int8 ones stay int8.
        quant = parse_quantization_config(hf, source)
        int8 = quant is not None and quant.method == INT8_METHOD
        return cls(
            arch=arch,
            vocab_size=pos_int("vocab_size", need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=pos_int("intermediate_size", need("intermediate_size")),
            num_layers=pos_int("num_hidden_layers", need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            rms_norm_eps=pos_float("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=None if scaling is None else tuple(sorted(scaling.items())),
            qk_norm=(arch in ("qwen3", "qwen3_moe")),
            attention_bias=flag("attention_bias", False),
            tie_word_embeddings=flag("tie_word_embeddings", arch == "qwen3"),
            max_position_embeddings=40960
            if max_pos is None
            else pos_int("max_position_embeddings", max_pos),
            dtype=dt,
            param_dtype=as_dtype(param_dtype) if param_dtype is not None else dt,
            quantization="int8" if int8 else None,
            quantize_lm_head=bool(int8 and quant.lm_head),
            **moe,
        )

    @staticmethod
    def _moe_fields(hf: dict, source: str, pos_int, flag) -> dict:
        """The Qwen3-MoE fields of a config.json (each checked; transformers 5 writes
        `num_local_experts` for `num_experts`), and one line for a feature not implemented."""
        for key, what in _UNSUPPORTED_MOE_FIELDS:
            if hf.get(key):
                raise ValueError(
                    f"{source}: {key}={hf[key]!r}: {what} is not supported (Qwen3-MoE has none)"
                )
        key = "num_experts" if "num_experts" in hf else "num_local_experts"
        if key not in hf:
            raise ValueError(f"{source}: missing required field 'num_experts'")
        experts = pos_int(key, hf[key])
        top_k = pos_int("num_experts_per_tok", hf.get("num_experts_per_tok"))
        if top_k > experts:
            raise ValueError(f"{source}: num_experts_per_tok={top_k} > {key}={experts}")
        only = hf.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in only
        ):
            raise ValueError(
                f"{source}: mlp_only_layers must be a list of layer numbers, got {only!r}"[:200]
            )
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=pos_int("moe_intermediate_size", hf.get("moe_intermediate_size")),
            decoder_sparse_step=pos_int("decoder_sparse_step", hf.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(sorted(set(only))),
            norm_topk_prob=flag("norm_topk_prob", False),
        )

    def _hf_common(self, torch_dtype: str) -> dict:
        """The config.json fields every target family writes the same way."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": torch_dtype,
            "use_cache": True,
        }

    def _moe_hf(self) -> dict:
        return dict(
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
        )

    def to_hf(self, torch_dtype: str = "bfloat16") -> dict:
        """The Hugging Face `config.json` dict for this model (transformers 4.x/5.x readable)."""
        if self.hybrid is not None:
            return self._hybrid_to_hf(torch_dtype)
        arch_name = {
            "qwen3": "Qwen3ForCausalLM",
            "llama": "LlamaForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
        }[self.arch]
        out = {
            "architectures": [arch_name],
            "model_type": self.arch,
            **self._hf_common(torch_dtype),
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
        }
        if self.arch == "llama":
            out["mlp_bias"] = False
            out["pretraining_tp"] = 1
        else:
            out["use_sliding_window"] = False
            out["sliding_window"] = None
            out["max_window_layers"] = self.num_layers
        if self.arch == "qwen3_moe":
            out.update(
                **self._moe_hf(),
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                norm_topk_prob=self.norm_topk_prob,
                output_router_logits=False,
            )
        if self.quantization is not None:
            out["quantization_config"] = quantization_config(self.quantize_lm_head)
        return out

    def _hybrid_to_hf(self, torch_dtype: str) -> dict:
        """A hybrid target's config.json, as transformers' `Qwen3_5ForCausalLM` /
        `Qwen3_5MoeForCausalLM` (the text model) writes it."""
        h = self.hybrid
        moe = self.arch == "qwen3_5_moe"
        out = {
            "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
            **self._hf_common(torch_dtype),
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": h.partial_rotary_factor,
            },
            "layer_types": list(h.layer_types),
            "linear_num_key_heads": h.linear_num_key_heads,
            "linear_num_value_heads": h.linear_num_value_heads,
            "linear_key_head_dim": h.linear_key_head_dim,
            "linear_value_head_dim": h.linear_value_head_dim,
            "linear_conv_kernel_dim": h.linear_conv_kernel_dim,
        }
        if moe:
            out.update(
                **self._moe_hf(),
                shared_expert_intermediate_size=h.shared_expert_intermediate_size,
            )
        else:
            out["intermediate_size"] = self.intermediate_size
        return out
