"""Training: mask/weights vs brute force, a drafter that learns, resume, signals, export."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.training import masks


# ------------------------------------------------------------------ brute-force references


def brute_mask(anchors, valid, bs, ctx_len, seg=None, strict=True):
    b, n = anchors.shape
    rows = n * bs
    out = np.zeros((b, rows, ctx_len + rows), bool)
    for bi in range(b):
        for r in range(rows):
            blk = r // bs
            if not valid[bi, blk]:
                continue
            p = anchors[bi, blk]
            for j in range(ctx_len):
                before = j < p if strict else j <= p
                same_doc = seg is None or seg[bi, j] == seg[bi, p]
                out[bi, r, j] = before and same_doc
            for r2 in range(rows):
                out[bi, r, ctx_len + r2] = r2 // bs == blk
    return out


def brute_weights(anchors, valid, loss_mask, bs, gamma, seg=None):
    b, n = anchors.shape
    s = loss_mask.shape[1]
    w = np.zeros((b, n, bs))
    for bi in range(b):
        for ni in range(n):
            p = anchors[bi, ni]
            for k in range(1, bs):
                q = p + k
                if (
                    valid[bi, ni]
                    and q < s
                    and loss_mask[bi, q]
                    and (seg is None or seg[bi, q] == seg[bi, p])
                ):
                    w[bi, ni, k] = math.exp(-(k - 1) / gamma)
    return w


@pytest.fixture(scope="module")
def packed_rows():
    rng = np.random.RandomState(0)
    b, s = 3, 40
    ids = rng.randint(2, 50, size=(b, s)).astype(np.int32)
    loss_mask = (rng.rand(b, s) < 0.7).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    seg[0, 15:] = 2
    seg[1, 10:] = 2
    seg[1, 27:] = 3
    seg[2, 36:] = 0  # padding
    loss_mask[2, 36:] = 0
    return ids, loss_mask, seg


def test_anchors_are_eligible_distinct_and_padded(packed_rows):
    _, loss_mask, _ = packed_rows
    bs = 8
    anchors, valid = masks.sample_anchors(jax.random.PRNGKey(3), jnp.asarray(loss_mask), 30, bs)
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    s = loss_mask.shape[1]
    assert anchors.shape == (3, min(30, s - 1))
    for bi in range(3):  # SpecForge's rule: p <= S - 2, loss_mask[p] and loss_mask[p + 1]
        eligible = {p for p in range(s - 1) if loss_mask[bi, p] and loss_mask[bi, p + 1]}
        got = anchors[bi][valid[bi]].tolist()
        assert len(got) == len(set(got)) == min(len(eligible), anchors.shape[1])
        assert set(got) <= eligible
    # Few eligible positions: the rest of the blocks are invalid.
    lm = np.zeros((1, s), np.int32)
    lm[0, [3, 4, 9, 10, 20, 38, 39]] = 1  # 20: lone; 39 = S - 1 has no next token
    a, v = masks.sample_anchors(jax.random.PRNGKey(0), jnp.asarray(lm), 10, bs)
    assert sorted(np.asarray(a)[np.asarray(v)].tolist()) == [3, 9, 38]
    # Different keys give different samples (it is random).
    a2, _ = masks.sample_anchors(jax.random.PRNGKey(4), jnp.asarray(loss_mask), 10, bs)
    a1, _ = masks.sample_anchors(jax.random.PRNGKey(3), jnp.asarray(loss_mask), 10, bs)
    assert not np.array_equal(np.asarray(a1), np.asarray(a2))


@pytest.mark.parametrize("use_seg", (False, True))
def test_training_mask_and_weights_equal_brute_force(packed_rows, use_seg):
    ids, loss_mask, seg = packed_rows
    bs, gamma, s = 4, 7.0, ids.shape[1]
    anchors, valid = masks.sample_anchors(jax.random.PRNGKey(1), jnp.asarray(loss_mask), 9, bs)
    valid = valid.at[0, 2].set(False)  # an invalid block in the middle
    a, v = np.asarray(anchors), np.asarray(valid)
    segj = jnp.asarray(seg) if use_seg else None
    segn = seg if use_seg else None
    got = np.asarray(masks.training_mask(anchors, valid, bs, s, segj))
    np.testing.assert_array_equal(got, brute_mask(a, v, bs, s, segn))
    # The `<=` trap: letting a block see its own anchor's feature is a different mask.
    assert not np.array_equal(got, brute_mask(a, v, bs, s, segn, strict=False))
    w = np.asarray(masks.loss_weights(anchors, valid, jnp.asarray(loss_mask), bs, gamma, segj))
    np.testing.assert_allclose(w, brute_weights(a, v, loss_mask, bs, gamma, segn), rtol=1e-6)
    assert np.all(w[..., 0] == 0)
    if use_seg:  # some block in row 0 crosses the document boundary at 15
        assert np.any(brute_weights(a, v, loss_mask, bs, gamma) != w)


def test_labels_are_same_position_and_inputs_masked(packed_rows):
    ids, _, _ = packed_rows
    bs = 5
    anchors = jnp.asarray([[0, 7, 20], [3, 4, 30], [1, 2, 35]], jnp.int32)
    labels = np.asarray(masks.block_labels(jnp.asarray(ids), anchors, bs))
    inputs = np.asarray(masks.block_inputs(jnp.asarray(ids), anchors, bs, mask_token_id=1))
    for bi in range(3):
        for ni in range(3):
            p = int(anchors[bi, ni])
            for k in range(bs):
                assert labels[bi, ni, k] == ids[bi, min(p + k, ids.shape[1] - 1)]  # no shift
            assert inputs[bi, ni, 0] == ids[bi, p]
            assert np.all(inputs[bi, ni, 1:] == 1)


def test_random_mask_schedule_reveals_some_and_masks_at_least_one():
    m = np.asarray(masks.mask_pattern(jax.random.PRNGKey(0), (4, 64), 8, "random"))
    assert not m[..., 0].any()
    assert m[..., 1:].any(axis=-1).all()
    assert 0.2 < m[..., 1:].mean() < 0.8  # partially masked blocks exist
    assert np.asarray(masks.mask_pattern(None, (2, 3), 8, "all"))[..., 1:].all()


def brute_mdlm(u_ratio, u_pos, force, u_full, bs, full_fraction):
    """The "mdlm" schedule block by block from its uniform draws: (masked, scale)."""
    b, n = u_full.shape
    masked, scale = np.zeros((b, n, bs), bool), np.ones((b, n))
    for bi in range(b):
        for ni in range(n):
            if u_full[bi, ni] < full_fraction:
                masked[bi, ni, 1:] = True
                continue
            t = 1.0 - u_ratio[bi, ni]
            for k in range(1, bs):
                masked[bi, ni, k] = u_pos[bi, ni, k] < t or k == force[bi, ni]
            scale[bi, ni] = 1.0 / max(t, 1.0 / (bs - 1))
    return masked, scale


@pytest.mark.parametrize("full_fraction", (0.0, 0.5, 1.0))
def test_mdlm_mask_schedule_equals_brute_force(packed_rows, full_fraction):
    """The masked-diffusion mixture: masks, ratios and 1/t weights against a block-by-block
    reference from the same uniform draws; its statistics (the fully masked fraction, the masked
    fraction tracking t, each partial block's expected weight equal to a fully masked one's)."""
    key, (b, n), bs = jax.random.PRNGKey(3), (8, 256), 8
    m, sc = masks.mask_draw(key, (b, n), bs, "mdlm", full_fraction)
    m, sc = np.asarray(m), np.asarray(sc)[..., 0]
    k_ratio, k_pos, k_force, k_full = jax.random.split(key, 4)
    u_ratio = np.asarray(jax.random.uniform(k_ratio, (b, n, 1)))[..., 0]
    u_pos = np.asarray(jax.random.uniform(k_pos, (b, n, bs)))
    force = 1 + np.asarray(jax.random.randint(k_force, (b, n, 1), 0, bs - 1))[..., 0]
    u_full = np.asarray(jax.random.uniform(k_full, (b, n, 1)))[..., 0]
    bm, bsc = brute_mdlm(u_ratio, u_pos, force, u_full, bs, full_fraction)
    np.testing.assert_array_equal(m, bm)
    np.testing.assert_allclose(sc, bsc, rtol=1e-6)
    assert not m[..., 0].any() and m[..., 1:].any(-1).all()
    full = m[..., 1:].all(-1) & (sc == 1.0)
    if full_fraction == 1.0:
        assert full.all()
        np.testing.assert_array_equal(m, masks.mask_pattern(None, (b, n), bs, "all"))
        return
    part = u_full >= full_fraction
    assert abs(part.mean() - (1 - full_fraction)) < 0.03
    t = 1.0 - u_ratio[part]
    frac = m[..., 1:][part].mean(-1)
    assert np.corrcoef(t, frac)[0, 1] > 0.8  # the masked fraction follows the drawn ratio
    assert (sc[part] > 1.0).mean() > 0.8 and sc[part].max() <= bs - 1 + 1e-5
    # ELBO balance: a partial block's masked positions (1 forced + each other w.p. t), weighted
    # 1/max(t, 1/(bs-1)), weigh E = int_0^1 (1 + (bs-2) t) / max(t, 1/(bs-1)) dt (1.22 (bs-1) at
    # bs 8, 1.15 at 16: the forced position's share), comparable to a full block's bs - 1.
    mass = (m[..., 1:] * sc[..., None]).sum(-1)
    tt = (np.arange(200000) + 0.5) / 200000
    expect = np.mean((1 + (bs - 2) * tt) / np.maximum(tt, 1 / (bs - 1)))
    assert abs(mass[part].mean() / expect - 1.0) < 0.05 and 1.0 < expect / (bs - 1) < 1.3
    # The weights: today's (decay, in-bounds, loss mask) x masked x 1/t.
    a, v = jnp.zeros((b, n), jnp.int32), jnp.ones((b, n), bool)
    lm = jnp.ones((b, 32), jnp.int32)
    w = masks.loss_weights(a, v, lm, bs, 4.0, masked_BNK=jnp.asarray(m), scale_BN1=sc[..., None])
    ref = brute_weights(np.asarray(a), np.asarray(v), np.asarray(lm), bs, 4.0) * bm * bsc[..., None]
    np.testing.assert_allclose(np.asarray(w), ref, rtol=1e-6)


# ------------------------------------------------------------------ end-to-end on a tiny target

import dataclasses
import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import optax

import dflash_jax as dj
from configs import tiny_test
from dflash_jax.training import drafter_setup, experiment, losses, run_log, trainer
from dflash_jax.training.checkpointing import Checkpointer
from dflash_jax.training.metrics import read_event_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def regen_file(tmp_path_factory):
    """The tiny target's greedy responses, generated once for every run of this module."""
    return str(tmp_path_factory.mktemp("regen") / "regenerated.jsonl")


