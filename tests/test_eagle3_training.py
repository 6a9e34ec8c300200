"""EAGLE-3 training-time test (TTT, issue 43): the unrolled training forward drafts exactly what
the decode loop's drafting steps draft.

`Eagle3Drafter.unrolled` runs J drafting steps from every row of a sequence at once (the first
step's rows attend causally, later steps see the first step's rows and their own earlier
steps). The reference is the inference path itself, row by row: the drafter's cache filled
with the committed rows before p (`row_kv`), then `step` at p and J - 1 further `step`s, each
fed the step before's output and the next token of the sequence (teacher forcing), its K/V
written into the cache as the decode loop writes it. The two paths share the layer's weights
and nothing of their attention code (the cache path runs `draft_attention`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.drafters import eagle3 as e3
from dflash_jax.models.config import ModelConfig
from dflash_jax.training import eagle3_ttt as ttt

V, TH, H, D, FF = 96, 48, 32, 8, 64


@pytest.fixture(scope="module")
def drafter():
    target = ModelConfig(
        vocab_size=V, hidden_size=TH, intermediate_size=FF, num_layers=6, num_heads=4,
        num_kv_heads=2, head_dim=12, arch="llama", qk_norm=False,
    )  # fmt: skip
    cfg = e3.make_eagle3_config(target, hidden_size=H, head_dim=D, intermediate_size=FF)
    # Larger weights than the init's 0.02, so the attention pattern matters to the output.
    params = jax.tree_util.tree_map(lambda x: x * 10.0, e3.init_eagle3_params(cfg, seed=1))
    return cfg, params


def _inputs(cfg, b, s, seed):
    rng = np.random.default_rng(seed)
    taps = jnp.asarray(rng.standard_normal((b, s, 3 * cfg.target_hidden_size)), jnp.float32)
    emb_table = jnp.asarray(rng.standard_normal((V, cfg.body.hidden_size)), jnp.float32)
    ids = rng.integers(0, V, (b, s))
    return taps, emb_table, ids


def _shifted_embeddings(emb_table, ids, steps):
    """embs[j][b, p] = embedding of the token at p + 1 + j (zeros past the end)."""
    b, s = ids.shape
    out = []
    for j in range(steps):
        shifted = np.zeros((b, s), np.int64)
        shifted[:, : max(s - 1 - j, 0)] = ids[:, 1 + j :]
        out.append(emb_table[shifted])
    return jnp.stack(out)


def _by_the_decode_steps(cfg, params, taps, emb_table, ids, p, steps, keep_drafts=True):
    """Logits [steps, B, Vd] of drafting `steps` tokens after row p through `step`, the cache
    holding rows 0 .. p - 1 (committed) and then the drafts (keep_drafts=False: a wrong
    loop that drops each draft's K/V, for the control)."""
    mod = e3.Eagle3Drafter(cfg)
    apply = lambda method, *a: mod.apply({"params": params}, *a, method=method)  # noqa: E731
    b, s = ids.shape
    cache = e3.create_cache(cfg, b, s + steps, jnp.float32)
    emb = emb_table[ids[:, 1:]]  # row r carries the token at r + 1
    feature0 = apply(e3.Eagle3Drafter.fuse, taps)
    if p > 0:
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        k, v = apply(e3.Eagle3Drafter.row_kv, emb[:, :p], feature0[:, :p], pos)
        cache = e3.write_step_kv(cache, k, v, pos, jnp.full((b,), p, jnp.int32))
    feature, logits = feature0[:, p : p + 1], []
    for j in range(steps):
        pos = jnp.full((b, 1), p + j, jnp.int32)
        out, lg, k, v = apply(
            e3.Eagle3Drafter.step,
            emb[:, p + j : p + j + 1],
            feature,
            pos,
            cache.k[0],
            cache.v[0],
            cache.lengths,
        )
        cache = e3.write_step_kv(cache, k, v, pos, cache.lengths + int(keep_drafts))
        feature = out
        logits.append(lg[:, 0])
    return np.asarray(jnp.stack(logits))


def test_unrolled_ttt_logits_equal_the_decode_loops_drafting_steps(drafter):
    cfg, params = drafter
    b, s, steps = 2, 12, 4
    taps, emb_table, ids = _inputs(cfg, b, s, seed=0)
    mask = jnp.tril(jnp.ones((s, s), bool))[None].repeat(b, 0)
    got = e3.Eagle3Drafter(cfg).apply(
        {"params": params},
        taps,
        _shifted_embeddings(emb_table, ids, steps),
        jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
        mask,
        ttt.ttt_attention,
        method=e3.Eagle3Drafter.unrolled,
    )
    assert got.shape == (steps, b, s, cfg.draft_vocab_size)
    for p in (0, 3, s - steps - 1):
        want = _by_the_decode_steps(cfg, params, taps, emb_table, ids, p, steps)
        np.testing.assert_allclose(np.asarray(got[:, :, p]), want, rtol=2e-4, atol=2e-4)
    # A control: a loop that forgets each step's K/V (row p's own among them) drafts the same
    # first token and something else from the second on, and the comparison sees it.
    wrong = _by_the_decode_steps(cfg, params, taps, emb_table, ids, 3, steps, keep_drafts=False)
    np.testing.assert_allclose(wrong[0], np.asarray(got[0, :, 3]), rtol=2e-4, atol=2e-4)
    assert np.abs(wrong[1:] - np.asarray(got[1:, :, 3])).max(axis=(1, 2)).min() > 1e-2


# ---------------------------------------------------------------- the loss and the vocabulary


def test_draft_vocabulary_takes_the_most_frequent_ids_and_maps_both_ways():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3])
    d2t = ttt.draft_vocabulary(counts, 4)
    ids = np.arange(4) + d2t
    assert ids.tolist() == [0, 2, 3, 5]  # counts 9, 9, 7, 5; in id order
    t2d = ttt.target_to_draft(d2t, 8)
    assert t2d.tolist() == [0, -1, 1, 2, -1, 3, -1, -1]
    assert ttt.draft_vocabulary(np.array([2, 2, 2]), 2).tolist() == [0, 0]  # ties: smaller id
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 8\]"):
        ttt.draft_vocabulary(counts, 9)


