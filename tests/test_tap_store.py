"""The tap store (`training/tap_store.py`): the target's taps and top-k next-token distribution
written once beside the data, read back equal to the target's own pass (float32, rtol 1e-5;
NumPy top-k of its logits), bound to its target, taps, piece length, version and records (one
line each otherwise); training on it never runs the target and trains as the target's pass
does; with a draft vocabulary and the top-k KL loss it trains, exports the vocabulary, and the
exported drafter decodes losslessly."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs.tiny_test as tiny_test
import dflash_jax as dj
from dflash_jax.support.checks import ConfigError
from dflash_jax.training import experiment, tap_store, trainer
from dflash_jax.training.regenerate import read_records, record_tokens


def tiny_config(regen_file, **kw):
    c = tiny_test.get_config()
    c.regen.output = regen_file
    c.data.allow_split = False
    for key, value in kw.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return c


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(regenerated file, experiment, its records): the tiny target's own greedy answers."""
    d = tmp_path_factory.mktemp("store")
    regen = str(d / "regen.jsonl")
    exp = experiment.build_experiment(tiny_config(regen), str(d / "w"))
    return regen, exp, read_records(regen)


def _build(exp, records, path, seq_len, dtype="float32", top_k=8):
    target = dj.Target(exp.target_cfg, exp.target_params)
    return tap_store.build(
        target, records, record_tokens, path, list(exp.tap_layers), seq_len, top_k, dtype,
        rows=4, log=lambda *_: None,
    )  # fmt: skip


def test_stored_taps_and_topk_equal_the_targets_pass(setup, tmp_path):
    """seq_len 24: documents of ~56 tokens are cut into pieces (0, 24, 48), each computed as
    its own sequence, as the trainer's packer cuts them without splits."""
    _, exp, records = setup
    store = _build(exp, records[:10], str(tmp_path / "s"), seq_len=24)
    assert len(store) == 10
    tvars = {"params": exp.target_params}
    for i in (0, 3, 9):
        ids = record_tokens(records[i])[0]
        taps, top_ids, top_logp = store.read(i)
        assert taps.shape == (len(ids), store.width) and top_ids.shape == (len(ids), 8)
        assert len(tap_store.pieces(len(ids), 24)) >= 3
        for off, n in tap_store.pieces(len(ids), 24):
            piece = jnp.asarray(ids[None, off : off + n])
            # the target's forward over the piece alone (the pass that regeneration makes)
            # (rtol 1e-5, and 1e-5 of the taps' scale near zero: the packed rows' matmuls sum
            # in another order than one piece's; the tiny target's taps reach ~25)
            hidden, _, want = exp.tmod.apply(tvars, piece, tap_layers=exp.tap_layers)
            scale = float(np.abs(want).max())
            np.testing.assert_allclose(taps[off : off + n], want[0], rtol=1e-5, atol=1e-5 * scale)
            # the trainer's tap pass (chunked attention) over the same piece
            alt = np.asarray(exp.tmod.apply(tvars, piece, exp.tap_layers, method="taps"))[0]
            np.testing.assert_allclose(taps[off : off + n], alt, rtol=1e-5, atol=1e-5 * scale)
            logits = np.asarray(exp.tmod.apply(tvars, hidden, method="logits"), np.float64)[0]
            logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)  # fmt: skip
            order = np.argsort(-logp, axis=-1, kind="stable")[:, :8]
            np.testing.assert_allclose(
                top_logp[off : off + n], np.take_along_axis(logp, order, -1), rtol=1e-5, atol=1e-5
            )
            # the ids: the same set of 8 (ties may order differently)
            assert (np.sort(top_ids[off : off + n], -1) == np.sort(order, -1)).mean() > 0.99
    # bfloat16: the same taps to bfloat16's resolution, and smaller on disk than float32
    bf = _build(exp, records[:10], str(tmp_path / "b"), seq_len=24, dtype="bfloat16")
    np.testing.assert_allclose(bf.read(3)[0], store.read(3)[0], rtol=1e-2, atol=1e-2)
    size = lambda p: sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p))
    assert size(str(tmp_path / "b")) < 0.7 * size(str(tmp_path / "s"))


def test_a_stopped_build_resumes_where_it_stopped(setup, tmp_path):
    _, exp, records = setup
    path = str(tmp_path / "s")
    first = _build(exp, records[:4], path, seq_len=64)
    a = first.read(2)[0].copy()
    second = _build(exp, records[:9], path, seq_len=64)  # the first 4 kept, 5 computed
    assert len(second) == 9
    np.testing.assert_array_equal(second.read(2)[0], a)