def tiny_config(regen_file, **kw):
    c = tiny_test.get_config()
    c.regen.output = regen_file
    for key, value in kw.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return c


@pytest.fixture(scope="module")
def trained(regen_file, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("trained"))
    cfg = tiny_config(regen_file, num_train_steps=300, eval_every=300, log_every=50)
    return cfg, workdir, trainer.train_and_evaluate(cfg, workdir)


def _tiny_target(cfg):
    tcfg = experiment.model_config_from(cfg, 0)
    return dj.Target(tcfg, experiment.fresh_target_params(tcfg, cfg.target_model))


def test_the_experiment_trains_what_the_drafters_training_kind_builds(
    regen_file, monkeypatch, tmp_path
):
    """`build_experiment` takes the drafter, its parameters, loss and vocabulary from
    config.drafter.kind's training kind (`drafter_setup.TRAINED_KINDS`), never testing for a
    kind itself; target mode asks none."""
    built = []

    class Wrapping(drafter_setup.DFlashTraining):
        def build(self, inputs):
            out = super().build(inputs)
            built.append((inputs, out))
            return dataclasses.replace(out, loss_fn=lambda *a: out.loss_fn(*a), vocab="vocab")

    monkeypatch.setattr(
        drafter_setup, "TRAINED_KINDS", (Wrapping(), drafter_setup.Eagle3Training())
    )
    cfg = tiny_config(regen_file)
    exp = experiment.build_experiment(cfg, str(tmp_path / "d"))
    ((inputs, out),) = built
    assert inputs.config is cfg and inputs.target_cfg is exp.target_cfg
    assert exp.drafter_cfg is out.config and exp.dmod is out.module
    assert exp.init_params is out.init_params and exp.drafter_vocab == "vocab"
    assert exp.loss_fn is not out.loss_fn and exp.loss_fn.__name__ == "<lambda>"
    assert drafter_setup.training_kind(tiny_config(regen_file, mode="target")) is None


