"""Sliding-window drafting: a drafter layer of type sliding_attention lets the block query at
position p see a key at position j only when |p - j| < sliding_window, and a drafter whose
layers all slide keeps its context in a ring of `window` slots (memory flat in the context).

Checked against NumPy statements of the rule written here, end to end with the bundled trained
drafter (lossless past the window, still accepted) and in training (the blockwise attention
against the dense mask, both against the rule)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pair import assert_accepted

import dflash_jax as dj
from dflash_jax.decoding.step import Decoder, Plan
from dflash_jax.drafters.dflash import DFlashDrafter, sliding_layers
from dflash_jax.models import attention


def _softmax_attention(q, keys, values, visible):
    """q [N, D], keys / values [S, N, D] (heads already repeated), visible [S] bool."""
    d = q.shape[-1]
    out = np.zeros_like(q)
    for h in range(q.shape[0]):
        s = keys[:, h] @ q[h] / np.sqrt(d)
        s = np.where(visible, s, -np.inf)
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ values[:, h]
    return out


@pytest.mark.parametrize(
    "lengths, window, slots",
    [
        ((11, 0), 4, 4),  # a wrapped ring (11 > 4 slots) and an empty context
        ((11, 7), 6, 6),
        ((5, 3), 6, 6),  # a ring that never wrapped: a plain cache
        ((9, 12), 30, 32),  # a window wider than the context: full attention
        ((9, 12), 3, 3),  # a window narrower than the block
    ],
)
def test_window_draft_attention_follows_the_rule(lengths, window, slots):
    rs = np.random.RandomState(sum(lengths) + window)
    b, t, nh, kh, d = len(lengths), 5, 4, 2, 8
    longest = max(lengths) + 1
    full_k, full_v = rs.randn(2, b, longest, kh, d).astype(np.float32)
    q = rs.randn(b, t, nh, d).astype(np.float32)
    blk_k, blk_v = rs.randn(2, b, t, kh, d).astype(np.float32)

    # The ring as the decoder keeps it: position j in slot j % slots, the last `slots` kept.
    ring_k = np.zeros((b, slots, kh, d), np.float32)
    ring_v = np.zeros_like(ring_k)
    for i, n in enumerate(lengths):
        for j in range(max(0, n - slots), n):
            ring_k[i, j % slots], ring_v[i, j % slots] = full_k[i, j], full_v[i, j]
    got = attention.draft_attention(
        jnp.asarray(q),
        jnp.asarray(ring_k),
        jnp.asarray(ring_v),
        jnp.asarray(lengths, jnp.int32),
        jnp.asarray(blk_k),
        jnp.asarray(blk_v),
        window=window,
    )

    rep = nh // kh
    for i, n in enumerate(lengths):
        keys = np.concatenate([full_k[i, :n], blk_k[i]]).repeat(rep, axis=1)
        values = np.concatenate([full_v[i, :n], blk_v[i]]).repeat(rep, axis=1)
        key_pos = np.concatenate([np.arange(n), n + np.arange(t)])
        for r in range(t):
            p = n + r
            visible = np.abs(p - key_pos) < window
            want = _softmax_attention(q[i, r], keys, values, visible)
            np.testing.assert_allclose(np.asarray(got)[i, r], want, rtol=1e-5, atol=1e-5)


def test_ring_positions():
    pos = np.asarray(attention.ring_positions(jnp.asarray([0, 3, 4, 10]), 4))
    np.testing.assert_array_equal(
        pos, [[-4, -3, -2, -1], [0, 1, 2, -1], [0, 1, 2, 3], [8, 9, 6, 7]]
    )


def _windowed(drafter, window):
    cfg = drafter.config.replace(**sliding_layers(drafter.config.body.num_layers, window))
    return dj.Drafter(cfg, drafter.params)


@pytest.fixture(scope="module")
def runs(bundled_pair):
    """Greedy runs of the bundled pair: autoregressive, the full drafter, and the same weights
    with every layer sliding (a window wider than any context here, and windows of 16 and 5
    that the prompts and 40 new tokens run past), drafts recorded."""
    target, drafter, prompts = bundled_pair
    go = lambda d: dj.generate(  # noqa: E731  (AR takes no block size)
        target,
        d,
        prompts,
        40,
        block_size=16 if d is not None else None,
        return_drafts=d is not None,
    )
    out = {"ar": go(None), "full": go(drafter)}
    for w in (4096, 16, 5):
        out[w] = go(_windowed(drafter, w))
    return out


def test_a_window_wider_than_the_context_drafts_like_full_attention(runs):
    for a, b in zip(runs[4096].drafts, runs["full"].drafts):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("window", (16, 5))
def test_windowed_drafting_past_the_window_is_lossless_and_accepted(runs, window):
    res = runs[window]
    assert [list(x) for x in res.tokens] == [list(x) for x in runs["ar"].tokens]
    assert_accepted(res, 16, min_tau=1.3)
    # the window acts: some drafts differ from full attention's once the context outgrows it
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(res.drafts, runs["full"].drafts)
    )


def test_the_context_cache_is_a_ring_of_window_slots(bundled_pair):
    target, drafter, _ = bundled_pair
    for window, capacity, slots in ((16, 512, 16), (5, 512, 5), (4096, 512, 512), (None, 512, 512)):
        d = drafter if window is None else _windowed(drafter, window)
        decoder = Decoder(
            target.params, d.params, target.module, DFlashDrafter(d.config), Plan(block_size=16)
        )
        state = jax.eval_shape(
            lambda: decoder.prefill(
                capacity,
                64,
                jnp.zeros((2, 32), jnp.int32),
                jnp.full((2,), 32, jnp.int32),
                jnp.int32(40),
                jax.random.PRNGKey(0),
            )
        )
        assert all(k.shape[1] == slots for k in state.ctx.k + state.ctx.v), (window, slots)
        assert state.cache.k[0].shape[1] == capacity  # the target's cache is not windowed


def test_stop_tokens_with_a_windowed_drafter(bundled_pair, runs):
    target, drafter, prompts = bundled_pair
    ar = runs["ar"].tokens
    stop = int(ar[1][12])  # a token the second prompt's continuation emits
    res = dj.generate(
        target, _windowed(drafter, 16), prompts, 40, block_size=16, stop_token_ids=(stop,)
    )
    want = dj.generate(target, None, prompts, 40, stop_token_ids=(stop,))
    assert [list(x) for x in res.tokens] == [list(x) for x in want.tokens]
    assert len(res.tokens[1]) <= 13


def test_bad_windows_are_one_line(bundled_pair):
    _, drafter, _ = bundled_pair
    n = drafter.config.body.num_layers
    for bad in (0, -3, 2.5, True, None):
        with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
            drafter.config.replace(layer_types=("sliding_attention",) * n, sliding_window=bad)
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        drafter.config.replace(layer_types=("sliding_attention",), sliding_window=8)
    from dflash_jax.support.checks import ConfigError
    from dflash_jax.training.config_checks import check_train_config
    from configs.default import get_config

    c = get_config()
    c.drafter.sliding_window = -1
    with pytest.raises(ConfigError, match="drafter.sliding_window"):
        check_train_config(c)


def test_windowed_drafter_round_trips(bundled_pair, tmp_path):
    target, drafter, _ = bundled_pair
    d = _windowed(drafter, 64)
    dj.save_drafter(d, tmp_path / "w")
    import json

    hf = json.load(open(tmp_path / "w" / "config.json"))
    assert hf["layer_types"] == ["sliding_attention"] * drafter.config.body.num_layers
    assert hf["sliding_window"] == 64 and hf["use_sliding_window"] is True
    back = dj.load_drafter(tmp_path / "w", target=target)
    assert back.config == d.config and back.config.context_window == 64


def _numpy_training_mask(anchors, valid, bs, s, seg, window):
    """The windowed training mask stated row by row: block n's position i (at anchor + i) sees
    context j < anchor of the anchor's document with anchor + i - j < window, and the block
    positions i' of its own block with |i - i'| < window."""
    b, n = anchors.shape
    out = np.zeros((b, n * bs, s + n * bs), bool)
    for x in range(b):
        for blk in range(n):
            if not valid[x, blk]:
                continue
            a = anchors[x, blk]
            for i in range(bs):
                r = blk * bs + i
                for j in range(s):
                    out[x, r, j] = j < a and seg[x, j] == seg[x, a] and a + i - j < window
                for i2 in range(bs):
                    out[x, r, s + blk * bs + i2] = abs(i - i2) < window
    return out


@pytest.mark.parametrize("window", (6, 3))
def test_windowed_training_attention(window):
    from dflash_jax.training import losses, masks

    rng = np.random.RandomState(window)
    b, s, bs, nh, kh, d, n = 2, 30, 4, 4, 2, 8, 7
    q = jnp.asarray(rng.randn(b, n * bs, nh, d), jnp.float32)
    kb, vb = (jnp.asarray(rng.randn(b, n * bs, kh, d), jnp.float32) for _ in range(2))
    ck, cv = (jnp.asarray(rng.randn(b, s, kh, d), jnp.float32) for _ in range(2))
    seg = np.ones((b, s), np.int32)
    seg[0, 12:] = 2
    lm = (rng.rand(b, s) < 0.8).astype(np.int32)
    anchors, valid = masks.sample_anchors(
        jax.random.PRNGKey(window), jnp.asarray(lm), n, bs, jnp.asarray(seg)
    )
    mask = masks.training_mask(anchors, valid, bs, s, jnp.asarray(seg), window=window)
    want = _numpy_training_mask(np.asarray(anchors), np.asarray(valid), bs, s, seg, window)
    np.testing.assert_array_equal(np.asarray(mask), want)

    def run(impl, chunk=0):
        att = losses.training_attend(anchors, valid, bs, s, jnp.asarray(seg), impl, chunk)
        return att(q, kb, vb, ck, cv, window)

    dense = run("xla_dense")
    for impl, chunk in (("xla", 0), ("xla", 3), ("pallas_interpret", 0)):
        np.testing.assert_allclose(
            np.asarray(run(impl, chunk)), np.asarray(dense), rtol=1e-5, atol=1e-5
        )
    # and not the unwindowed attention
    full = losses.training_attend(anchors, valid, bs, s, jnp.asarray(seg), "xla")(q, kb, vb, ck, cv)
    assert not np.allclose(np.asarray(full), np.asarray(dense), atol=1e-3)


def test_ring_writes_keep_the_last_window_positions(bundled_pair):
    """The decoder's context writes, as prefill and commits make them (a prompt longer than
    the ring; then blocks of 16 positions of which only the first n are committed, the rest
    garbage that must not land), leave in each ring slot the K/V that a plain cache holds at
    the slot's position, for every position still in the window."""
    target, drafter, _ = bundled_pair
    window, b, bs = 5, 2, 16
    ring_d = _windowed(drafter, window)
    dec = lambda d: Decoder(
        target.params, d.params, target.module, DFlashDrafter(d.config), Plan(block_size=bs)
    )
    ring_dec, plain_dec = dec(ring_d), dec(drafter)
    ring = dj.KVCache.create(ring_d.config, b, window)
    plain = dj.KVCache.create(drafter.config, b, 128)
    rs = np.random.RandomState(0)
    feat = drafter.config.num_taps * drafter.config.target_hidden_size
    lengths = jnp.asarray([11, 7], jnp.int32)
    taps = jnp.asarray(rs.randn(b, 16, feat), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (b, 16))
    start0 = jnp.zeros((b,), jnp.int32)
    ring = ring_dec.kind.write_context(ring_dec, ring, taps, None, pos, lengths, start0)
    plain = plain_dec.kind.write_context(plain_dec, plain, taps, None, pos, lengths, start0)
    for n in ([3, 16], [1, 2], [9, 4], [16, 16]):
        start = lengths
        new_len = start + jnp.asarray(n, jnp.int32)
        taps = jnp.asarray(rs.randn(b, bs, feat), jnp.float32)
        pos = start[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
        ring = ring_dec.kind.write_context(ring_dec, ring, taps, None, pos, new_len, start)
        plain = plain_dec.kind.write_context(plain_dec, plain, taps, None, pos, new_len, start)
        lengths = new_len
        held = np.asarray(attention.ring_positions(lengths, window))
        for layer in range(len(ring.k)):
            for x in range(b):
                for s in range(window):
                    p = held[x, s]
                    assert p >= int(lengths[x]) - window
                    np.testing.assert_array_equal(
                        np.asarray(ring.k[layer][x, s]), np.asarray(plain.k[layer][x, p])
                    )
                    np.testing.assert_array_equal(
                        np.asarray(ring.v[layer][x, s]), np.asarray(plain.v[layer][x, p])
                    )


def test_the_training_loss_of_a_windowed_drafter(hf_checkpoints):
    """drafter_loss through sliding layers: a window wider than the rows is the full drafter's
    loss, a narrow one another loss (with finite gradients)."""
    from dflash_jax.training import losses

    target = dj.load_target(hf_checkpoints["qwen3_tied"][0])
    base = dj.make_drafter_config(target.config, num_layers=2, num_taps=2, block_size=8)
    params = dj.init_drafter_params(base, seed=3)
    recipe = losses.DrafterRecipe(
        block_size=8,
        mask_token_id=base.mask_token_id,
        tap_layers=base.target_layer_ids,
        num_anchors=4,
        gamma=4.0,
    )
    rng = np.random.RandomState(0)
    batch = {
        "input_ids": jnp.asarray(rng.randint(0, 100, (2, 40)), jnp.int32),
        "loss_mask": jnp.ones((2, 40), jnp.int32),
        "segment_ids": jnp.ones((2, 40), jnp.int32),
    }

    def loss(window):
        cfg = base.replace(**sliding_layers(2, window))
        fn = lambda p: losses.drafter_loss(
            target.module,
            DFlashDrafter(cfg),
            recipe,
            p,
            target.params,
            batch,
            jax.random.PRNGKey(1),
        )[0]
        return jax.jit(jax.value_and_grad(fn))(params)

    full, _ = loss(None)
    wide, _ = loss(64)
    narrow, g = loss(4)
    np.testing.assert_allclose(float(wide), float(full), rtol=1e-6)
    assert abs(float(narrow) - float(full)) > 1e-4
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(g))


def test_the_dry_run_takes_a_window_and_its_context_bytes_stay_flat():
    """`dry_run_infer(drafter_window=...)`: the compiled DFlash loop's drafter context cache is
    a ring of the window (the same bytes at 256 and 1024 prompt tokens) while a full-attention
    drafter's grows with the context; the target's cache is not windowed."""
    from dflash_jax.dry_run.programs import dry_run_infer

    def sizes(context, window, drafter="dflash"):
        r = dry_run_infer(
            model="tiny",
            mesh="tensor=1",
            context=context,
            max_new_tokens=32,
            attention=("xla",),
            step_costs=False,
            only=("dflash_decode",),
            drafter=drafter,
            drafter_window=window,
        )
        return r["sizes"]

    short, long = sizes(256, 64, "dflash2"), sizes(1024, 64, "dflash2")
    assert short["dflash_context_cache_bytes"] == long["dflash_context_cache_bytes"]
    assert long["dflash_cache_bytes"] > 2 * short["dflash_cache_bytes"]
    full = sizes(1024, None)
    assert full["dflash_context_cache_bytes"] > 8 * long["dflash_context_cache_bytes"]
