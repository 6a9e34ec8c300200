"""Verifier parity with Hugging Face transformers, and incremental decoding through the cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dflash_jax as dj
from dflash_jax.models.transformer import KVCache

KINDS = ("qwen3_tied", "qwen3_untied", "llama3")


@pytest.fixture(scope="module")
def targets(hf_checkpoints):
    return {k: dj.load_target(d) for k, (d, _) in hf_checkpoints.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_taps_match_transformers(kind, hf_models64, targets):
    ref_model = hf_models64[kind]
    ids = np.random.RandomState(0).randint(0, 128, (2, 37))
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids), output_hidden_states=True)
    taps = (0, 1, 2)
    out = targets[kind].forward(ids, tap_layers=taps)
    assert out.logits.dtype == jnp.float32
    assert out.logits.shape == (2, 37, 128)
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), atol=1e-4, rtol=0)
    want_taps = np.concatenate([ref.hidden_states[i + 1].numpy() for i in taps], axis=-1)
    np.testing.assert_allclose(np.asarray(out.taps), want_taps, atol=1e-4, rtol=0)


def test_rope_scaling_matters(targets):
    """The llama3 scaling is really applied: turning it off changes long-range logits."""
    t = targets["llama3"]
    plain = dj.Target(t.config.replace(rope_scaling=None), t.params)
    ids = np.arange(100)[None] % 128
    a = np.asarray(t.forward(ids).logits)[0, -1]
    b = np.asarray(plain.forward(ids).logits)[0, -1]
    assert np.abs(a - b).max() > 1e-3


@functools.partial(jax.jit, static_argnums=(0,))
def _cached_step(module, params, ids, cache):
    hidden, cache, taps = module.apply({"params": params}, ids, cache=cache, tap_layers=(1,))
    return module.apply({"params": params}, hidden, method="logits"), cache, taps


@pytest.mark.parametrize("kind", ("qwen3_untied", "llama3"))
def test_incremental_decoding_equals_full_forward(kind, targets):
    """Batch with different prompt lengths: prefill, 3 single tokens, a 16-token block,
    a roll-back, another block: every logit equals the full forward of that sequence."""
    t = targets[kind]
    rs = np.random.RandomState(1)
    lens = [5, 12, 9]
    seqs = [list(rs.randint(0, 128, n + 3 + 16 + 16)) for n in lens]
    full = [np.asarray(t.forward(np.array([s])).logits)[0] for s in seqs]
    full_taps = [np.asarray(t.forward(np.array([s]), tap_layers=(1,)).taps)[0] for s in seqs]

    cache = KVCache.create(t.config, batch=3, capacity=64)
    pad = max(lens)
    prompt = np.zeros((3, pad), np.int32)
    for b, n in enumerate(lens):
        prompt[b, :n] = seqs[b][:n]
    logits, cache, taps = _cached_step(t.module, t.params, jnp.asarray(prompt), cache)
    cache = cache.rollback(jnp.asarray(lens))  # right-padded prefill: keep true lengths
    for b, n in enumerate(lens):
        np.testing.assert_allclose(np.asarray(logits)[b, :n], full[b][:n], atol=1e-4)
        np.testing.assert_allclose(np.asarray(taps)[b, :n], full_taps[b][:n], atol=1e-4)

    pos = list(lens)

    def feed(width, commit):
        nonlocal cache
        ids = np.array([seqs[b][pos[b] : pos[b] + width] for b in range(3)], np.int32)
        logits, cache, taps = _cached_step(t.module, t.params, jnp.asarray(ids), cache)
        for b in range(3):
            np.testing.assert_allclose(
                np.asarray(logits)[b], full[b][pos[b] : pos[b] + width], atol=1e-4
            )
            np.testing.assert_allclose(
                np.asarray(taps)[b], full_taps[b][pos[b] : pos[b] + width], atol=1e-4
            )
        for b in range(3):
            pos[b] += commit[b]
        cache = cache.rollback(jnp.asarray(pos))

    for _ in range(3):
        feed(1, [1, 1, 1])
    # A verify-like block where each sequence keeps a different prefix (rest rolled back).
    feed(16, [16, 7, 0])
    assert list(np.asarray(cache.lengths)) == pos
    feed(16, [16, 16, 16])


def test_rollback_is_bookkeeping_only(targets):
    t = targets["qwen3_tied"]
    cache = KVCache.create(t.config, batch=2, capacity=32)
    _, cache, _ = _cached_step(t.module, t.params, jnp.ones((2, 8), jnp.int32), cache)
    rolled = cache.rollback(jnp.array([3, 5]))
    assert rolled.k[0] is cache.k[0] and rolled.v[-1] is cache.v[-1]
    assert list(np.asarray(rolled.lengths)) == [3, 5]


def test_bad_token_ids_rejected(targets):
    with pytest.raises(ValueError, match="token ids"):
        targets["qwen3_tied"].forward(np.array([[1, 200]]))


def test_one_row_steps_compiled_for_a_gpu_pad_their_dots_and_keep_the_logits(
    targets, hf_models64, monkeypatch
):
    """Compiled for a GPU, a batch-1 one-token step runs each linear on its row padded to two
    (`layers.dot_general`: XLA:GPU strength-reduces a small matrix-vector dot into a product it
    writes to HBM; tests/test_gpu_compile.py has the compiled loop). Traced here under a GPU
    compile target, run on the CPU: every linear of the step took the padded path, a block's
    did not, and the logits equal transformers' full forward in float64."""
    from dflash_jax.models import layers
    from pallas_kernels import backend

    t, ref = targets["llama3"], hf_models64["llama3"]
    t = dj.Target(t.config, t.params, attention_impl="xla")  # the kernels need a real GPU
    ids = np.random.RandomState(3).randint(0, 128, (1, 12))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()[0]
    padded = []
    real = layers.pad_row_dot
    monkeypatch.setattr(layers, "pad_row_dot", lambda *a, **k: padded.append(1) or real(*a, **k))

    @jax.jit  # a fresh function: its traces are this test's own
    def step(params, ids, cache):
        hidden, cache, _ = t.module.apply({"params": params}, ids, cache=cache)
        return t.module.apply({"params": params}, hidden, method="logits"), cache

    cache = KVCache.create(t.config, batch=1, capacity=32)
    with backend.compiling_for("cuda"):
        logits, cache = step(t.params, jnp.asarray(ids[:, :8]), cache)  # 8 rows: a matrix
        assert padded == []
        got = [np.asarray(logits)[0]]
        for i in range(8, 12):
            logits, cache = step(t.params, jnp.asarray(ids[:, i : i + 1]), cache)
            got.append(np.asarray(logits)[0])
    assert len(padded) == 7 * t.config.num_layers  # q, k, v, o, gate, up, down: traced once
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-4, rtol=0)