def test_drafter_learns_the_targets_greedy_outputs(trained):
    cfg, workdir, out = trained
    assert out["status"] == "done" and out["step"] == 300
    losses_ = [l for _, l in out["losses"]]
    assert np.mean(losses_[-20:]) < 0.7 * np.mean(losses_[:20])
    assert out["eval"]["tau"] >= 2.0, out["eval"]
    # Metrics went to JSONL and to TensorBoard event files.
    recs = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
    assert any(r["split"] == "eval" and "tau" in r for r in recs)
    tb = os.path.join(workdir, "tb", "train")
    scalars = list(read_event_scalars(os.path.join(tb, os.listdir(tb)[0])))
    assert ("loss" in {t for _, t, _ in scalars}) and max(s for s, _, _ in scalars) == 300


def test_regen_only_writes_responses_and_does_not_train(tmp_path):
    out_file = str(tmp_path / "only.jsonl")
    cfg = tiny_config(out_file, **{"regen.only": True, "regen.num_prompts": 24})
    out = trainer.train_and_evaluate(cfg, str(tmp_path / "work"))
    assert out["status"] == "regenerated" and out["regenerated"] == out_file
    recs = [json.loads(l) for l in open(out_file)]
    assert len(recs) == 24 and all(len(r["response_ids"]) > 0 for r in recs)
    assert not os.path.exists(tmp_path / "work" / "checkpoints") and out["export"] is None
    with pytest.raises(ValueError, match="regen.only"):
        trainer.train_and_evaluate(
            tiny_config(out_file, **{"regen.only": True, "mode": "target"}), str(tmp_path / "work2")
        )


def test_export_load_generate(trained, regen_file):
    cfg, workdir, out = trained
    target = _tiny_target(cfg)
    drafter = dj.load_drafter(out["export"], target=target)
    assert drafter.config.block_size == 8 and drafter.config.target_layer_ids == (0, 1)
    prompts = [r["prompt_ids"] for r in map(json.loads, open(regen_file))][-6:]
    spec = dj.generate(target, drafter, prompts, 40)
    ar = dj.generate(target, None, prompts, 40)
    assert spec.tokens == ar.tokens  # lossless
    assert spec.stats["tau"] >= 2.0


def test_a_dflash2_drafter_trains_exports_and_is_lossless(regen_file, trained, tmp_path):
    """drafter.dflash2: the convolutions, logit rule and candidate selector trained with the
    selector's objective beside the drafter's loss; the export is a DFlash 2 drafter whose
    drafts are accepted and whose output equals autoregressive decoding."""
    kw = {
        "num_train_steps": 300,
        "eval_every": 300,
        "log_every": 50,
        "drafter.dflash2.enabled": True,
        "drafter.dflash2.conv_group_size": 8,
        "drafter.dflash2.selector_rank": 16,
        "drafter.dflash2.selector_top_k": 4,
    }
    out = trainer.train_and_evaluate(tiny_config(regen_file, **kw), str(tmp_path / "w"))
    assert out["status"] == "done"
    recs = [json.loads(l) for l in open(tmp_path / "w" / "metrics.jsonl")]
    last = [r for r in recs if r["split"] == "train"][-1]
    assert last["selector_coverage"] > 0.7 and last["selector_acc"] > 0.8, last
    cfg = trained[0]
    target = _tiny_target(cfg)
    drafter = dj.load_drafter(out["export"], target=target)
    assert drafter.config.dflash2 and drafter.config.selector_top_k == 4
    prompts = [r["prompt_ids"] for r in map(json.loads, open(regen_file))][-6:]
    spec = dj.generate(target, drafter, prompts, 40)
    assert spec.tokens == dj.generate(target, None, prompts, 40).tokens
    assert spec.stats["tau"] >= 2.0, spec.stats["tau"]


def test_an_eagle3_drafter_trains_with_ttt_exports_and_is_lossless(tmp_path):
    """drafter.kind "eagle3" (issue 43): an EAGLE-3 drafter trained with training-time test over
    a draft vocabulary of the most frequent label tokens (smaller than the target's), on a
    3-layer tiny target's own greedy outputs (EAGLE-3 reads three distinct layers); the export
    is a published-format EAGLE-3 directory whose drafts are accepted and whose output equals
    autoregressive decoding, batched."""
    regen = str(tmp_path / "regen.jsonl")
    kw = {
        "num_train_steps": 200,
        "eval_every": 200,
        "log_every": 50,
        "target_model.num_layers": 3,
        "drafter.kind": "eagle3",
        "drafter.target_layer_ids": (0, 1, 2),
        "drafter.eagle3.ttt_steps": 3,
        "drafter.eagle3.draft_vocab_size": 48,
    }
    cfg = tiny_config(regen, **kw)
    out = trainer.train_and_evaluate(cfg, str(tmp_path / "w"))
    assert out["status"] == "done"
    recs = [json.loads(l) for l in open(tmp_path / "w" / "metrics.jsonl")]
    train = [r for r in recs if r["split"] == "train"]
    assert train[-1]["loss"] < 0.5 * train[0]["loss"], (train[0], train[-1])
    target = _tiny_target(cfg)
    drafter = dj.load_eagle3(out["export"], target=target)
    assert drafter.config.draft_vocab_size == 48 < target.config.vocab_size
    assert drafter.embedding is None  # the target's embedding, shared
    prompts = [r["prompt_ids"] for r in map(json.loads, open(regen))][-6:]
    spec = dj.generate(target, drafter, prompts, 40, block_size=4)
    assert spec.tokens == dj.generate(target, None, prompts, 40).tokens
    assert spec.stats["tau"] >= 1.8, spec.stats["tau"]
    assert max(a for acc in spec.acceptance_lengths for a in acc) == 4


def test_teacher_positions_predict_the_labels_on_greedy_data(regen_file, trained):
    """On the target's own greedy text, the target's argmax at p+k-1 is x_{p+k}: the KL soft
    labels line up with the same-position hard labels (no off-by-one)."""
    cfg = trained[0]
    target = _tiny_target(cfg)
    rec = [json.loads(l) for l in open(regen_file)][0]
    ids = np.asarray([rec["prompt_ids"] + rec["response_ids"]], np.int32)
    logits = np.asarray(target.forward(ids).logits)
    lm = np.zeros_like(ids)
    lm[0, len(rec["prompt_ids"]) :] = 1
    anchors, valid = masks.sample_anchors(jax.random.PRNGKey(0), jnp.asarray(lm), 8, 8)
    src = np.asarray(masks.teacher_positions(anchors, 8, ids.shape[1]))
    labels = np.asarray(masks.block_labels(jnp.asarray(ids), anchors, 8))
    w = np.asarray(masks.loss_weights(anchors, valid, jnp.asarray(lm), 8, 4.0))
    pred = logits[0].argmax(-1)[src[0]]
    assert np.all(pred[w[0] > 0] == labels[0][w[0] > 0])


