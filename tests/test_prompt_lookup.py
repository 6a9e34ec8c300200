"""Prompt lookup (n-gram) drafting: the lookup against a NumPy statement of its rule, lossless
and accepted decoding against autoregressive decoding (batch, single prompt, stop tokens, a
confidence threshold), sampled decoding, and bad settings refused in one line."""

import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.drafters.prompt_lookup import lookup


def _lookup_numpy(seq, k, min_n, max_n):
    """The rule, stated for one sequence seq (positions 0..L, L = len(seq) - 1, seq[L] being
    x_last): the longest n in [min_n, max_n] whose last-n-token suffix occurred before at some
    j with j + n <= L; of its matches, the latest whose continuation holds k known tokens, else
    the earliest. Drafts: seq[j + n:][:k], padded with x_last (confidence 0 there)."""
    last = len(seq) - 1
    for n in range(max_n, min_n - 1, -1):
        if n > last:
            continue
        suffix = list(seq[last - n + 1 :])
        matches = [j for j in range(0, last - n + 1) if list(seq[j : j + n]) == suffix]
        if not matches:
            continue
        full = [j for j in matches if j + n + k - 1 <= last]
        j = max(full) if full else min(matches)
        cont = list(seq[j + n : j + n + k])
        conf = [1.0] * len(cont) + [0.0] * (k - len(cont))
        return cont + [seq[last]] * (k - len(cont)), conf
    return [seq[last]] * k, [0.0] * k


@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 3), (1, 3, 7), (2, 4, 5)])
def test_lookup_follows_the_rule(min_n, max_n, k):
    rs = np.random.RandomState(min_n * 10 + max_n)
    capacity = 24
    for _ in range(60):
        b = 3
        lengths = rs.randint(0, capacity, size=b)  # positions < length are history
        vocab = rs.choice([2, 3, 5])  # small vocabularies: many matches, many ties
        tokens = rs.randint(0, vocab, size=(b, capacity))
        tokens[np.arange(capacity)[None] >= lengths[:, None]] = 99  # stale slots: never read
        x_last = rs.randint(0, vocab, size=b)
        drafts, conf = lookup(
            jnp.asarray(tokens, jnp.int32),
            jnp.asarray(x_last, jnp.int32),
            jnp.asarray(lengths, jnp.int32),
            k,
            min_n,
            max_n,
        )
        for i in range(b):
            seq = list(tokens[i, : lengths[i]]) + [x_last[i]]
            want, want_conf = _lookup_numpy(seq, k, min_n, max_n)
            assert list(np.asarray(drafts[i])) == want, (seq, want)
            assert list(np.asarray(conf[i])) == want_conf


def test_lookup_continues_a_repeat():
    seq = [5, 6, 7, 8, 9, 1, 5, 6, 7]  # "5 6 7" seen before, followed by 8 9 1 5
    d, c = lookup(
        jnp.asarray([seq[:-1] + [0] * 4], jnp.int32),
        jnp.asarray([seq[-1]], jnp.int32),
        jnp.asarray([len(seq) - 1], jnp.int32),
        4,
        1,
        3,
    )
    assert np.asarray(d).tolist() == [[8, 9, 1, 5]] and np.asarray(c).tolist() == [[1.0] * 4]


@pytest.fixture(scope="module")
def ar_tokens(bundled_pair):
    target, _, prompts = bundled_pair
    return dj.generate(target, None, prompts, 96).tokens


@pytest.mark.parametrize("threshold", [None, 0.5])
def test_prompt_lookup_is_lossless_and_accepted(bundled_pair, ar_tokens, threshold):
    """Greedy decoding with prompt lookup equals autoregressive decoding token for token, and
    its drafts are accepted (the bundled target repeats itself, as small models do); under a
    confidence threshold the verify narrows to the looked-up drafts, same tokens."""
    target, _, prompts = bundled_pair
    res = dj.generate(
        target, dj.PromptLookup(block_size=8), prompts, 96, confidence_threshold=threshold
    )
    assert res.tokens == ar_tokens
    assert res.tau > 1.1, res.tau
    assert max(max(a) for a in res.acceptance_lengths if a) >= 3, res.acceptance_lengths


