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
                out[bi, r, ctx_len + r2] = (r2 // bs == blk)
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
                if valid[bi, ni] and q < s and loss_mask[bi, q] and (
                        seg is None or seg[bi, q] == seg[bi, p]):
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
    assert anchors.shape == (3, min(30, s - bs + 1))
    for bi in range(3):
        eligible = {p for p in range(s) if loss_mask[bi, p] and p <= s - bs}
        got = anchors[bi][valid[bi]].tolist()
        assert len(got) == len(set(got)) == min(len(eligible), anchors.shape[1])
        assert set(got) <= eligible
    # Few eligible positions: the rest of the blocks are invalid.
    lm = np.zeros((1, s), np.int32)
    lm[0, [3, 9, 33]] = 1  # 33 > s - bs: not eligible
    a, v = masks.sample_anchors(jax.random.PRNGKey(0), jnp.asarray(lm), 10, bs)
    assert sorted(np.asarray(a)[np.asarray(v)].tolist()) == [3, 9]
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