@pytest.mark.parametrize("loss,schedule", [("kl", "all"), ("ce", "random"), ("ce", "mdlm")])
def test_loss_options_give_finite_gradients(trained, loss, schedule):
    cfg = trained[0]
    target = _tiny_target(cfg)
    dcfg = dj.make_drafter_config(
        target.config, num_layers=1, num_taps=2, block_size=8, target_layer_ids=(0, 1)
    )
    recipe = losses.DrafterRecipe(
        block_size=8,
        mask_token_id=dcfg.mask_token_id,
        tap_layers=(0, 1),
        num_anchors=6,
        gamma=4.0,
        loss=loss,
        mask_schedule=schedule,
        mask_full_fraction=0.5,
    )
    rng = np.random.RandomState(0)
    batch = {
        "input_ids": jnp.asarray(rng.randint(0, 64, (2, 32)), jnp.int32),
        "loss_mask": jnp.ones((2, 32), jnp.int32),
        "segment_ids": jnp.ones((2, 32), jnp.int32),
    }
    key0 = jax.random.PRNGKey(0)
    fn = lambda p: losses.drafter_loss(
        target.module,
        dj.DFlashDrafter(dcfg),
        recipe,
        p,
        target.params,
        batch,
        key0,
    )
    # One compiled program: op by op, the loss and its gradient dispatch thousands of ops.
    step = jax.jit(jax.value_and_grad(fn, has_aux=True))
    params = dj.init_drafter_params(dcfg)
    (l, m), g = step(params)
    assert np.isfinite(float(l)) and float(l) > 0
    assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(g))
    if schedule == "mdlm":
        # The mixture's draws: fully masked and partial blocks both scored, 1/t weights > 1.
        _, _, masked, scale = jax.jit(
            lambda lm, seg: losses.drafter_draws(recipe, lm, seg, losses.row_keys(key0, 2))
        )(batch["loss_mask"], batch["segment_ids"])
        full = np.asarray(masked)[..., 1:].all(-1)
        assert full.any() and (~full).any() and float(np.max(scale)) > 1.0
        # A training step with the mixture: a gradient step lowers its loss on the same draws.
        lr = 0.05 / max(float(optax.tree.norm(g)), 1e-6)
        (l2, _), _ = step(jax.tree_util.tree_map(lambda p, d: p - lr * d, params, g))
        assert float(l2) < float(l)


def test_block_scores_brute_force_and_chunked_loss_equals_one_shot(trained):
    """block_scores against numpy (CE and KL); the drafter loss with the logits chunked over
    anchors (4 of 6: a ragged last chunk) equals the one-shot loss and metrics (CE, KL) and
    gradients (KL)."""
    cfg = trained[0]
    target = _tiny_target(cfg)
    tmod = target.module
    rng = np.random.RandomState(1)
    h = jnp.asarray(rng.randn(2, 3, 4, target.config.hidden_size), jnp.float32)
    th = jnp.asarray(rng.randn(2, 3, 4, target.config.hidden_size), jnp.float32)
    lab = jnp.asarray(rng.randint(0, target.config.vocab_size, (2, 3, 4)), jnp.int32)
    logits = lambda x: np.asarray(
        tmod.apply({"params": target.params}, x.reshape(2, 12, -1), method=dj.Transformer.logits),
        np.float64,
    ).reshape(2, 3, 4, -1)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, tlp = log_softmax(logits(h)), log_softmax(logits(th))
    ce, corr = losses.block_scores(tmod, target.params, h, lab, None, "ce")
    np.testing.assert_allclose(
        ce, -np.take_along_axis(lp, np.asarray(lab)[..., None], -1)[..., 0], rtol=1e-5
    )
    assert np.array_equal(corr, lp.argmax(-1) == np.asarray(lab))
    kl, _ = losses.block_scores(tmod, target.params, h, lab, th, "kl", chunk_anchors=2)
    np.testing.assert_allclose(kl, (np.exp(tlp) * (tlp - lp)).sum(-1), rtol=1e-4, atol=1e-6)

    dcfg = dj.make_drafter_config(
        target.config, num_layers=1, num_taps=2, block_size=8, target_layer_ids=(0, 1)
    )
    batch = {
        "input_ids": jnp.asarray(rng.randint(0, 64, (2, 32)), jnp.int32),
        "loss_mask": jnp.ones((2, 32), jnp.int32),
        "segment_ids": jnp.ones((2, 32), jnp.int32),
    }
    dparams = dj.init_drafter_params(dcfg, 3)
    for loss in ("ce", "kl"):
        out = []
        for chunk in (0, 4):
            recipe = losses.DrafterRecipe(
                block_size=8,
                mask_token_id=dcfg.mask_token_id,
                tap_layers=(0, 1),
                num_anchors=6,
                gamma=4.0,
                loss=loss,
                loss_chunk_anchors=chunk,
            )
            fn = lambda p: losses.drafter_loss(
                tmod, dj.DFlashDrafter(dcfg), recipe, p, target.params, batch, jax.random.PRNGKey(0)
            )
            # The gradients through the chunked scan for KL (the loss with the most code
            # between the chunks and the logits); CE's loss and metrics (each jitted program is
            # ~4 s of compile: this test's whole cost).
            if loss == "kl":
                out.append(jax.jit(jax.value_and_grad(fn, has_aux=True))(dparams))
            else:
                out.append((jax.jit(fn)(dparams), None))
        ((l0, m0), g0), ((l1, m1), g1) = out
        np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
        for k in m0:
            np.testing.assert_allclose(m1[k], m0[k], rtol=1e-6, err_msg=k)
        if loss == "kl":
            for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)):
                np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)


