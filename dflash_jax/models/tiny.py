"""Tiny targets: the one factory of the small models that tests, toy configs and the dry run's
test presets build.

A model is written as plain fields (`ModelConfig`'s, with `hybrid` as `HybridSpec`'s whose
layer_types default to Qwen3.5's 3 : 1 pattern of the model's depth) and made by `from_fields`.
`tiny_fields(family, **changes)` is a family at test scale with the caller's changes:

    tiny_config()                                  64 x 64 Qwen3, 2 layers, 4 heads of 16
    tiny_config("qwen3_moe", num_layers=4)         4 experts of 32, top 2, in every layer
    tiny_config("qwen3_5", hybrid={"linear_num_value_heads": 8})

Who starts here: configs/tiny_test.py's target, the tests' random targets, and the dry run's
presets (`dry_run/presets.py`: fields made by `from_fields`; its test shapes keep 8B's 128-wide
heads, what TPU tiles). configs/default.py's `target_model` is a trainable toy (256 wide, 6
layers), written out there as the trainer's reference of keys.
"""

from __future__ import annotations

from typing import Any, Dict

# The dense family at test scale; the fields not named are ModelConfig's defaults.
DENSE = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
_HYBRID = dict(
    num_layers=4,
    tie_word_embeddings=False,
    hybrid=dict(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
    ),
)

# family (`ModelConfig.arch`) -> its changes to DENSE.
FAMILIES: Dict[str, Dict[str, Any]] = {
    "qwen3": {},
    "llama": dict(arch="llama", qk_norm=False),
    "qwen3_moe": dict(arch="qwen3_moe", **_MOE),
    "qwen3_5": dict(arch="qwen3_5", **_HYBRID),
    "qwen3_5_moe": dict(  # every layer routed: its config.json has no dense MLP width
        arch="qwen3_5_moe",
        intermediate_size=_MOE["moe_intermediate_size"],
        **_MOE,
        **dict(_HYBRID, hybrid=dict(_HYBRID["hybrid"], shared_expert_intermediate_size=32)),
    ),
}


def merged(fields: dict, changes: dict) -> dict:
    """`fields` with `changes` applied; a `hybrid` dict is merged into the one there is."""
    out = dict(fields)
    for key, value in changes.items():
        if key == "hybrid" and isinstance(value, dict):
            value = dict(out.get(key) or {}, **value)
        out[key] = value
    return out


def tiny_fields(family: str = "qwen3", **changes) -> dict:
    """The fields of `family` at test scale with `changes` (a ValueError names the families)."""
    if family not in FAMILIES:
        raise ValueError(f"no tiny family {family!r} (one of {', '.join(map(repr, FAMILIES))})")
    return merged(merged(DENSE, FAMILIES[family]), changes)


def from_fields(fields: dict, **dtypes):
    """The `ModelConfig` of plain fields (`hybrid` as HybridSpec fields, its layer_types
    defaulting to Qwen3.5's pattern of num_layers); `dtypes`: dtype / param_dtype."""
    from dflash_jax.models.config import HybridSpec, ModelConfig, hybrid_layers

    fields = dict(fields)
    if isinstance(fields.get("hybrid"), dict):
        spec = {"layer_types": hybrid_layers(fields["num_layers"]), **fields["hybrid"]}
        fields["hybrid"] = HybridSpec(**spec)
    return ModelConfig(**dtypes, **fields)


def tiny_config(family: str = "qwen3", **changes):
    """The `ModelConfig` of `tiny_fields(family, **changes)` (float32)."""
    return from_fields(tiny_fields(family, **changes))
