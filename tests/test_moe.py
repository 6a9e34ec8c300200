"""Mixture-of-experts targets (issue 28): Qwen3-MoE.

- Parity with transformers' `Qwen3MoeForCausalLM` (float64 reference, eager experts) on small
  random configs: norm_topk_prob on and off, a dense layer through `mlp_only_layers`,
  `decoder_sparse_step=2`; logits and taps.
- Checkpoints: per-expert tensors stacked at load, written back per expert, read back by
  transformers to the same logits.
- Dropless: a row's logits do not depend on the other rows of the batch, also when every
  token of the batch is routed to the same experts (a capacity factor would drop some).
- DFlash greedy == autoregressive over a MoE target, with the bundled trained drafter accepted:
  the bundled dense target turned MoE (each expert a perturbed copy of its layer's MLP, random
  routers, one dense layer), so it is a different model that the drafter still predicts.
- A drafter training step (train.py's trainer) against a frozen MoE target.
- Bad input: a shared expert, int8 quantization of a MoE target: one line naming the field.
"""

import copy
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _pair import assert_accepted, moe_from_dense

import dflash_jax as dj
from dflash_jax.models import moe
from dflash_jax.models.safetensors_io import SafetensorsDir

VOCAB = 128
# (norm_topk_prob, mlp_only_layers, decoder_sparse_step): layers 0..3 MoE except [1];
# MoE layers 1 and 3 only.
KINDS = {"norm_only1": (True, [1], 1), "plain_step2": (False, [], 2)}


def _hf_moe(norm, only, step, seed=0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=step,
        mlp_only_layers=only,
        norm_topk_prob=norm,
        rope_theta=1e6,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # larger than default: peaky logits, routers far from uniform
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)
    return model.eval()


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """{kind: (directory, float64 eager transformers reference, loaded Target)}."""
    out = {}
    for kind, (norm, only, step) in KINDS.items():
        d = str(tmp_path_factory.mktemp(kind))
        model = _hf_moe(norm, only, step)
        model.save_pretrained(d)
        ref = copy.deepcopy(model).double()
        ref.config._experts_implementation = "eager"
        out[kind] = (d, ref, dj.load_target(d))
    return out


IDS = np.random.RandomState(0).randint(0, VOCAB, (2, 37))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_and_taps_match_transformers(kind, moe_models):
    d, ref, target = moe_models[kind]
    c = target.config
    norm, only, step = KINDS[kind]
    assert c.arch == "qwen3_moe" and c.num_experts == 8 and c.num_experts_per_tok == 2
    assert (c.norm_topk_prob, list(c.mlp_only_layers), c.decoder_sparse_step) == (norm, only, step)
    moe_layers = [i for i in range(4) if c.layer_is_moe(i)]
    assert moe_layers == ([0, 2, 3] if step == 1 else [1, 3])
    for i in range(4):  # the dense layers hold a plain MLP, the others stacked experts
        mlp = target.params[f"layers_{i}"]["mlp"]
        if i in moe_layers:
            assert mlp["experts"]["gate_proj"]["kernel"].shape == (8, 16, 32)  # [E, I, H]
            assert mlp["experts"]["down_proj"]["kernel"].shape == (8, 16, 32)
            assert mlp["gate"]["kernel"].shape == (32, 8)
        else:
            assert mlp["gate_proj"]["kernel"].shape == (32, 48)
    with torch.no_grad():
        want = ref(torch.tensor(IDS), output_hidden_states=True)
    taps = (0, 1, 2)
    out = target.forward(IDS, tap_layers=taps)
    np.testing.assert_allclose(np.asarray(out.logits), want.logits.numpy(), atol=1e-4, rtol=0)
    want_taps = np.concatenate([want.hidden_states[i + 1].numpy() for i in taps], axis=-1)
    np.testing.assert_allclose(np.asarray(out.taps), want_taps, atol=1e-4, rtol=0)
    # The reference really routes: zeroing one expert of the first MoE layer changes logits.
    first = f"layers_{moe_layers[0]}"
    params = jax.tree_util.tree_map(lambda x: x, target.params)
    down = params[first]["mlp"]["experts"]["down_proj"]["kernel"]
    params[first]["mlp"]["experts"]["down_proj"]["kernel"] = down.at[0].set(0.0)
    changed = np.asarray(dj.Target(c, params).forward(IDS).logits)
    assert np.abs(changed - np.asarray(out.logits)).max() > 1e-3


