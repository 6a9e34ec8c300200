"""Shared fixtures: small random Hugging Face checkpoints written once per test session."""

import os

import numpy as np
import pytest

# The suite runs on the CPU, also where libtpu is installed (it is, for the TPU ahead-of-time
# compiles of tests/test_tpu_compile.py): without this JAX would probe for a TPU at start-up.
# Set before any test module imports JAX; subprocesses inherit it.
if not os.environ.get("JAX_PLATFORMS"):
    os.environ["JAX_PLATFORMS"] = "cpu"

VOCAB = 128


def make_hf_model(kind: str, seed: int = 0):
    """A small random transformers model: 'qwen3_tied', 'qwen3_untied' or 'llama3'."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6)
    if kind.startswith("qwen3"):
        cfg = transformers.Qwen3Config(head_dim=32, tie_word_embeddings=(kind == "qwen3_tied"),
                                       rope_theta=1e6, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif kind == "llama3":
        cfg = transformers.LlamaConfig(
            tie_word_embeddings=False, rope_theta=5e5,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            **common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # Larger-than-default init so that logits are far from uniform and tests discriminate.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
    return model.eval()


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """{kind: (directory, torch model)} for the three reference architectures."""
    out = {}
    for kind in ("qwen3_tied", "qwen3_untied", "llama3"):
        d = str(tmp_path_factory.mktemp(kind))
        model = make_hf_model(kind)
        model.save_pretrained(d)
        out[kind] = (d, model)
    return out


@pytest.fixture(scope="session")
def hf_models64(hf_checkpoints):
    """{kind: float64 copy of the transformers model}: the reference side of parity tests.

    transformers' float32 CPU forward was seen to differ between runs of the same input by
    ~4e-4 on these models (about one run in eight); in float64 run-to-run differences are
    ~1e-12, far below every tolerance, so a parity failure means this project is off."""
    import copy

    return {k: copy.deepcopy(m).double() for k, (_, m) in hf_checkpoints.items()}


@pytest.fixture(scope="session")
def rng():
    return np.random.RandomState(1234)