def test_resume_reproduces_losses_and_corrupt_checkpoint_falls_back(
    regen_file, tmp_path, capfd, caplog
):
    kw = dict(num_train_steps=12, checkpoint_every=4, eval_every=0, log_every=4, export=False)
    full = trainer.train_and_evaluate(tiny_config(regen_file, **kw), str(tmp_path / "a"))
    wd = str(tmp_path / "b")
    first = trainer.train_and_evaluate(tiny_config(regen_file, stop_at_step=6, **kw), wd)
    assert first["status"] == "stopped" and first["step"] == 6
    second = trainer.train_and_evaluate(tiny_config(regen_file, **kw), wd)
    assert second["status"] == "done"
    assert first["losses"] + second["losses"] == full["losses"]  # exactly
    # Corrupt the newest checkpoint (12): its array data gone, its metadata readable, so the
    # restore itself fails inside TensorStore and leaves its read tasks behind. Restoring
    # warns once and falls back to 8, quietly: no traceback of those tasks on stderr (asyncio's
    # "never retrieved" records, the garbage collector's "Exception ignored in").
    step_dir = os.path.join(wd, "checkpoints", "12", "state")
    for root, _, files in os.walk(step_dir):
        if os.path.basename(root) == "d":
            for f in files:
                os.remove(os.path.join(root, f))
    older = _snapshot(os.path.join(wd, "checkpoints"), ("4", "8"))
    capfd.readouterr()
    with caplog.at_level(logging.INFO):
        third = trainer.train_and_evaluate(tiny_config(regen_file, **kw), wd)
        gc.collect()  # what the restore left behind, collected while the output is captured
    assert third["losses"] == full["losses"][8:]
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([m for m in warned if "unreadable" in m]) == 1, warned
    assert "checkpoint step 12" in warned[0] and "\n" not in warned[0], warned
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert not any(r.exc_info for r in caplog.records if r.levelno >= logging.INFO)
    # The redone step 12 replaced the corrupt checkpoint; the older ones are intact.
    assert _snapshot(os.path.join(wd, "checkpoints"), ("4", "8")) == older
    ck = Checkpointer(os.path.join(wd, "checkpoints"), 4)
    assert int(ck.manager.restore(12).state["step"]) == 12  # readable again
    ck.close()
    # metrics.jsonl: each train step once, although steps 9..12 ran twice.
    steps = [
        json.loads(l)["step"]
        for l in open(os.path.join(wd, "metrics.jsonl"))
        if json.loads(l)["split"] == "train"
    ]
    assert steps == sorted(set(steps)) and steps[-1] == 12, steps


def _snapshot(directory, steps):
    """{relative path: bytes} of every file of the given checkpoint steps."""
    out = {}
    for step in steps:
        for root, _, files in os.walk(os.path.join(directory, step)):
            for f in files:
                path = os.path.join(root, f)
                out[os.path.relpath(path, directory)] = open(path, "rb").read()
    assert out
    return out


def test_incompatible_checkpoint_stops_before_training_and_keep_n_spares_good_work(
    regen_file, tmp_path, caplog
):
    from dflash_jax.training.checkpointing import IncompatibleCheckpointError

    kw = dict(
        num_train_steps=12,
        checkpoint_every=4,
        eval_every=0,
        log_every=4,
        export=False,
        keep_checkpoints=1,
    )
    wd = str(tmp_path / "w")
    trainer.train_and_evaluate(tiny_config(regen_file, stop_at_step=8, **kw), wd)
    ckdir = os.path.join(wd, "checkpoints")
    assert sorted(os.listdir(ckdir)) == ["8"]  # keep 1
    before = _snapshot(ckdir, ("8",))
    metrics_before = open(os.path.join(wd, "metrics.jsonl")).read()
    # A changed model shape: one line naming the differing parameters and the directory; the
    # checkpoint stays byte for byte, nothing is trained or logged.
    with pytest.raises(IncompatibleCheckpointError) as e:
        trainer.train_and_evaluate(tiny_config(regen_file, **{"drafter.num_layers": 2}, **kw), wd)
    msg = str(e.value)
    assert "\n" not in msg and ckdir in msg and "params.layers_1" in msg, msg
    assert sorted(os.listdir(ckdir)) == ["8"] and _snapshot(ckdir, ("8",)) == before
    assert open(os.path.join(wd, "metrics.jsonl")).read() == metrics_before
    # Keep 1 with a corrupt newer step 12 on disk: resuming from 8 and stopping at 10 keeps the
    # newest good checkpoint (10), not the corrupt one alone.
    os.makedirs(os.path.join(ckdir, "12"))
    for item in os.listdir(os.path.join(ckdir, "8")):
        src = os.path.join(ckdir, "8", item)
        if os.path.isdir(src):
            os.makedirs(os.path.join(ckdir, "12", item))
            for f in os.listdir(src):
                if os.path.isfile(os.path.join(src, f)):
                    open(os.path.join(ckdir, "12", item, f), "wb").write(b"\x00" * 7)
        else:
            open(os.path.join(ckdir, "12", item), "wb").write(open(src, "rb").read())
    with caplog.at_level(logging.WARNING):
        out = trainer.train_and_evaluate(tiny_config(regen_file, **dict(kw, stop_at_step=10)), wd)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([m for m in warned if re.search("step 12 .* unreadable", m)]) == 1, warned
    assert out["step"] == 10 and [s for s, _ in out["losses"]] == [9, 10]
    assert sorted(os.listdir(ckdir), key=int) == ["10", "12"]
    ck = Checkpointer(ckdir, 4)
    assert int(ck.manager.restore(10).state["step"]) == 10
    ck.close()


def test_nan_loss_stops_and_keeps_last_good_checkpoint(regen_file, tmp_path):
    cfg = tiny_config(
        regen_file,
        num_train_steps=20,
        learning_rate=1e38,
        checkpoint_every=1,
        eval_every=0,
        export=False,
    )
    out = trainer.train_and_evaluate(cfg, str(tmp_path))
    assert out["status"] == "nan" and out["export"] is None
    saved = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit())
    assert saved and saved[-1] == out["step"] < 20  # nothing saved from the NaN step
    assert all(np.isfinite(l) for _, l in out["losses"])


def test_sigterm_saves_a_checkpoint_that_resumes(regen_file, tmp_path, trained):
    wd = str(tmp_path / "run")
    args = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        f"--config={os.path.join(ROOT, 'configs', 'tiny_test.py')}",
        f"--workdir={wd}",
        f"--config.regen.output={regen_file}",
        "--config.num_train_steps=100000",
        "--config.checkpoint_every=100000",
        "--config.eval_every=0",
        "--config.log_every=1",
        "--config.export=False",
    ]
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    deadline = time.time() + 120
    for line in proc.stdout:
        if line.startswith("step 3/"):
            break
        assert time.time() < deadline, "training did not start"
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 3, rest[-2000:]  # EXIT_PREEMPTED: saved, not success
    saved = [int(s) for s in os.listdir(os.path.join(wd, "checkpoints")) if s.isdigit()]
    assert len(saved) == 1 and saved[0] >= 3
    cfg = tiny_config(
        regen_file,
        num_train_steps=100000,
        stop_at_step=saved[0] + 2,
        eval_every=0,
        export=False,
        checkpoint_every=100000,
    )
    out = trainer.train_and_evaluate(cfg, wd)
    assert [s for s, _ in out["losses"]] == [saved[0] + 1, saved[0] + 2]


