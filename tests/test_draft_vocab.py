"""A DFlash drafter with a frequency-ranked draft vocabulary (`drafters.draft_vocab`): its
head restricted to K rows of the target's, drafting over them, verifying on the full
vocabulary. Lossless with accepted drafts (greedy, and sampled through the rejection path),
its drafts confined to the K tokens, the format written and read (and ignored when asked), bad
tensors refused in one line; the restricted logits equal the full head's rows (NumPy)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pair import assert_accepted

import dflash_jax as dj
from dflash_jax.drafters import draft_vocab as dv
from dflash_jax.models.safetensors_io import CheckpointError, write_safetensors

NEW = 40


@pytest.fixture(scope="module")
def pair(bundled_pair):
    return bundled_pair


@pytest.fixture(scope="module")
def ar(pair):
    target, _, prompts = pair
    return dj.generate(target, None, prompts, max_new_tokens=NEW).tokens


@pytest.fixture(scope="module")
def vocab(pair, ar):
    """K = 256 of the tiny vocabulary: the tokens of the AR continuations ranked first (so the
    drafts can be right), then the most frequent of the prompts, then by id; one token the
    continuations use is left out, so some label is outside the vocabulary."""
    target, _, prompts = pair
    v = target.config.vocab_size
    counts = np.zeros(v, np.int64)
    for seq in ar:
        counts += np.bincount(seq, minlength=v) * 1000
    for p in prompts:
        counts += np.bincount(p, minlength=v)
    ranked = dv.top_tokens(counts, 257)
    return np.delete(ranked, 5)  # the 6th most frequent continuation token is out


def test_top_tokens_and_coverage_follow_the_counts():
    counts = np.array([5, 0, 9, 9, 1, 3])
    top = dv.top_tokens(counts, 3)
    assert top.tolist() == [2, 3, 0]  # ties by lower id
    assert dv.coverage(counts, top) == pytest.approx(23 / 27)
    t2d = dv.target_to_draft(top, 6)
    assert t2d.tolist() == [2, -1, 0, 1, -1, -1]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        dv.top_tokens(counts, 7)


def test_restricted_head_equals_the_full_heads_rows(pair):
    target, _, _ = pair
    tmod = dj.Transformer(target.config)
    h = (
        np.random.default_rng(0)
        .standard_normal((2, 3, target.config.hidden_size))
        .astype(np.float32)
    )
    rows = np.array([7, 3, 100, 0], np.int32)
    full = np.asarray(tmod.apply({"params": target.params}, jnp.asarray(h), method="logits"))
    part = np.asarray(
        tmod.apply({"params": target.params}, jnp.asarray(h), jnp.asarray(rows), method="logits")
    )
    head = np.asarray(
        target.params["embed_tokens"]["embedding"]
        if target.config.tie_word_embeddings
        else np.asarray(target.params["lm_head"]["kernel"]).T,
        np.float64,
    )
    np.testing.assert_allclose(part, h.astype(np.float64) @ head[rows].T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(part, full[..., rows], rtol=1e-5, atol=1e-5)
    out = np.asarray(dv.full_logits(jnp.asarray(part), rows, target.config.vocab_size))
    assert np.isneginf(np.delete(out, rows, axis=-1)).all()
    np.testing.assert_array_equal(out[..., rows], part)


def test_greedy_with_a_draft_vocabulary_is_lossless_and_accepted(pair, ar, vocab):
    target, drafter, prompts = pair
    d = dj.Drafter(drafter.config, drafter.params, draft_vocab=vocab)
    res = dj.generate(target, d, prompts, NEW, block_size=8, return_drafts=True)
    assert res.tokens == ar
    assert_accepted(res, 8, min_tau=1.5)
    assert max(max(a) for a in res.acceptance_lengths) >= 3
    drafted = np.concatenate([np.asarray(s).ravel() for s in res.drafts])
    assert np.isin(drafted, vocab).all()  # every draft from the K tokens
    full = dj.generate(target, drafter, prompts, NEW, block_size=8, return_drafts=True)
    # the full-vocabulary drafter drafts the left-out token somewhere: the vocabulary binds
    left_out = np.setdiff1d(np.concatenate([np.asarray(s).ravel() for s in full.drafts]), vocab)
    assert left_out.size > 0


def test_sampled_with_a_draft_vocabulary_is_lossless_and_accepted(pair, ar, vocab):
    """The sampled verify (temperature 0.8, top-k 1: the target's distribution is a point mass
    on its greedy token, so the exact sampler's output is the greedy one): through the
    rejection path, every sequence equal to AR's, with steps committing >= 3 tokens."""
    target, drafter, prompts = pair
    d = dj.Drafter(drafter.config, drafter.params, draft_vocab=vocab)
    res = dj.generate(target, d, prompts, NEW, block_size=8, temperature=0.8, top_k=1, seed=3)
    assert res.tokens == ar
    assert_accepted(res, 8, min_tau=1.5)


def test_save_and_load_keep_the_vocabulary_or_ignore_it(pair, vocab, tmp_path):
    target, drafter, _ = pair
    d = dj.Drafter(drafter.config, drafter.params, draft_vocab=vocab)
    path = str(tmp_path / "d")
    dj.save_drafter(d, path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["draft_vocab_size"] == len(vocab)
    back = dj.load_drafter(path, target=target)
    np.testing.assert_array_equal(back.draft_vocab, vocab)
    assert dj.load_drafter(path, target=target, draft_vocab=False).draft_vocab is None
    # the z-lab weights are unchanged beside the extra tensor
    plain = str(tmp_path / "plain")
    dj.save_drafter(drafter, plain)
    a = jax.tree_util.tree_leaves(dj.load_drafter(plain, target=target).params)
    b = jax.tree_util.tree_leaves(back.params)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.array([1, 1, 2], np.int32), "lists a token twice"),
        (np.array([1, 2, 10**7], np.int32), "outside"),
        (np.array([[1, 2]], np.int32), "1-D integer"),
    ],
)
def test_a_bad_vocabulary_tensor_is_one_line(pair, vocab, tmp_path, bad, message):
    target, drafter, _ = pair
    path = str(tmp_path / "d")
    dj.save_drafter(dj.Drafter(drafter.config, drafter.params, draft_vocab=vocab), path)
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors[dv.TENSOR] = bad
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["draft_vocab_size"] = int(bad.shape[-1]) if bad.ndim == 1 else 2
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match=message) as e:
        dj.load_drafter(path, target=target)
    assert "\n" not in str(e.value)


