"""bfloat16: where DFlash and autoregressive greedy outputs part, the target's two best tokens
are within bf16 rounding of each other (a near-tie); with bf16 weights and float32 compute
they do not part (benchmarks/bf16_divergence.py, on a small random pair)."""

import os

import numpy as np
import pytest

import dflash_jax as dj
from benchmarks import bf16_divergence as bd


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16pair")
    cfg = dj.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    target = dj.Target(cfg, dj.model.init_params(cfg, 3))
    dj.save_target(target, root / "target", dtype="bfloat16")
    dcfg = dj.make_drafter_config(cfg, num_layers=1, num_taps=2, block_size=8,
                                  mask_token_id=255)
    dj.save_drafter(dj.Drafter(dcfg, dj.init_drafter_params(dcfg, 0)), root / "drafter",
                    dtype="bfloat16")
    return root


def _run(pair_dir, setting):
    target = dj.load_target(os.path.join(pair_dir, "target"), **bd.SETTINGS[setting])
    drafter = dj.load_drafter(os.path.join(pair_dir, "drafter"), target=target)
    prompts = np.random.RandomState(0).randint(0, 255, (12, 24)).tolist()
    return bd.compare(target, drafter, prompts, 32)


def test_bf16_divergences_are_near_ties_and_float32_compute_agrees(pair_dir):
    bf16 = _run(pair_dir, "bfloat16")
    assert bf16["divergent"] >= 1, bf16  # the test must see some
    parted = [r for r in bf16["records"] if not r["identical"]]
    assert all(r.get("near_tie") for r in parted), parted
    # Near-ties are rare among all positions, so meeting only them is no accident.
    assert bf16["near_tie_positions"] < 0.25 * bf16["positions"], bf16
    f32 = _run(pair_dir, "bf16 weights, float32 compute")
    assert f32["divergent"] == 0 and f32["identical"] == f32["prompts"], f32
