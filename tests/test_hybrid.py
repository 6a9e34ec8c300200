"""Hybrid targets (Qwen3.5: Gated DeltaNet + gated attention, dense and MoE with a shared
expert): the delta rule's two forms against the rule written in NumPy, logits and taps against
transformers in float64, checkpoints both ways, and speculative decoding over the recurrent state
token-exact with autoregressive decoding (ragged acceptance), with a control that keeps the whole
block's state and fails."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _pair import use_oracle

import dflash_jax as dj
from dflash_jax.decoding import programs
from dflash_jax.models import hybrid

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PATTERN = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]  # not 3:1
SMALL = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def _hf_model(moe: bool, vocab: int = 128, sharpen: float = 1.0):
    """A random float64 transformers Qwen3.5 text model (norm weights perturbed off zero)."""
    torch.manual_seed(1 if moe else 0)
    if moe:
        cfg = transformers.Qwen3_5MoeTextConfig(
            vocab_size=vocab,
            num_hidden_layers=3,
            layer_types=PATTERN[:3],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            **SMALL,
        )
        model = transformers.Qwen3_5MoeForCausalLM(cfg)
        model.config._experts_implementation = "eager"  # float64 (grouped_mm is not)
    else:
        cfg = transformers.Qwen3_5TextConfig(
            vocab_size=vocab,
            intermediate_size=96,
            num_hidden_layers=4,
            layer_types=PATTERN,
            **SMALL,
        )
        model = transformers.Qwen3_5ForCausalLM(cfg)
    model = model.double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            if "lm_head" in name:
                p.mul_(sharpen)  # peaked logits: greedy decoding without near-ties
            if "in_proj_qkv" in name or "linear_attn.out_proj" in name:
                p.mul_(3.0)  # the recurrent layers weigh in: a wrong state changes the tokens
    return model


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("qwen3_5"))
    model = _hf_model(moe=False, sharpen=10.0)
    model.save_pretrained(d)
    return d, model


@pytest.fixture(scope="module")
def dense_target(dense_dir):
    return dj.load_target(dense_dir[0], attention_impl="xla")


# ---------------------------------------------------------------------------- the delta rule


def _numpy_rule(q, k, v, g, beta, s):
    """The gated delta rule as written: per position, decay, read, correct, write, read out."""
    out = np.zeros(v.shape)
    states = [s.copy()]
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[..., None, None]
        pred = np.einsum("bhkv,bhk->bhv", s, k[:, t])
        delta = beta[:, t][..., None] * (v[:, t] - pred)
        s = s + k[:, t][..., :, None] * delta[..., None, :]
        out[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
        states.append(s.copy())
    return out, states


def test_chunked_and_recurrent_forms_and_the_settle_follow_the_rule():
    rs = np.random.RandomState(0)
    b, t, h, dk, dv = 2, 37, 3, 5, 4
    q, k = rs.randn(b, t, h, dk) * 0.4, rs.randn(b, t, h, dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rs.randn(b, t, h, dv)
    g = -np.abs(rs.randn(b, t, h)) * 0.3
    beta = 1 / (1 + np.exp(-rs.randn(b, t, h)))
    s0 = rs.randn(b, h, dk, dv) * 0.5
    want, states = _numpy_rule(q, k, v, g, beta, s0)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, s0)]
    for name, (out, s, delta) in (
        ("recurrent", hybrid.recurrent_delta_rule(*f32)),
        ("chunked", hybrid.chunked_delta_rule(*f32, chunk=8)),  # 5 chunks, the last padded
    ):
        np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(s), states[-1], atol=2e-5, err_msg=name)
    # The settle: the state after a ragged prefix n[b] of the block, from its deltas.
    n = np.array([0, 23])
    settled = hybrid.settle_state(f32[5], f32[1], delta, f32[3], jnp.asarray(n))
    for i in range(b):
        np.testing.assert_allclose(np.asarray(settled[i]), states[n[i]][i], atol=2e-5)
    # ... and the convolution window: the K-1 inputs before position n.
    win, x = rs.randn(b, 3, 6), rs.randn(b, t, 6)
    got = np.asarray(hybrid.settle_window(jnp.asarray(win), jnp.asarray(x), jnp.asarray(n)))
    for i in range(b):
        np.testing.assert_allclose(
            got[i], np.concatenate([win[i], x[i]])[n[i] : n[i] + 3], atol=1e-6
        )


# ---------------------------------------------------------------------------- the models


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe_shared_expert"])
def test_logits_and_every_tap_equal_transformers(moe, dense_dir, tmp_path):
    if moe:
        model = _hf_model(moe=True)
        model.save_pretrained(str(tmp_path))
        path = str(tmp_path)
    else:
        path, model = dense_dir
    target = dj.load_target(path, attention_impl="xla")
    n = target.config.num_layers
    ids = np.random.RandomState(3).randint(0, 128, (2, 150))  # > one 64-position chunk
    with torch.no_grad():
        ref = model(torch.tensor(ids), output_hidden_states=True)
    out = target.forward(ids, tap_layers=tuple(range(n)))
    logits = ref.logits.numpy()
    np.testing.assert_allclose(np.asarray(out.logits), logits, atol=2e-5 * np.abs(logits).max())
    taps = np.asarray(out.taps).reshape(2, 150, n, -1)
    for i in range(n):
        want = ref.hidden_states[i + 1].numpy()
        if i == n - 1:
            continue  # transformers' last hidden state is after the final norm
        np.testing.assert_allclose(taps[:, :, i], want, atol=2e-5 * np.abs(want).max())


def test_checkpoint_round_trip_and_the_published_layout(dense_dir, dense_target, tmp_path):
    path, model = dense_dir
    out = str(tmp_path / "saved")
    dj.save_target(dense_target, out, dtype="float32")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    ids = np.random.RandomState(4).randint(0, 128, (1, 40))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
        np.testing.assert_allclose(back(torch.tensor(ids)).logits.numpy(), want, atol=1e-4)
    # The published vision-language layout: text weights under model.language_model., a
    # vision tower and an MTP head beside them (skipped), the text config nested.
    from safetensors.numpy import load_file, save_file

    vl = tmp_path / "vl"
    vl.mkdir()
    tensors = load_file(os.path.join(out, "model.safetensors"))
    renamed = {
        (k if k.startswith("lm_head") else "model.language_model." + k[len("model.") :]): v
        for k, v in tensors.items()
    }
    renamed["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 3), np.float32)
    renamed["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
    save_file(renamed, str(vl / "model.safetensors"))
    text = json.load(open(os.path.join(out, "config.json")))
    text["model_type"] = "qwen3_5_text"
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"}
    cfg["text_config"] = {k: v for k, v in text.items() if k != "architectures"}
    cfg["vision_config"] = {"depth": 1}
    (vl / "config.json").write_text(json.dumps(cfg))
    loaded = dj.load_target(str(vl), attention_impl="xla")
    assert loaded.config == dense_target.config.replace()
    np.testing.assert_allclose(
        np.asarray(loaded.forward(ids).logits), want, atol=2e-5 * np.abs(want).max()
    )


# ---------------------------------------------------------------------------- decoding

RS = np.random.RandomState(5)
PROMPTS = [list(map(int, RS.randint(0, 127, n))) for n in (9, 26, 25, 7)]
NEW = 24


@pytest.fixture(scope="module")
def ar(dense_target):
    """Autoregressive greedy decoding through the HybridCache, prompts prefilled 8 at a time
    (ragged: some rows end inside a chunk, some before it)."""
    return dj.generate(dense_target, None, PROMPTS, max_new_tokens=NEW, prefill_chunk=8).tokens


def test_autoregressive_decoding_equals_full_forwards(dense_dir, ar):
    """The cached decode (chunked prefill, then one recurrent step a token) against
    transformers' full float64 forward over the whole sequence at every step."""
    model = dense_dir[1]
    for prompt, got in zip(PROMPTS, ar):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(NEW):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert got == seq[len(prompt) :]
    assert len({tuple(a[:8]) for a in ar}) > 1  # not one degenerate continuation