def test_repeated_ngram_mask_and_batch():
    from dflash_jax.training import unlikelihood as ul

    prompt, cont = [1, 2, 3, 4], [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6]
    mask = ul.repeated_ngram_mask(prompt + cont, len(prompt), 4)
    # (1,2,3,4) at 9 repeats the one at 4 (the prompt's own copy does not count), (2,3,4,5)
    # at 10 the one at 5; (3,4,5,6) is new.
    assert np.flatnonzero(mask).tolist() == [9, 10, 11, 12, 13]
    assert not ul.repeated_ngram_mask([7] * 3, 0, 4).any()  # shorter than n
    assert ul.repeated_ngram_mask([7] * 6, 0, 4).tolist() == [False] + [True] * 5
    batch, frac = ul.build_batch([prompt, [9]], [cont, [8, 8]], 20, 4, pad_id=0)
    assert frac == 5 / 13
    assert batch["ul_ids"][0, :15].tolist() == prompt + cont
    assert batch["ul_mask"][0].tolist() == mask.astype(int).tolist() + [0] * 5
    assert batch["ul_segment_ids"][1].tolist() == [1, 1, 1] + [0] * 17


def test_unlikelihood_training_lowers_greedy_repetition(tmp_path):
    """A target trained on random-token documents with the unlikelihood term repeats 4-grams in
    its greedy continuations less than the same run without it (same data, seed and steps)."""
    # The setting and the measure of benchmarks/experiments/unlikelihood/unlikelihood_toy.py
    # (the figure in the docs).
    from benchmarks.experiments.unlikelihood import unlikelihood_toy as toy

    rates = {w: toy.repeated_share(w, str(tmp_path / str(w))) for w in (0.0, 1.0)}
    assert rates[1.0] < 0.6 * rates[0.0], rates
    recs = [json.loads(line) for line in open(tmp_path / "1.0" / "metrics.jsonl")]
    logged = [r for r in recs if r["split"] == "train"]
    assert all(0 <= r["rep_frac"] <= 1 and np.isfinite(r["ul_loss"]) for r in logged)
    assert "rep_frac" not in json.loads(open(tmp_path / "0.0" / "metrics.jsonl").readline())
    with pytest.raises(ValueError, match="prompt_source"):
        c = toy.toy_config(1.0)
        c.unlikelihood.prompt_source = "functions"  # synthetic documents have no text
        experiment.build_experiment(c, str(tmp_path / "bad"))


def test_every_config_sets_only_keys_the_trainer_reads():
    """configs/*.py: each builds, and every key it holds is one of configs/default.py's (a typo
    in a config would otherwise be a silently ignored setting)."""
    import importlib
    import os

    from configs.default import get_config as default_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def keys(d, prefix=""):
        out = set()
        for k, v in d.items():
            out.add(prefix + k)
            if hasattr(v, "items"):
                out |= keys(v, prefix + k + ".")
        return out

    known = keys(default_config())
    cdir = os.path.join(root, "configs")  # configs/*.py and configs/<group>/*.py
    names = sorted(
        os.path.relpath(os.path.join(d, f), cdir)[:-3].replace(os.sep, ".")
        for d, _, fs in os.walk(cdir)
        for f in fs
        if f.endswith(".py") and f not in ("__init__.py", "paper_recipe.py")
    )
    assert {"tiny_code.target", "tiny_code.target_stage2", "tiny_code.drafter_stage2"} <= set(names)
    for name in names:
        cfg = importlib.import_module(f"configs.{name}").get_config()
        assert keys(cfg) <= known, (name, keys(cfg) - known)
        assert cfg.num_train_steps != 0 and cfg.mode in ("target", "drafter"), name


def test_a_time_sliced_stage_exports_its_drafter(regen_file, tmp_path):
    """stop_at_step ends a stage early (the schedule unchanged): it saves a checkpoint and exports
    the drafter so far, which loads and equals the checkpoint's parameters; the next stage
    resumes from the checkpoint."""
    kw = dict(num_train_steps=12, checkpoint_every=100, eval_every=0, log_every=4)
    wd = str(tmp_path / "w")
    out = trainer.train_and_evaluate(tiny_config(regen_file, stop_at_step=3, **kw), wd)
    assert out["status"] == "stopped" and out["step"] == 3
    assert out["export"] and os.path.isfile(os.path.join(out["export"], "config.json"))
    cfg = tiny_config(regen_file, **kw)
    target = _tiny_target(cfg)
    exported = dj.load_drafter(out["export"], target=target)
    restored = Checkpointer(os.path.join(wd, "checkpoints"), 4).manager.restore(3)
    want = jax.tree_util.tree_leaves(restored.state["params"])
    got = jax.tree_util.tree_leaves(exported.params)
    assert len(got) == len(want)
    for a, b in zip(sorted(got, key=np.shape), sorted(want, key=np.shape)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32))
    again = trainer.train_and_evaluate(tiny_config(regen_file, stop_at_step=5, **kw), wd)
    assert [s for s, _ in again["losses"]] == [4, 5]


