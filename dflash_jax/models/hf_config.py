"""The Hugging Face `config.json` side of `ModelConfig` (transformers 4.x and 5.x; the dense,
MoE and hybrid target families, and the body of a drafter's config): the fields read from a
dict, each checked (one ValueError naming the file and the field), and the dict written back.
`ModelConfig.from_hf` / `to_hf` build on these; this module knows the config only by its
attributes."""

from __future__ import annotations

import math

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


def hybrid_layers(num_layers: int, full_every: int = 4) -> tuple:
    """Qwen3.5's default layer kinds: every `full_every`-th layer full attention, the rest
    Gated DeltaNets (transformers' `full_attention_interval`)."""
    return tuple(LINEAR if (i + 1) % full_every else FULL for i in range(num_layers))


# Mixture-of-experts fields of other families that this code does not implement: a config
# that sets one (to a value that matters) is refused, one line naming the field.
_UNSUPPORTED_MOE_FIELDS = (
    ("shared_expert_intermediate_size", "a shared expert (Qwen2-MoE style)"),
    ("n_shared_experts", "shared experts"),
    ("num_shared_experts", "shared experts"),
    ("moe_shared_expert_intermediate_size", "a shared expert"),
)
_ARCH_NAMES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
_ARCH_NAMES["qwen3_moe"] = "Qwen3MoeForCausalLM"


class _Fields:
    """The fields of one config.json dict, each read with its check (as the CLI flags are
    checked; `support.checks` imports this package, so the rules are stated here)."""

    def __init__(self, hf: dict, source: str):
        self.hf, self.source = hf, source

    def need(self, key):
        if key not in self.hf:
            raise ValueError(f"{self.source}: missing required field {key!r}")
        return self.hf[key]

    def pos_int(self, key, value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"{self.source}: {key} must be an integer, got {repr(value)[:60]} "
                f"({type(value).__name__})"
            )
        if value < 1:
            raise ValueError(f"{self.source}: {key} must be >= 1, got {value}")
        return value

    def pos_float(self, key, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"{self.source}: {key} must be a number, got {repr(value)[:60]} "
                f"({type(value).__name__})"
            )
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{self.source}: {key} must be a finite number > 0, got {value}")
        return float(value)

    def flag(self, key, default):
        value = self.hf.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ValueError(f"{self.source}: {key} must be true or false, got {value!r}")
        return value

    def table(self, key):
        value = self.hf.get(key)
        if value is not None and not isinstance(value, dict):
            raise ValueError(
                f"{self.source}: {key} must be an object or null, got {type(value).__name__}"
            )
        return value


def architecture(hf: dict, source: str) -> str:
    """The family of a config.json: its `architectures` (or, without them, `model_type`)."""
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
    return arch


def hybrid_text(hf: dict, arch: str, source: str):
    """(the text model's config dict, its partial_rotary_factor) of a Qwen3.5 / Qwen3.6
    config.json: the fields under `text_config` in the published vision-language configs,
    tie_word_embeddings from the top level when the text model does not say."""
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
    return text, float(factor)


def hybrid_layout(text: dict, arch: str, num_layers: int, factor: float, source: str):
    """(HybridSpec's fields, the ModelConfig MoE fields) of a hybrid text config: its layer
    kinds (`layer_types`, or every full_attention_interval-th layer full attention), the
    Gated DeltaNet sizes, and a Qwen3.5-MoE's experts and shared expert."""
    n = num_layers
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
    spec = dict(layer_types=tuple(types), partial_rotary_factor=factor)
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
        spec[key] = value
    moe, shared = _hybrid_moe(text, source) if arch == "qwen3_5_moe" else ({}, 0)
    spec["shared_expert_intermediate_size"] = shared
    return spec, moe


def _hybrid_moe(text: dict, source: str):
    """(the ModelConfig MoE fields, the shared expert's width) of a Qwen3.5-MoE text config."""
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
        raise ValueError(f"{source}: shared_expert_intermediate_size must be an integer >= 0")
    moe = dict(
        num_experts=text["num_experts"],
        num_experts_per_tok=text["num_experts_per_tok"],
        moe_intermediate_size=text["moe_intermediate_size"],
        norm_topk_prob=True,  # the Qwen3.5 router always renormalizes its top-k
    )
    return moe, shared


def field_values(hf: dict, arch: str, source: str) -> dict:
    """ModelConfig's fields of a config.json dict (all but the dtypes), each checked as the
    CLI flags are (positive integers, finite positive numbers, booleans, heads divisible by
    key/value heads): a bad value is one ValueError naming `source` and the field."""
    if not isinstance(hf, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(hf).__name__}")
    f = _Fields(hf, source)
    hidden, heads, kv, head_dim = _attention_shape(f)
    rope_theta, scaling = _rope(f)
    max_pos = hf.get("max_position_embeddings")
    moe = _moe_fields(f) if arch == "qwen3_moe" else {}
    # FP8 checkpoints are dequantized at load (a plain model); int8 ones stay int8.
    quant = parse_quantization_config(hf, source)
    int8 = quant is not None and quant.method == INT8_METHOD
    return dict(
        arch=arch,
        vocab_size=f.pos_int("vocab_size", f.need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=f.pos_int("intermediate_size", f.need("intermediate_size")),
        num_layers=f.pos_int("num_hidden_layers", f.need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=f.pos_float("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=None if scaling is None else tuple(sorted(scaling.items())),
        qk_norm=(arch in ("qwen3", "qwen3_moe")),
        attention_bias=f.flag("attention_bias", False),
        tie_word_embeddings=f.flag("tie_word_embeddings", arch == "qwen3"),
        max_position_embeddings=40960
        if max_pos is None
        else f.pos_int("max_position_embeddings", max_pos),
        quantization="int8" if int8 else None,
        quantize_lm_head=bool(int8 and quant.lm_head),
        **moe,
    )


def _attention_shape(f: _Fields):
    """(hidden_size, heads, key/value heads, head_dim), checked against each other."""
    source, hf = f.source, f.hf
    hidden = f.pos_int("hidden_size", f.need("hidden_size"))
    heads = f.pos_int("num_attention_heads", f.need("num_attention_heads"))
    kv = hf.get("num_key_value_heads")
    kv = heads if kv is None else f.pos_int("num_key_value_heads", kv)
    if heads % kv:
        raise ValueError(
            f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}"
        )
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"{source}: hidden_size={hidden} is not a multiple of "
                f"num_attention_heads={heads} (and there is no head_dim)"
            )
        head_dim = hidden // heads
    head_dim = f.pos_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"{source}: head_dim must be even for RoPE, got {head_dim}")
    return hidden, heads, kv, head_dim