def _oracle(prompts, ar, wrong_every):
    """A draft_block that reads the autoregressive continuation (wrong at absolute positions
    p % wrong_every == 0): accepted drafts with ragged acceptance over the batch."""
    full = np.zeros((len(prompts), 128), np.int32)
    for i, (p, c) in enumerate(zip(prompts, ar)):
        full[i, : len(p) + len(c)] = p + c
    table = jnp.asarray(full)

    def draft(kind, dec, ctx, x_last, start):
        pos = start[:, None] + 1 + jnp.arange(dec.plan.block_size - 1)[None]
        d = jnp.take_along_axis(table, jnp.minimum(pos, table.shape[1] - 1), axis=1)
        d = jnp.where(pos % wrong_every == 0, (d + 1) % 128, d)
        return d, jnp.ones(d.shape, jnp.float32)

    return draft


@pytest.fixture(scope="module")
def drafter(dense_target):
    cfg = dj.make_drafter_config(
        dense_target.config, num_layers=1, num_taps=2, block_size=8, mask_token_id=127
    )
    return dj.Drafter(cfg, dj.init_drafter_params(cfg, seed=1))


def _fresh(monkeypatch):
    import collections

    monkeypatch.setattr(programs._Compiled, "cache", collections.OrderedDict())
    jax.clear_caches()