def test_fc_init_tap_rms_equalizes_the_tapped_features(regen_file):
    """drafter.fc_init='tap_rms': fc's rows are scaled by median / RMS of their tapped feature
    (measured over a held-out batch, the first position left out), so each feature's
    contribution to the context has the same scale; checked against a NumPy statement of the
    rule on the target's own taps, with one feature made 1000x larger (a massive activation)."""
    cfg = tiny_config(regen_file)
    exp = experiment.build_experiment(cfg, None)
    tmod, dcfg = exp.tmod, exp.drafter_cfg
    big = dict(exp.target_params)
    # A massive activation: layer 0's output gains a huge constant dimension through its MLP
    # down-projection bias-free row (the residual stream, hence the taps, carry it).
    down = np.array(big["layers_0"]["mlp"]["down_proj"]["kernel"])
    down[:, 3] *= 1000.0
    big["layers_0"] = {
        **big["layers_0"],
        "mlp": {**big["layers_0"]["mlp"], "down_proj": {"kernel": jnp.asarray(down)}},
    }
    batch = exp.eval_batches[0]
    rms = drafter_setup.tap_rms(tmod, big, dcfg, [batch])
    taps = tmod.apply(
        {"params": big}, jnp.asarray(batch["input_ids"]), tuple(dcfg.target_layer_ids),
        segment_ids_BT=jnp.asarray(batch["segment_ids"]), method=dj.Transformer.taps,
    )  # fmt: skip
    x = np.asarray(taps, np.float64)[:, 1:][np.asarray(batch["segment_ids"])[:, 1:] > 0]
    np.testing.assert_allclose(rms, np.sqrt((x**2).mean(0)), rtol=1e-4)
    assert rms.max() > 50 * np.median(rms)  # the massive dimension is there
    params = dj.init_drafter_params(dcfg, 0)
    scaled = drafter_setup.scale_fc_by_tap_rms(params, tmod, big, dcfg, [batch])
    w0, w1 = np.asarray(params["fc"]["kernel"]), np.asarray(scaled["fc"]["kernel"])
    np.testing.assert_allclose(w1, w0 * (np.median(rms) / rms)[:, None], rtol=1e-5)
    # Each feature's contribution x_j * W_jk now has the same scale (within sampling noise).
    contrib = rms[:, None] * np.abs(w1)
    per_feature = contrib.mean(1)
    assert per_feature.max() < 3 * np.median(per_feature)
    with pytest.raises(ValueError, match="fc_init='tap_rms' needs held-out batches"):
        drafter_setup.scale_fc_by_tap_rms(params, tmod, big, dcfg, [])


@pytest.mark.parametrize("kind", ("dflash", "eagle3"))
def test_tap_cache_skips_the_target_after_an_epoch_and_trains_the_same(
    regen_file, trained, tmp_path, monkeypatch, kind
):
    """data.cache_taps: from the second epoch the batches' taps come from host memory (the
    target's pass runs once per document piece, not once per step), and training is the same:
    every step's loss equals a run without the cache (both with allow_split=False) to float
    rounding, and a kept batch's taps equal the target's pass over it."""
    from dflash_jax.training import tap_cache

    made, calls = [], []
    real_fn, real_cache = tap_cache.make_taps_fn, tap_cache.TapCache

    def counting_fn(tmod, layers):
        fn = real_fn(tmod, layers)
        made.append(fn)

        def call(*a):
            calls.append(a[1].shape)
            return fn(*a)

        return call

    def keeping_cache(*a, **k):
        made.append(real_cache(*a, **k))
        return made[-1]

    kw = {"eval_every": 0, "log_every": 1, "data.allow_split": False}
    if kind == "eagle3":
        kw.update(
            {
                "target_model.num_layers": 3,
                "drafter.kind": "eagle3",
                "drafter.target_layer_ids": (0, 1, 2),
                "drafter.eagle3.ttt_steps": 2,
                "drafter.eagle3.draft_vocab_size": 48,
            }
        )
    it = experiment.build_experiment(tiny_config(regen_file, **kw), str(tmp_path / "x")).train_iter
    per_epoch = 0  # batches until the first epoch's last piece is read (padded rows included)
    while it.epoch == 0:
        next(it)
        per_epoch += 1
    steps = per_epoch + 6  # into the second epoch
    kw["num_train_steps"] = steps
    monkeypatch.setattr(tap_cache, "make_taps_fn", counting_fn)
    monkeypatch.setattr(tap_cache, "TapCache", keeping_cache)
    plain = trainer.train_and_evaluate(tiny_config(regen_file, **kw), str(tmp_path / "plain"))
    assert not calls  # no cache: the loss runs the target itself
    cached = trainer.train_and_evaluate(
        tiny_config(regen_file, **{**kw, "data.cache_taps": True}), str(tmp_path / "cached")
    )
    cache = next(m for m in made if isinstance(m, real_cache))
    assert cache.hits >= 5 and len(calls) == steps - cache.hits <= per_epoch + 1, (
        cache.hits,
        len(calls),
        per_epoch,
    )
    assert [s for s, _ in cached["losses"]] == [s for s, _ in plain["losses"]]
    np.testing.assert_allclose(
        [l for _, l in cached["losses"]], [l for _, l in plain["losses"]], rtol=2e-5
    )
    # A kept batch against the target's pass over it (NumPy: what was kept is what it computes).
    cfg = tiny_config(regen_file, **{**kw, "data.cache_taps": True})
    exp = experiment.build_experiment(cfg, str(tmp_path / "y"))
    for _ in range(steps):
        batch = next(exp.train_iter)
    want = np.asarray(
        real_fn(exp.tmod, exp.tap_layers)(exp.frozen, batch["input_ids"], batch["segment_ids"])
    )
    got = cache.lookup(batch)
    assert got is not None
    real = batch["segment_ids"] > 0
    np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_tap_cache_settings_are_refused_in_one_line(regen_file, tmp_path):
    from dflash_jax.support.checks import ConfigError
    from dflash_jax.training import tap_cache

    ok = {"data.cache_taps": True, "data.allow_split": False}
    tap_cache.check_tap_cache(tiny_config(regen_file, **ok))
    for bad, words in (
        ({"data.allow_split": True}, "data.allow_split=True"),
        ({"loss": "kl"}, "loss='kl'"),
        ({"mode": "target"}, "mode='target'"),
        ({"data.num_shards": 2}, "several processes"),
        ({"data.cache_taps_dtype": "int8"}, "cache_taps_dtype"),
    ):
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            trainer.preflight(tiny_config(regen_file, **{**ok, **bad}), str(tmp_path / "w"))
        assert str(e.value).startswith("data.cache_taps: ") and "\n" not in str(e.value)


