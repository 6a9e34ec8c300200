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