def _numpy_loss(logits, ids, loss_mask, seg, t2d, steps, decay):
    """The loss rule written out: step j at row p is labelled with the token at p + 2 + j when
    that token is in p's (non-padding) segment, on the loss mask and in the draft vocabulary;
    loss = sum(decay^j CE) / sum(decay^j) over the labels; the acceptance length at a row with
    a first label is 1 + its leading correct steps."""
    logits = np.asarray(logits, np.float64)
    b, s = ids.shape

    def label(r, p, j):
        t = p + 2 + j
        if t >= s or seg[r, p] == 0 or seg[r, t] != seg[r, p] or not loss_mask[r, t]:
            return None
        return None if t2d[ids[r, t]] < 0 else t2d[ids[r, t]]

    num = den = 0.0
    count = [0] * (steps + 1)
    for j in range(steps):
        for r in range(b):
            for p in range(s):
                y = label(r, p, j)
                if y is not None:
                    lg = logits[j, r, p]
                    num += decay**j * (np.log(np.exp(lg - lg.max()).sum()) + lg.max() - lg[y])
                    den += decay**j
                    count[j + 1] += 1
    lengths = []
    for r in range(b):
        for p in range(s):
            if label(r, p, 0) is None:
                continue
            n = 1
            for j in range(steps):
                y = label(r, p, j)
                if y is None or np.argmax(logits[j, r, p]) != y:
                    break
                n += 1
            lengths.append(n)
    return num / den, den, count, lengths


def test_ttt_loss_equals_the_rule_written_in_numpy_over_packed_rows(drafter):
    cfg0, params0 = drafter
    # A draft vocabulary of 40 of the 96 target ids, from skewed counts.
    rng = np.random.default_rng(5)
    d2t = ttt.draft_vocabulary(rng.integers(0, 100, V), 40)
    cfg = cfg0.replace(draft_vocab_size=40)
    params = dict(params0)
    params["lm_head"] = {"kernel": params0["lm_head"]["kernel"][:, :40]}
    t2d = ttt.target_to_draft(d2t, V)
    b, s, steps = 2, 14, 3
    taps, emb_table, ids = _inputs(cfg, b, s, seed=7)
    ids[:, ::3] = d2t[0]  # draft id 0's target id: some labels in the vocabulary for sure
    seg = np.array([[1] * 6 + [2] * 6 + [0] * 2, [1] * 14])
    loss_mask = (rng.random((b, s)) < 0.8).astype(np.int32)
    batch = dict(
        input_ids=jnp.asarray(ids, jnp.int32),
        loss_mask=jnp.asarray(loss_mask),
        segment_ids=jnp.asarray(seg, jnp.int32),
    )
    dmod = e3.Eagle3Drafter(cfg)
    loss, m = ttt.ttt_loss(dmod, params, lambda i: emb_table[i], taps, batch, t2d, steps, 0.8)
    positions = ttt._positions(batch["segment_ids"])
    assert np.asarray(positions)[0].tolist() == list(range(6)) * 2 + [0, 1]
    logits = dmod.apply(
        {"params": params},
        taps,
        jnp.stack(
            [emb_table[np.asarray(ttt.shifted(batch["input_ids"], 1 + j))] for j in range(steps)]
        ),
        positions,
        ttt.ttt_mask(batch["segment_ids"]),
        ttt.ttt_attention,
        method=e3.Eagle3Drafter.unrolled,
    )
    want, weight_sum, count, lengths = _numpy_loss(logits, ids, loss_mask, seg, t2d, steps, 0.8)
    assert len(lengths) > 5 and min(count[1:]) > 0
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(m["weight_sum"]), weight_sum, rtol=1e-6)
    assert np.asarray(m["count_k"]).tolist() == count
    assert int(m["num_blocks"]) == len(lengths) and int(m["accept_sum"]) == sum(lengths)
    # A row of the second packed sequence drafts what it drafts with that sequence alone.
    alone = dmod.apply(
        {"params": params},
        taps[:1, 6:12],
        jnp.stack(
            [
                emb_table[np.asarray(ttt.shifted(batch["input_ids"][:1, 6:12], 1 + j))]
                for j in range(steps)
            ]
        ),
        jnp.arange(6, dtype=jnp.int32)[None],
        ttt.ttt_mask(jnp.ones((1, 6), jnp.int32)),
        ttt.ttt_attention,
        method=e3.Eagle3Drafter.unrolled,
    )
    for j in range(steps):  # rows whose step-j input token lies inside the segment
        np.testing.assert_allclose(
            np.asarray(logits[j, 0, 6 : 11 - j]),
            np.asarray(alone[j, 0, : 5 - j]),
            rtol=1e-4,
            atol=1e-4,
        )