def test_logged_throughput_is_the_wall_time_between_log_lines(monkeypatch):
    """tokens_per_s is steps x tokens over the wall time since the last log line, waits inside
    writing a line included (a device value fetched for the line waits for the step just
    dispatched): on a fake clock, steps of 1 s and lines that wait 10 s, the windows' times sum
    to the clock's. (Resetting the window after the line read a 5-step window as 4 steps.)"""
    from types import SimpleNamespace as NS

    clock = [100.0]
    monkeypatch.setattr(run_log.time, "time", lambda: clock[0])

    class Logger:
        recs = []

        def write(self, split, step, rec):
            self.recs.append(rec)
            clock[0] += 10.0  # the line waits

    cfg = NS(data=NS(batch_size=2, seq_len=8), log_every=1)
    run = NS(state=NS(step=0), total=4, stop_at=4, schedule=lambda k: 0.1, exp=NS(mode="target"))
    bar = NS(update=lambda n: None, set_postfix_str=lambda *a, **k: None)
    window = trainer._LogWindow(cfg, run, Logger(), bar)
    for k in range(1, 5):
        clock[0] += 1.0  # the step
        assert window.finish(k, {"loss": np.float32(1.0), "grad_norm": np.float32(0.5)}, None)
    seconds = [16 / r["tokens_per_s"] for r in Logger.recs]
    np.testing.assert_allclose(seconds, [1.0, 11.0, 11.0, 11.0])
    assert sum(seconds) == pytest.approx(clock[0] - 10.0 - 100.0)  # to the last line's start


def test_logged_learning_rate_is_the_schedule_computed_on_the_host():
    """The learning rate a log line records is make_optimizer's warmup-cosine schedule (NumPy
    statement: linear from 0 to the peak over the warmup, then a half cosine to the end value),
    computed on the host's CPU device, not queued on the device running the steps."""
    from types import SimpleNamespace as NS

    from dflash_jax.training.step import make_optimizer

    cfg = NS(
        learning_rate=6e-4,
        warmup_ratio=0.1,
        end_lr_ratio=0.1,
        grad_clip=1.0,
        b1=0.9,
        b2=0.95,
        weight_decay=0.0,
    )
    _, schedule = make_optimizer(cfg, 100)
    seen = []

    def watched(k):
        seen.append(jax.config.jax_default_device)  # None unless set around the call
        return schedule(k)

    warm, peak, end = 10, 6e-4, 6e-5
    for k in (0, 5, 10, 55, 99):
        want = (
            peak * k / warm
            if k < warm
            else (end + (peak - end) * 0.5 * (1 + math.cos(math.pi * (k - warm) / (100 - warm))))
        )
        got = trainer._host_value(watched, k)
        assert isinstance(got, float) and got == pytest.approx(want, rel=1e-6), k
    assert seen == [jax.local_devices(backend="cpu")[0]] * 5


def test_tap_cache_finds_each_piece_wherever_it_is_packed():
    """TapCache: pieces kept by (document, offset) come back at any row and position of another
    batch (bfloat16 storage: rounded once, half the bytes), zeros in the padding; a batch with
    a piece not kept is a miss."""
    import ml_dtypes

    from dflash_jax.training.tap_cache import TapCache

    rng = np.random.default_rng(0)
    f = 6

    def batch(rows):  # rows: [(doc, offset, length), ...] per row, padded to 8
        out = {k: np.zeros((len(rows), 8), np.int32) for k in ("segment_ids", "doc_offset")}
        out["doc_key"] = np.full((len(rows), 8), -1, np.int32)
        for b, pieces in enumerate(rows):
            t = 0
            for i, (doc, off, n) in enumerate(pieces):
                out["segment_ids"][b, t : t + n] = i + 1
                out["doc_key"][b, t : t + n] = doc
                out["doc_offset"][b, t : t + n] = np.arange(off, off + n)
                t += n
        return out

    first = batch([[(3, 0, 5), (7, 0, 2)], [(9, 8, 8)]])
    taps = rng.normal(size=(2, 8, f)).astype(np.float32)
    cache = TapCache(ml_dtypes.bfloat16)
    cache.store(first, taps)
    assert len(cache) == 3 and cache.nbytes == (5 + 2 + 8) * f * 2
    again = batch([[(9, 8, 8)], [(7, 0, 2), (3, 0, 5)]])
    got = cache.lookup(again)
    bf = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    np.testing.assert_array_equal(got[0], bf(taps[1]))
    np.testing.assert_array_equal(got[1, :2], bf(taps[0, 5:7]))
    np.testing.assert_array_equal(got[1, 2:7], bf(taps[0, :5]))
    assert (got[1, 7] == 0).all() and cache.hits == 1
    assert cache.lookup(batch([[(3, 0, 5), (4, 0, 3)]])) is None
    assert cache.misses == 1


def test_scan_layers_trains_as_the_loop_and_a_target_checkpoint_keeps_its_layout(
    regen_file, tmp_path
):
    """`scan_layers=True`: the frozen target pass runs the stacked scan (to the last tap), and
    the drafter sees the same taps, so its losses equal the looped run's step for step (rtol
    1e-5); in target mode the stacked parameters train as the loop's (the same losses). A
    target-mode run resumed in the other layout stops before training with one line naming
    how to go on; its checkpoint is left byte for byte."""
    from dflash_jax.training.checkpointing import IncompatibleCheckpointError

    kw = dict(num_train_steps=4, eval_every=0, log_every=1, export=False, checkpoint_every=4)
    runs = {}
    for scan in (False, True):
        cfg = tiny_config(regen_file, scan_layers=scan, **kw)
        runs[scan] = trainer.train_and_evaluate(cfg, str(tmp_path / f"d{scan}"))
    loop, stack = ([l for _, l in runs[s]["losses"]] for s in (False, True))
    assert len(loop) == 4
    np.testing.assert_allclose(stack, loop, rtol=1e-5)

    wd = str(tmp_path / "target")
    tkw = dict(kw, mode="target", num_train_steps=2, checkpoint_every=2, eval_num_prompts=0)
    tkw.update({"data.kind": "synthetic", "target_model.vocab_size": 64, "eval_batches": 0})
    looped = trainer.train_and_evaluate(tiny_config(regen_file, **tkw), wd)
    # Target mode trains the stacked parameters (gradients through the scan) as the loop's.
    stacked = trainer.train_and_evaluate(
        tiny_config(regen_file, scan_layers=True, **tkw), str(tmp_path / "target_stacked")
    )
    np.testing.assert_allclose(
        [l for _, l in stacked["losses"]], [l for _, l in looped["losses"]], rtol=1e-5
    )
    ckdir = os.path.join(wd, "checkpoints")
    before = _snapshot(ckdir, ("2",))
    with pytest.raises(IncompatibleCheckpointError) as e:
        trainer.train_and_evaluate(
            tiny_config(regen_file, scan_layers=True, **dict(tkw, num_train_steps=4)), wd
        )
    msg = str(e.value)
    assert "\n" not in msg and ckdir in msg, msg
    assert "layers one by one (layers_0, ...)" in msg and "resume it with scan_layers=False" in msg
    assert _snapshot(ckdir, ("2",)) == before