def test_a_store_of_another_target_taps_version_or_data_is_refused_in_one_line(setup, tmp_path):
    regen, exp, records = setup
    path = str(tmp_path / "s")
    _build(exp, records, path, seq_len=64)
    fp = tap_store.target_fingerprint(exp.target_cfg, exp.target_params)
    other = jax.tree_util.tree_map(lambda x: x * 1.001, exp.target_params)
    assert tap_store.target_fingerprint(exp.target_cfg, other) != fp
    cases = [
        (dict(target=tap_store.target_fingerprint(exp.target_cfg, other)), "stored for target"),
        (dict(tap_layers=[0, 1, 5]), "stored for tap_layers"),
        (dict(seq_len=128), "stored for seq_len"),
    ]
    for expect, words in cases:
        with pytest.raises(tap_store.StoreError, match=words) as e:
            tap_store.TapStore(path, expect=expect)
        assert "\n" not in str(e.value)
    tap_store.TapStore(path, expect=dict(target=fp, tap_layers=[1]))  # a subset of the taps
    m = json.load(open(os.path.join(path, "manifest.json")))
    json.dump(dict(m, version=99), open(os.path.join(path, "manifest.json"), "w"))
    with pytest.raises(tap_store.StoreError, match="format version 99"):
        tap_store.TapStore(path)
    json.dump(m, open(os.path.join(path, "manifest.json"), "w"))
    store = tap_store.TapStore(path)
    swapped = [records[1], records[0]] + list(records[2:])
    with pytest.raises(tap_store.StoreError, match="record 0 holds other tokens"):
        store.check_records(swapped, record_tokens)
    with pytest.raises(tap_store.StoreError, match="missing"):
        tap_store.TapStore(path).check_records(records + records[:1], record_tokens)


def test_store_settings_are_refused_in_one_line(setup, tmp_path):
    regen, exp, records = setup
    path = str(tmp_path / "s")
    _build(exp, records[:2], path, seq_len=64)
    ok = {"data.tap_store": path}
    for bad, words in (
        ({"data.allow_split": True}, "data.allow_split=True"),
        ({"loss": "kl"}, "loss='topk_kl'"),
        ({"data.tap_store": str(tmp_path)}, "not a tap store"),
        ({"data.tap_store": "", "loss": "topk_kl"}, "data.tap_store: set it"),
        ({"drafter.dflash2.enabled": True, "drafter.draft_vocab_size": 8}, "for DFlash drafters"),
    ):
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            trainer.preflight(tiny_config(regen, **{**ok, **bad}), str(tmp_path / "w"))
        assert "\n" not in str(e.value)


def test_training_on_the_store_skips_the_target_and_trains_the_same(setup, tmp_path, monkeypatch):
    """ce on stored float32 taps: no target pass in any training step, and every step's loss
    equals the run that computes the taps (same rows and anchors) to float rounding."""
    regen, exp, records = setup
    path = str(tmp_path / "s")
    _build(exp, records, path, seq_len=64)
    kw = {"eval_every": 0, "log_every": 1, "num_train_steps": 6}
    plain = trainer.train_and_evaluate(tiny_config(regen, **kw), str(tmp_path / "plain"))
    calls = []
    real = dj.Transformer.taps

    def counting(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(dj.Transformer, "taps", counting)
    stored = trainer.train_and_evaluate(
        tiny_config(regen, **{**kw, "data.tap_store": path}), str(tmp_path / "stored")
    )
    assert not calls  # traced only if some step ran the target's tap pass
    assert [s for s, _ in stored["losses"]] == [s for s, _ in plain["losses"]]
    np.testing.assert_allclose(
        [l for _, l in stored["losses"]], [l for _, l in plain["losses"]], rtol=1e-4
    )


def test_topk_kl_with_a_draft_vocabulary_trains_and_exports_it(setup, tmp_path):
    regen, exp, records = setup
    path = str(tmp_path / "s")
    _build(exp, records, path, seq_len=64, top_k=8)
    cfg = tiny_config(
        regen,
        **{
            "data.tap_store": path,
            "loss": "topk_kl",
            "drafter.draft_vocab_size": 32,
            "num_train_steps": 150,
            "eval_every": 150,
        },
    )
    out = trainer.train_and_evaluate(cfg, str(tmp_path / "w"))
    losses = [l for _, l in out["losses"]]
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3])
    drafter_dir = os.path.join(str(tmp_path / "w"), "export", "drafter")
    target = dj.Target(exp.target_cfg, exp.target_params)
    d = dj.load_drafter(drafter_dir, target=target)
    assert d.draft_vocab is not None and len(d.draft_vocab) == 32
    # the 32 most frequent answer tokens of the training records (NumPy count)
    train = records[: len(exp.train_iter.source)]
    counts = np.zeros(exp.target_cfg.vocab_size, np.int64)
    for r in train:
        np.add.at(counts, np.asarray(r["response_ids"]), 1)
    assert set(d.draft_vocab.tolist()) == set(np.argsort(-counts, kind="stable")[:32].tolist())
    prompts = [r["prompt_ids"] for r in records[-4:]]
    ar = dj.generate(target, None, prompts, 32).tokens
    res = dj.generate(target, d, prompts, 32, block_size=8)
    assert res.tokens == ar
    assert max(max(a) for a in res.acceptance_lengths) >= 3, res.acceptance_lengths