def test_widened_taps_draft_what_the_drafter_drafted(pair, ar):
    """`widen_taps`: a drafter continued with more taps (5 instead of 3 in the SmolLM2
    recipe) starts as the same function: the new taps' fc rows are zero, so it drafts the
    same tokens and is accepted the same (and the output is AR's)."""
    from dflash_jax.drafters.dflash import widen_taps

    target, drafter, prompts = pair
    old = list(drafter.config.target_layer_ids)
    extra = [i for i in range(target.config.num_layers) if i not in old][:2]
    assert extra
    new_ids = sorted(old + extra)
    cfg, params = widen_taps(drafter.config, drafter.params, new_ids)
    assert list(cfg.target_layer_ids) == new_ids
    w = np.asarray(params["fc"]["kernel"])
    h = cfg.target_hidden_size
    for j, i in enumerate(new_ids):
        block = w[j * h : (j + 1) * h]
        if i in old:
            k = old.index(i)
            np.testing.assert_array_equal(
                block, np.asarray(drafter.params["fc"]["kernel"])[k * h : (k + 1) * h]
            )
        else:
            assert not block.any()
    a = dj.generate(target, drafter, prompts, NEW, block_size=8)
    b = dj.generate(target, dj.Drafter(cfg, params), prompts, NEW, block_size=8)
    assert b.tokens == ar and b.acceptance_lengths == a.acceptance_lengths
    with pytest.raises(ValueError, match="must be distinct and hold"):
        widen_taps(drafter.config, drafter.params, old[1:])