def _rope(f: _Fields):
    """(rope_theta, the RoPE scaling dict or None): transformers 5.x moves rope_theta and
    rope_scaling into `rope_parameters`; "default" scaling is none."""
    source, hf = f.source, f.hf
    rope_params = f.table("rope_parameters") or {}
    rope_theta = f.pos_float(
        "rope_theta", hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    )
    scaling = f.table("rope_scaling")
    if scaling is None and rope_params:
        rtype = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rtype != "default":
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if scaling is None:
        return rope_theta, None
    scaling = dict(scaling)
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    scaling["rope_type"] = rtype
    scaling.pop("type", None)
    if rtype == "default":
        return rope_theta, None
    if rtype not in ("linear", "llama3"):
        raise ValueError(
            f"{source}: unsupported rope_scaling type {rtype!r}; supported: default, linear, llama3"
        )
    f.pos_float("rope_scaling.factor", scaling.get("factor"))
    for key in ("low_freq_factor", "high_freq_factor"):
        if rtype == "llama3" and key in scaling:
            f.pos_float(f"rope_scaling.{key}", scaling[key])
    if rtype == "llama3" and "original_max_position_embeddings" in scaling:
        f.pos_int(
            "rope_scaling.original_max_position_embeddings",
            scaling["original_max_position_embeddings"],
        )
    return rope_theta, scaling


def _moe_fields(f: _Fields) -> dict:
    """The Qwen3-MoE fields of a config.json (each checked; transformers 5 writes
    `num_local_experts` for `num_experts`), and one line for a feature not implemented."""
    hf, source = f.hf, f.source
    for key, what in _UNSUPPORTED_MOE_FIELDS:
        if hf.get(key):
            raise ValueError(
                f"{source}: {key}={hf[key]!r}: {what} is not supported (Qwen3-MoE has none)"
            )
    key = "num_experts" if "num_experts" in hf else "num_local_experts"
    if key not in hf:
        raise ValueError(f"{source}: missing required field 'num_experts'")
    experts = f.pos_int(key, hf[key])
    top_k = f.pos_int("num_experts_per_tok", hf.get("num_experts_per_tok"))
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
        moe_intermediate_size=f.pos_int("moe_intermediate_size", hf.get("moe_intermediate_size")),
        decoder_sparse_step=f.pos_int("decoder_sparse_step", hf.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(sorted(set(only))),
        norm_topk_prob=f.flag("norm_topk_prob", False),
    )


def _hf_common(cfg, torch_dtype: str) -> dict:
    """The config.json fields every target family writes the same way."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "torch_dtype": torch_dtype,
        "use_cache": True,
    }


def _moe_hf(cfg) -> dict:
    return dict(
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
    )


def config_to_hf(cfg, torch_dtype: str = "bfloat16") -> dict:
    """`ModelConfig.to_hf`: the Hugging Face `config.json` dict (transformers 4.x/5.x)."""
    if cfg.hybrid is not None:
        return _hybrid_to_hf(cfg, torch_dtype)
    out = {
        "architectures": [_ARCH_NAMES[cfg.arch]],
        "model_type": cfg.arch,
        **_hf_common(cfg, torch_dtype),
        "intermediate_size": cfg.intermediate_size,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling_dict,
    }
    if cfg.arch == "llama":
        out["mlp_bias"] = False
        out["pretraining_tp"] = 1
    else:
        out["use_sliding_window"] = False
        out["sliding_window"] = None
        out["max_window_layers"] = cfg.num_layers
    if cfg.arch == "qwen3_moe":
        out.update(
            **_moe_hf(cfg),
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
            norm_topk_prob=cfg.norm_topk_prob,
            output_router_logits=False,
        )
    if cfg.quantization is not None:
        out["quantization_config"] = quantization_config(cfg.quantize_lm_head)
    return out


def _hybrid_to_hf(cfg, torch_dtype: str) -> dict:
    """A hybrid target's config.json, as transformers' `Qwen3_5ForCausalLM` /
    `Qwen3_5MoeForCausalLM` (the text model) writes it."""
    h = cfg.hybrid
    moe = cfg.arch == "qwen3_5_moe"
    out = {
        "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        **_hf_common(cfg, torch_dtype),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
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
            **_moe_hf(cfg), shared_expert_intermediate_size=h.shared_expert_intermediate_size
        )
    else:
        out["intermediate_size"] = cfg.intermediate_size
    return out