def test_dflash_over_a_hybrid_target_equals_autoregressive(dense_target, drafter, ar, monkeypatch):
    use_oracle(monkeypatch, draft_block=_oracle(PROMPTS, ar, wrong_every=5))
    _fresh(monkeypatch)
    res = dj.generate(dense_target, drafter, PROMPTS, NEW, block_size=8, prefill_chunk=8)
    assert res.tokens == ar
    assert res.tau > 3.0
    assert len({a[0] for a in res.acceptance_lengths}) > 1  # ragged acceptance in one step
    # A stop token cuts each row where autoregressive decoding would stop.
    stop = ar[0][10]
    res = dj.generate(dense_target, drafter, PROMPTS, NEW, block_size=8, stop_token_ids=[stop])
    cut = [c[: c.index(stop) + 1] if stop in c else c for c in ar]
    assert res.tokens == cut
    assert max(max(a) for a in res.acceptance_lengths) >= 3  # several drafts accepted here too
    # Verify widths chosen by confidence (a switch over pending blocks of three widths).
    res = dj.generate(dense_target, drafter, PROMPTS, NEW, block_size=8, confidence_threshold=0.5)
    assert res.tokens == ar and res.tau > 3.0


def test_keeping_the_whole_blocks_state_breaks_losslessness(dense_target, drafter, ar, monkeypatch):
    """The control: a rollback that settles the recurrent state after the whole verified block
    (not the accepted prefix) changes the tokens."""
    honest = hybrid.HybridCache.rollback

    def whole_block(self, lengths):
        if self.pending is not None:
            kept = honest(self, self.kv.lengths)  # every block position into the state
            return kept.replace(kv=kept.kv.rollback(lengths.astype(jnp.int32)))
        return honest(self, lengths)

    use_oracle(monkeypatch, draft_block=_oracle(PROMPTS, ar, wrong_every=5))
    monkeypatch.setattr(hybrid.HybridCache, "rollback", whole_block)
    _fresh(monkeypatch)
    res = dj.generate(dense_target, drafter, PROMPTS, NEW, block_size=8)
    assert res.tokens != ar


def test_bad_hybrid_requests_and_configs_get_one_line(dense_target, drafter, dense_dir, tmp_path):
    with pytest.raises(ValueError, match="tree_budget is not supported over a hybrid"):
        dj.generate(dense_target, drafter, PROMPTS[:1], 4, block_size=8, tree_budget=8)
    with pytest.raises(ValueError, match="int8 quantization of hybrid"):
        dj.quantize_target(dense_target)
    from configs.default import get_config
    from dflash_jax.training import experiment

    train = get_config()
    train.target_path = dense_dir[0]
    with pytest.raises(ValueError, match="training against a hybrid"):
        experiment.build_experiment(train, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # refused before anything is written
    cfg = json.load(open(os.path.join(dense_dir[0], "config.json")))
    for field, value, words in (
        ("layer_types", PATTERN[:3], "layer_types must be a list of 4"),
        ("layer_types", ["linear_attention"] * 3 + ["sliding"], "unknown layer type 'sliding'"),
        ("linear_num_value_heads", 3, "not a multiple of linear_num_key_heads"),
        ("linear_conv_kernel_dim", 0, "linear_conv_kernel_dim must be an integer >= 1"),
    ):
        bad = dict(cfg, **{field: value})
        with pytest.raises(ValueError, match=words):
            dj.ModelConfig.from_hf(bad, source="config.json")


def test_presets_hold_the_published_parameter_counts():
    """The dry run's hybrid presets have the text models' published sizes: Qwen3.5-9B ~9B,
    Qwen3.6-27B ~27B (its card: 64 layers, hidden 5120, 48 DeltaNet value heads) and
    Qwen3.5-35B-A3B ~35B (also Qwen3.6-35B-A3B's shape), each 3 Gated DeltaNets : 1 gated
    attention layer. Counted from the model's own parameter shapes (one and two 4-layer periods,
    cheap to trace), not from the preset's fields."""
    import dataclasses
    import math

    from dflash_jax import dry_run
    from dflash_jax.dry_run.presets import abstract_params

    for name, billions in (("qwen3_5_9b", 9), ("qwen3_6_27b", 27), ("qwen3_5_35b_a3b", 35)):
        tcfg, dcfg = dry_run.build_configs(name)
        kinds = tcfg.hybrid.layer_types
        assert kinds[:4] == ("linear_attention",) * 3 + ("full_attention",) and kinds == kinds[
            :4
        ] * (len(kinds) // 4), name

        def count(n):
            cfg = tcfg.replace(
                num_layers=n, hybrid=dataclasses.replace(tcfg.hybrid, layer_types=kinds[:n])
            )
            tparams, _ = abstract_params(cfg, dcfg)
            return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tparams))

        one, two = count(4), count(8)
        total = one + (len(kinds) // 4 - 1) * (two - one)
        assert round(total / 1e9) == billions, (name, total)
