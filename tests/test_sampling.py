"""The sampler against an independent NumPy reference: temperature, top-k (exactly k, by a
stable argsort), top-p (the smallest nucleus by sorted cumulative mass, renormalized after
top-k), on small vocabularies where every sample is checked.

- no sample is ever outside the reference's support (every one of 20,000 per case);
- the empirical distribution is within a total-variation bound of the reference's (about 3x
  its expected sampling error), and a deliberately wrong rule (the nucleus one token wider,
  the temperature ignored) is rejected by the same bound: the test can fail;
- top-p alone runs through both of its branches: within the top CANDIDATES (a peaked row) and
  over the sorted vocabulary (a flat row whose nucleus is wider than the candidates).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _sampling_reference import reference

from dflash_jax.models import sampling

N = 20_000


def draw(logits, temperature, top_k=None, top_p=None, rows=1):
    """N samples (N // rows draws of a [rows, V] batch of the same row: several rows exercise
    the batched branch choice)."""
    x = jnp.asarray(np.tile(np.asarray(logits, np.float32), (rows, 1)))
    f = jax.jit(
        jax.vmap(lambda k: sampling.pick_tokens(x, k, temperature, top_k, top_p)),
    )
    keys = jax.random.split(jax.random.PRNGKey(7), N // rows)
    return np.asarray(f(keys)).reshape(-1)


def tv(samples, probs):
    emp = np.bincount(samples, minlength=len(probs)) / len(samples)
    return 0.5 * np.abs(emp - probs).sum()


RNG = np.random.RandomState(0)
PEAKED = np.array([6.0, 4.5, 4.0, 1.0, 0.5, 0.0, -1.0, -2.0, -2.5, -3.0, -4.0, -5.0])
FLAT = RNG.randn(12) * 0.3
BOUND = 0.03  # sqrt(V / N) ~ 0.025 is the scale of the sampling error's TV

CASES = [
    ("top_k", PEAKED, 1.0, 3, None),
    ("top_k_temperature", FLAT, 0.5, 5, None),
    ("top_p_peaked", PEAKED, 1.0, None, 0.9),
    ("top_p_flat", FLAT, 1.3, None, 0.6),
    ("top_k_then_top_p", FLAT, 0.8, 6, 0.5),
    ("temperature_only", FLAT, 0.7, None, None),
]


@pytest.mark.parametrize("name,logits,t,k,p", CASES, ids=[c[0] for c in CASES])
def test_samples_follow_the_reference_and_never_leave_its_support(
    name, logits, t, k, p, monkeypatch
):
    # 4 candidates: PEAKED's 0.9 nucleus fits in them (within branch), FLAT's 0.6 does not.
    monkeypatch.setattr(sampling, "CANDIDATES", 4)
    want = reference(logits, t, k, p)
    for rows in (1, 4):
        got = draw(logits, t, k, p, rows)
        outside = set(np.unique(got)) - set(np.flatnonzero(want > 0))
        assert not outside, (name, outside)
        assert tv(got, want) < BOUND, (name, rows, tv(got, want))
    # The dense description of the same distribution agrees with the reference.
    dense = np.asarray(jax.nn.softmax(sampling.adjusted_logits(jnp.asarray(logits), t, k, p)))
    np.testing.assert_allclose(dense, want, atol=1e-6)


def test_a_wrong_rule_is_rejected():
    """Controls: the same bound rejects a nucleus one token wider and an ignored temperature."""
    got = draw(FLAT, 1.3, None, 0.6)
    assert tv(got, reference(FLAT, 1.3, None, 0.6)) < BOUND
    assert tv(got, reference(FLAT, 1.3, None, 0.6, widen=1)) > BOUND
    got = draw(FLAT, 0.5, 5, None)
    assert tv(got, reference(FLAT, 1.0, 5, None)) > BOUND


def test_top_p_branches_are_both_taken():
    """With 4 candidates the peaked row's nucleus fits (mass of the top 4 >= top_p) and the flat
    row's does not: each branch of the top-p sampler is exercised above."""
    for logits, t, p, fits in ((PEAKED, 1.0, 0.9, True), (FLAT, 1.3, 0.6, False)):
        x = np.sort(np.asarray(logits, np.float64) / t)[::-1]
        mass = np.exp(x[:4] - np.logaddexp.reduce(x)).sum()
        assert (mass >= p) == fits, (mass, p)