def test_router_matches_its_definition():
    """`moe.route` against a NumPy statement of the rule (softmax in float32, top-k, the
    top-k sum normalisation only with norm_topk_prob)."""
    rs = np.random.RandomState(3)
    x, w = rs.randn(5, 6).astype(np.float32), rs.randn(6, 8).astype(np.float32)
    logits = x @ w
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1)[:, :3]
    top = np.take_along_axis(p, idx, -1)
    for norm in (False, True):
        weights, experts = moe.route(jnp.asarray(x), jnp.asarray(w), 3, norm)
        np.testing.assert_array_equal(np.asarray(experts), idx)
        want = top / top.sum(-1, keepdims=True) if norm else top
        np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-5)


def test_save_writes_per_expert_tensors_that_transformers_reads(moe_models, tmp_path):
    d, ref, target = moe_models["norm_only1"]
    dj.save_target(target, str(tmp_path))
    store = SafetensorsDir(str(tmp_path))
    names = set(store.names())
    store.close()
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names
    assert not any("experts.gate_proj" in n for n in names)  # never the stacked form
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer
    hf = json.load(open(tmp_path / "config.json"))
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["mlp_only_layers"] == [1]
    import transformers

    back = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path)).eval().double()
    back.config._experts_implementation = "eager"
    with torch.no_grad():
        got = back(torch.tensor(IDS)).logits.numpy()
        want = ref(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    again = dj.load_target(str(tmp_path))
    for a, b in zip(
        jax.tree_util.tree_leaves(again.params), jax.tree_util.tree_leaves(target.params)
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dropless_rows_do_not_depend_on_the_batch(moe_models):
    """Row 0's logits alone, beside another row, and beside 7 copies of one token (all routed
    to the same experts, far past any per-expert capacity) are the same."""
    _, _, target = moe_models["plain_step2"]
    row = IDS[:1]
    alone = np.asarray(target.forward(row).logits)[0]
    crowd = np.concatenate([row, np.full((7, 37), 5)], axis=0)
    for batch in (IDS, crowd):
        got = np.asarray(target.forward(batch).logits)[0]
        np.testing.assert_allclose(got, alone, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def moe_pair(bundled_pair):
    """(MoE target, drafter, prompts, AR tokens): the bundled dense target turned MoE
    (`_pair.moe_from_dense`: 4 experts, perturbed copies of each layer's MLP, top-2
    normalised, layer 2 dense through mlp_only_layers) and the bundled drafter."""
    dense, drafter, prompts = bundled_pair
    target = moe_from_dense(dense)
    ar = dj.generate(target, None, prompts, max_new_tokens=40)
    return target, drafter, prompts, ar.tokens


def test_dflash_equals_ar_over_a_moe_target(moe_pair, bundled_pair):
    target, drafter, prompts, ar = moe_pair
    dense_ar = dj.generate(bundled_pair[0], None, prompts, max_new_tokens=40).tokens
    assert dense_ar != ar  # the MoE target is another model than the dense one
    res = dj.generate(target, drafter, prompts, max_new_tokens=40, block_size=8)
    assert res.tokens == ar
    assert_accepted(res, 8)


@pytest.mark.parametrize("method", ["routed_interpret", "gather"])
def test_dflash_equals_ar_through_the_routed_expert_matmuls(moe_pair, monkeypatch, method):
    """Issue 42: the decode loop's expert matmuls through the routed Pallas kernel (interpret
    mode) or the gather dispatch for every call of at most 512 rows: DFlash equals AR decoding
    (through ragged_dot), with drafts accepted."""
    import collections

    from dflash_jax.decoding import programs
    from dflash_jax.models import moe

    target, drafter, prompts, ar = moe_pair
    calls = []
    # Programs compiled under another dispatch (a cache hit would not trace the one forced).
    monkeypatch.setattr(programs._Compiled, "cache", collections.OrderedDict())

    def forced(rows, experts, impl="xla"):
        calls.append(rows)
        return method if 0 < rows <= 512 else "ragged"

    monkeypatch.setattr(moe, "gmm_method", forced)
    prompts = prompts[:2]  # interpret mode is slow on a CPU
    res = dj.generate(target, drafter, prompts, max_new_tokens=16, block_size=8)
    assert any(0 < r <= 512 for r in calls), calls  # traced through the forced path
    assert res.tokens == [t[:16] for t in ar[:2]]  # AR through ragged_dot
    assert_accepted(res, 8)


def test_drafter_training_step_against_a_frozen_moe_target(moe_models, tmp_path):
    from configs import tiny_test
    from dflash_jax.training import trainer

    d, _, target = moe_models["plain_step2"]
    c = tiny_test.get_config()
    c.target_path = d
    c.data.update(kind="synthetic", num_docs=64, doc_len=48, batch_size=4, seq_len=64)
    c.drafter.update(target_layer_ids=(1, 3), num_taps=2)
    c.update(num_train_steps=6, log_every=1, eval_every=1000, eval_batches=0, checkpoint_every=1000)
    c.eval_num_prompts = 0
    out = trainer.train_and_evaluate(c, str(tmp_path / "run"))
    assert out["status"] == "done" and out["step"] == 6, out
    losses = [l for _, l in out["losses"]]
    assert len(losses) == 6 and all(np.isfinite(losses)) and len(set(losses)) == 6, losses
    # The exported drafter taps the MoE target's layers 1 and 3 and loads against it.
    drafter = dj.load_drafter(out["export"], target=target)
    assert drafter.config.target_layer_ids == (1, 3) and not drafter.config.body.is_moe


def test_expert_axis_needs_a_moe_target_whose_experts_it_divides(moe_models, tmp_path, monkeypatch):
    """train.py's preflight (no model loaded, nothing written): an `expert` mesh axis over a
    dense target (it would only repeat the work) or one that does not divide the experts (they
    would be replicated over it) is one line; a divisor passes. The devices are the one CPU
    device counted 8 times: preflight only counts them."""
    from configs import tiny_test
    from dflash_jax.support.checks import ConfigError
    from dflash_jax.training import preflight as preflight_lib
    from dflash_jax.training import trainer

    monkeypatch.setattr(preflight_lib, "_mesh_devices", lambda spec: jax.devices()[:1] * 8)
    d = moe_models["plain_step2"][0]  # 8 experts

    def preflight(mesh, target_path=""):
        c = tiny_test.get_config()
        c.mesh, c.target_path = mesh, target_path
        c.drafter.update(target_layer_ids=(1, 3) if target_path else (0, 1))
        return trainer.preflight(c, str(tmp_path / "w"))

    for mesh, path, message in (
        ("data=2,expert=2,fsdp=2", "", r"'data=2,expert=2,fsdp=2': the mesh axis expert=2 .*dense"),
        ("data=2,expert=-1", "", r"'data=2,expert=-1': the mesh axis expert=4 .*dense"),
        ("expert=3,data=2", d, r"'expert=3,data=2': .*expert=3 does not divide the target's 8"),
    ):
        with pytest.raises(ConfigError, match=message) as e:
            preflight(mesh, path)
        assert "\n" not in str(e.value)
    for mesh in ("data=2,expert=4", "expert=8", "data=2,expert=2,fsdp=2", "data=2,expert=-1"):
        assert preflight(mesh, d) == 1
    assert preflight("data=2,fsdp=4") == 1  # no expert axis: a dense target as before
    assert not os.path.exists(tmp_path / "w")


def test_unsupported_moe_configs_are_one_line(moe_models, tmp_path):
    d, _, target = moe_models["norm_only1"]
    base = json.load(open(os.path.join(d, "config.json")))
    for field, value, message in (
        ("shared_expert_intermediate_size", 64, "shared_expert_intermediate_size=64"),
        ("num_experts_per_tok", 9, "num_experts_per_tok=9"),
        ("mlp_only_layers", "1", "mlp_only_layers must be a list"),
    ):
        hf = dict(base, **{field: value})
        with pytest.raises(ValueError, match=message) as e:
            dj.ModelConfig.from_hf(hf)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="int8 quantization of mixture-of-experts") as e:
        dj.load_target(d, quantize="int8")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="int8 quantization of mixture-of-experts"):
        dj.quantize_target(target)
    # A drafter body made from a MoE target is dense.
    body = dj.make_drafter_config(target.config, num_layers=1, num_taps=2).body
    assert not body.is_moe and body.arch == "qwen3"


def test_presets_are_the_public_30b_a3b_shape():
    """The dry-run presets hold Qwen3-30B-A3B's 30.5B parameters (its model card: "30.5B in
    total"), every layer MoE, and a dense drafter tapping 5 of the 48 layers; the Coder preset
    is the same architecture with its 262144-token context."""
    import math

    from dflash_jax import dry_run
    from dflash_jax.dry_run.presets import abstract_params

    tcfg, dcfg = dry_run.build_configs("qwen3_30b_a3b")
    assert tcfg.num_layers == 48 and all(tcfg.layer_is_moe(i) for i in range(48))

    def count(layers):  # the model's own parameter shapes (1 and 2 layers: cheap to trace)
        tparams, _ = abstract_params(tcfg.replace(num_layers=layers), dcfg)
        return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tparams))

    one, two = count(1), count(2)
    total = one + 47 * (two - one)
    assert round(total / 1e9, 1) == 30.5, total
    assert not dcfg.body.is_moe and len(dcfg.target_layer_ids) == 5
    coder, coder_d = dry_run.build_configs("qwen3_coder_30b_a3b")
    assert coder == tcfg.replace(
        max_position_embeddings=262144
    ) and coder_d.body == dcfg.body.replace(max_position_embeddings=262144)