def test_dpace_weights_follow_the_expected_accepted_length():
    """NumPy statement: w_k = sum_{m>=k} prod_{j=1..m} a_j over the scored positions of a
    block (a_j = exp(-loss_j); an unscored position ends the block), 0 where unscored; and
    w_k is d E[L] / d log a_k, checked by finite differences of E[L] = sum_m prod_{j<=m} a_j."""
    from dflash_jax.training.losses import dpace_weights

    rng = np.random.default_rng(0)
    loss = rng.uniform(0.1, 3.0, (2, 3, 6)).astype(np.float32)
    w0 = (rng.uniform(size=(2, 3, 6)) > 0.2).astype(np.float32)
    w0[..., 0] = 0.0
    got = np.asarray(dpace_weights(jnp.asarray(loss), jnp.asarray(w0)))
    for b in range(2):
        for n in range(3):
            a = np.where(w0[b, n] > 0, np.exp(-loss[b, n].astype(np.float64)), 0.0)
            a[0] = 1.0
            el = lambda a: sum(np.prod(a[1 : m + 1]) for m in range(1, 6))
            for k in range(6):
                if w0[b, n, k] == 0:
                    assert got[b, n, k] == 0
                    continue
                want = sum(np.prod(a[1 : m + 1]) for m in range(k, 6))
                assert got[b, n, k] == pytest.approx(want, rel=1e-5)
                eps = 1e-6  # d E[L] / d log a_k
                up = a.copy()
                up[k] *= np.exp(eps)
                assert got[b, n, k] == pytest.approx((el(up) - el(a)) / eps, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("loss", ["topk_kl", "topk_lk"])
def test_soft_label_losses_match_their_numpy_statement(setup, loss):
    """block_scores with soft labels over a draft vocabulary: topk_kl = -sum p log q, topk_lk =
    -log(sum min(p, q) + 1e-6), q the softmax of the head's draft-vocabulary rows (NumPy)."""
    from dflash_jax.training.losses import block_scores

    _, exp, _ = setup
    rng = np.random.default_rng(1)
    h = rng.standard_normal((1, 2, 3, exp.target_cfg.hidden_size)).astype(np.float32)
    rows = np.array([5, 9, 2, 40, 33, 7, 11, 60], np.int32)
    ids = rng.integers(0, len(rows), (1, 2, 3, 4)).astype(np.int32)
    p = rng.dirichlet(np.ones(4), (1, 2, 3)).astype(np.float32)
    labels = rng.integers(0, len(rows), (1, 2, 3)).astype(np.int32)
    per_pos, _ = block_scores(
        exp.tmod, exp.target_params, jnp.asarray(h), jnp.asarray(labels), loss=loss,
        rows=jnp.asarray(rows), soft=(jnp.asarray(ids), jnp.asarray(p)),
    )  # fmt: skip
    w = np.asarray(exp.target_params["lm_head"]["kernel"], np.float64)[:, rows]
    logits = h.astype(np.float64) @ w
    logq = logits - logits.max(-1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
    lq = np.take_along_axis(logq, ids, -1)
    if loss == "topk_kl":
        want = -(p * lq).sum(-1)
    else:
        want = -np.log(np.minimum(p, np.exp(lq)).sum(-1) + 1e-6)
    np.testing.assert_allclose(np.asarray(per_pos), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--variants=target,store_kx"], "variant 'store_kx'"),
        (["--variants=target_k8"], "variant 'target_k8'"),
        (["--variants=store", "--store=/nonexistent"], "not a tap store"),
        (["--variants=target", "--steps=0"], "--steps must be >= 1"),
    ],
)
def test_store_step_benchmark_refuses_bad_input_in_one_line(args, words, tmp_path):
    """benchmarks/experiments/tap_store/store_step.py: a bad variant, store or step count is
    one line, exit 2, before any model is loaded (no child process, no JSON written)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "benchmarks", "experiments", "tap_store", "store_step.py")
    out = tmp_path / "x.json"
    p = subprocess.run(
        [sys.executable, script,
         "--config=" + os.path.join(root, "configs", "tiny_test.py"), f"--json_out={out}", *args],
        capture_output=True, text=True, cwd=root, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [l for l in p.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and words in lines[0], p.stderr[-2000:]
    assert not out.exists()