def test_prompt_lookup_single_prompt_and_stop_tokens(bundled_pair, ar_tokens):
    target, _, prompts = bundled_pair
    one = dj.generate(target, dj.PromptLookup(block_size=6, max_ngram=2), prompts[:1], 96)
    assert one.tokens == ar_tokens[:1]
    stop = ar_tokens[0][40]  # a token the first sequence emits: it stops there
    res = dj.generate(target, dj.PromptLookup(block_size=8), prompts, 96, stop_token_ids=[stop])
    ar = dj.generate(target, None, prompts, 96, stop_token_ids=[stop])
    assert res.tokens == ar.tokens
    assert len(res.tokens[0]) <= 41 and res.tokens[0][-1] == stop


def test_sampled_prompt_lookup_runs_and_is_accepted(bundled_pair):
    """At T > 0 the drafts are verified by the one-hot rule (exact: tests/test_sampled_lossless
    states it); here: the seeded run repeats itself and some drafts are accepted."""
    target, _, prompts = bundled_pair
    kw = dict(temperature=0.3, seed=3)
    a = dj.generate(target, dj.PromptLookup(block_size=8), prompts, 64, **kw)
    b = dj.generate(target, dj.PromptLookup(block_size=8), prompts, 64, **kw)
    assert a.tokens == b.tokens
    assert max(max(x) for x in a.acceptance_lengths if x) >= 2


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: dj.PromptLookup(block_size=1), "block_size must be in [2, 64]"),
        (lambda: dj.PromptLookup(min_ngram=0), "min_ngram must be in [1, 16]"),
        (lambda: dj.PromptLookup(min_ngram=3, max_ngram=2), "max_ngram must be in [3, 16]"),
        (lambda: dj.PromptLookup(max_ngram=2.0), "max_ngram must be an integer"),
    ],
)
def test_bad_prompt_lookup_settings_are_one_line(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "kw,name",
    [(dict(tree_budget=8), "tree_budget"), (dict(denoise_steps=2), "denoise_steps")],
)
def test_what_prompt_lookup_does_not_do_is_one_line(bundled_pair, kw, name):
    target, _, prompts = bundled_pair
    with pytest.raises(ValueError, match=f"{name} is not implemented for prompt lookup"):
        dj.generate(target, dj.PromptLookup(), prompts, 8, **kw)


def test_infer_drafter_spec_and_the_check_before_loading(bundled_pair):
    """infer.py's --drafter=prompt_lookup[:N | :MIN-MAX] reads as a PromptLookup (a directory
    or hub id does not), a bad range is one line, and the batch runner's config-only check
    refuses what generate refuses."""
    import os

    from _pair import PAIR

    from dflash_jax.drafters.prompt_lookup import from_spec
    from dflash_jax.frontend.infer_run import check_before_loading

    assert from_spec("prompt_lookup").config == dj.PromptLookup().config
    assert (
        from_spec("prompt_lookup:2-4").config.min_ngram,
        from_spec("prompt_lookup:4").config.max_ngram,
    ) == (2, 4)
    assert from_spec("assets/tiny-code/drafter") is None and from_spec(None) is None
    for bad, message in (("prompt_lookup:x", "MIN-MAX"), ("prompt_lookup:3-2", "max_ngram")):
        with pytest.raises(ValueError, match=message):
            from_spec(bad)
    _, _, prompts = bundled_pair
    target_dir = os.path.join(PAIR, "target")
    check_before_loading(target_dir, "prompt_lookup", prompts, dict(max_new_tokens=8))
    with pytest.raises(ValueError, match="tree_budget is not implemented for prompt lookup"):
        check_before_loading(
            target_dir, "prompt_lookup", prompts, dict(max_new_tokens=8, tree_budget=4)
        )
