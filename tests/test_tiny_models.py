"""The tiny-model factory (`dflash_jax/models/tiny.py`): each family is a consistent model of its
architecture (its Hugging Face config reads back equal, its parameters have the family's
shapes), a caller's changes win (a hybrid dict merged into the family's), and the dry run's
presets are made from their fields by the same `from_fields`."""

import jax
import pytest

from dflash_jax.models.config import ModelConfig, hybrid_layers
from dflash_jax.models.target import init_params
from dflash_jax.models.tiny import FAMILIES, from_fields, tiny_config, tiny_fields


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_is_a_model_of_its_architecture(family):
    cfg = tiny_config(family)
    assert cfg.arch == family
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg  # what a checkpoint of it would say
    shapes = jax.eval_shape(lambda: init_params(cfg))
    leaves = jax.tree_util.tree_leaves_with_path(shapes)
    names = {jax.tree_util.keystr(p) for p, _ in leaves}
    assert any("embed_tokens" in n for n in names)
    assert (cfg.num_experts > 0) == any("experts" in n for n in names)
    assert (cfg.hybrid is not None) == any("linear_attn" in n for n in names), sorted(names)[:8]
    if cfg.hybrid is not None:
        assert cfg.hybrid.layer_types == hybrid_layers(cfg.num_layers)  # Qwen3.5's 3 : 1


def test_a_callers_changes_win_and_a_hybrid_dict_is_merged():
    cfg = tiny_config("qwen3_5", num_layers=8, hybrid={"linear_num_value_heads": 8})
    assert cfg.num_layers == 8 and cfg.hybrid.layer_types == hybrid_layers(8)
    assert cfg.hybrid.linear_num_value_heads == 8
    assert cfg.hybrid.linear_key_head_dim == FAMILIES["qwen3_5"]["hybrid"]["linear_key_head_dim"]
    types = ("full_attention", "linear_attention")
    assert (
        tiny_config("qwen3_5", num_layers=2, hybrid={"layer_types": types}).hybrid.layer_types
        == types
    )
    assert tiny_config(hidden_size=32).hidden_size == 32 and tiny_fields()["hidden_size"] == 64
    assert tiny_fields() is not tiny_fields()  # a fresh dict: a caller may change it
    with pytest.raises(ValueError, match="no tiny family 'qwen2' \\(one of 'qwen3', 'llama'"):
        tiny_config("qwen2")


def test_the_dry_run_presets_are_made_by_the_same_from_fields():
    import jax.numpy as jnp

    from dflash_jax.dry_run import presets

    made = presets.model_presets()
    for name in presets.PRESETS:
        fields = presets._preset_fields(name)
        want = from_fields(fields, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        assert made[name][0] == want
    hybrid = made["tiny_hybrid"][0].hybrid
    assert hybrid.layer_types == hybrid_layers(4) and hybrid.linear_num_value_heads == 8
