"""Draft trees (dflash_jax.drafters.tree): the builder keeps exactly the most probable prefixes, its
arrays are consistent (parents first, depths, ancestor masks), and the walk accepts the longest
path the target agrees with."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.drafters import tree as tree_lib


def _prefixes(logp, k):
    """Every prefix of length 1..L over the top-k tokens per position, with its score."""
    depth, _ = logp.shape
    top = [np.argsort(-logp[d], kind="stable")[:k] for d in range(depth)]
    out = {}
    for d in range(1, depth + 1):
        for combo in itertools.product(*top[:d]):
            out[combo] = float(sum(logp[i, t] for i, t in enumerate(combo)))
    return out


def _node_prefixes(t, row):
    """{prefix tuple: score} of the tree's nodes in row `row`, rebuilt from parents/tokens."""
    tokens, parents = np.asarray(t.tokens[row]), np.asarray(t.parents[row])
    out = {}
    for i in range(1, len(tokens)):
        path, j = [], i
        while j > 0:
            path.append(int(tokens[j]))
            j = int(parents[j])
        out[tuple(reversed(path))] = float(t.scores[row, i])
    return out


@pytest.mark.parametrize(
    "depth,vocab,budget,top_k", [(3, 5, 7, None), (4, 6, 20, 3), (2, 4, 12, None), (5, 3, 1, None)]
)
def test_builder_keeps_exactly_the_most_probable_prefixes(depth, vocab, budget, top_k):
    rng = np.random.default_rng(depth * 100 + budget)
    logits = rng.normal(size=(3, depth, vocab)).astype(np.float32) * 2
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    root = jnp.asarray([7, 8, 9])
    t = tree_lib.build_tree(root, jnp.asarray(logp), budget, top_k)
    k = min(budget, vocab) if top_k is None else min(top_k, budget, vocab)
    for row in range(3):
        every = _prefixes(logp[row], k)
        best = sorted(every.items(), key=lambda kv: -kv[1])[:budget]
        got = _node_prefixes(t, row)
        assert len(got) == budget  # distinct prefixes, exactly `budget` of them
        assert set(got) == {p for p, _ in best}, row
        for p, s in got.items():
            assert s == pytest.approx(every[p], abs=1e-5)
        parents, depths = np.asarray(t.parents[row]), np.asarray(t.depths[row])
        mask = np.asarray(t.mask[row])
        assert parents[0] == -1 and depths[0] == 0 and int(t.tokens[row, 0]) == int(root[row])
        for i in range(1, budget + 1):
            assert 0 <= parents[i] < i and depths[i] == depths[parents[i]] + 1
            anc = {i}
            j = i
            while j > 0:
                j = int(parents[j])
                anc.add(j)
            assert set(np.flatnonzero(mask[i])) == anc


def test_builder_refuses_a_budget_no_tree_can_hold():
    logp = jnp.zeros((1, 2, 3))
    with pytest.raises(ValueError, match="exceeds the 12 prefixes"):
        tree_lib.build_tree(jnp.zeros((1,), jnp.int32), logp, 13)
    with pytest.raises(ValueError, match="budget >= 1"):
        tree_lib.build_tree(jnp.zeros((1,), jnp.int32), logp, 0)


def test_walk_accepts_the_longest_agreeing_path():
    # Depth 3, vocabulary 4: token 0 best everywhere, then 1.
    logp = jnp.log(jnp.asarray([[[0.6, 0.3, 0.05, 0.05]] * 3]))
    t = tree_lib.build_tree(jnp.asarray([9]), logp, 6)
    tokens, parents = np.asarray(t.tokens[0]), np.asarray(t.parents[0])

    def node(prefix):
        for i in range(1, len(tokens)):
            path, j = [], i
            while j > 0:
                path.append(int(tokens[j]))
                j = int(parents[j])
            if tuple(reversed(path)) == prefix:
                return i
        raise KeyError(prefix)

    # The target says 1 at the root, then 0, then 2: the path (1, 0) exists, (1, 0, 2) not.
    y = np.full((1, len(tokens)), 3, np.int32)
    y[0, 0] = 1
    y[0, node((1,))] = 0
    y[0, node((1, 0))] = 2
    path, a = tree_lib.accept_path(t, jnp.asarray(y), 3)
    assert int(a[0]) == 2
    assert list(np.asarray(path[0, :2])) == [node((1,)), node((1, 0))]
    # Nothing matches at the root: no draft accepted.
    y[0, 0] = 3
    _, a = tree_lib.accept_path(t, jnp.asarray(y), 3)
    assert int(a[0]) == 0


# ------------------------------------------------------------------ tree decoding == AR


def _prompts(pair_prompts, n=64):
    """n ragged prompts of 3..16 tokens (one prompt bucket: one program per batch size):
    prefixes of the bundled code prompts and their token windows."""
    toks = [t for p in pair_prompts for t in p]
    out = []
    for i in range(n):
        length = 3 + (i * 5) % 14
        s = (i * 7) % (len(toks) - length)
        out.append(toks[s : s + length])
    return out


@pytest.fixture(scope="module")
def greedy_runs(bundled_pair):
    """{(budget or "ar", batch): GenerationResult list} over 64 prompts: 60 in batches of 5 and
    4 alone, 16 new tokens, with a stop token that the outputs contain."""
    import dflash_jax as dj

    target, drafter, prompts = bundled_pair
    prompts = _prompts(prompts)
    ar = dj.generate(target, None, prompts, 16)
    counts = {}
    for row in ar.tokens:
        for t in row[2:-2]:
            counts[t] = counts.get(t, 0) + 1
    stop = [max(counts, key=counts.get)]  # the commonest mid-output token: some rows stop early
    runs = {}
    for budget in ("ar", 4, 16, 64):
        for batch, rows in ((5, range(0, 60)), (1, range(60, 64))):
            chunks = [list(rows)[i : i + batch] for i in range(0, len(rows), batch)]
            runs[budget, batch] = [
                (
                    c,
                    dj.generate(
                        target,
                        None if budget == "ar" else drafter,
                        [prompts[i] for i in c],
                        16,
                        block_size=None if budget == "ar" else 16,  # AR takes none
                        stop_token_ids=stop,
                        tree_budget=None if budget == "ar" else budget,
                    ),
                )
                for c in chunks
            ]
    return runs, stop


def test_greedy_tree_decoding_equals_autoregressive(greedy_runs):
    """64 ragged prompts x budgets 4 / 16 / 64 x batch 5 and 1, with a stop token: every token
    equals autoregressive decoding's, and the trees are accepted (multi-token steps; tau grows
    with the budget)."""
    runs, stop = greedy_runs
    ar = {i: toks for c, r in runs["ar", 5] + runs["ar", 1] for i, toks in zip(c, r.tokens)}
    assert sum(stop[0] in t for t in ar.values()) >= 5  # the stop token really cuts rows
    taus = {}
    for budget in (4, 16, 64):
        got = {}
        steps = []
        for batch in (5, 1):
            for c, r in runs[budget, batch]:
                got.update(zip(c, r.tokens))
                steps += [n for row in r.acceptance_lengths for n in row]
        assert got == ar, budget
        taus[budget] = sum(steps) / len(steps)
        assert max(steps) >= 4, budget
    assert taus[4] < taus[16] < taus[64], taus
    assert taus[4] > 1.5, taus


def test_tree_caches_equal_autoregressive_caches(bundled_pair):
    """After tree decoding (accepted nodes compacted into place) the target's cache holds, at
    every committed slot, the K/V of autoregressive decoding, and the drafter's context cache
    the K/V of chain decoding, for the same committed tokens."""
    import dflash_jax as dj
    from dflash_jax.decoding.programs import buffer_sizes, generate_programs
    from dflash_jax.decoding.step import Plan

    target, drafter, prompts = bundled_pair
    prompts = prompts[:2]
    states = {}
    for name, dr, budget in (("ar", None, None), ("chain", drafter, None), ("tree", drafter, 16)):
        tmod = dj.Transformer(target.config)
        dmod = None if dr is None else dj.DFlashDrafter(dr.config)
        plan = Plan(block_size=1 if dr is None else 16, tree_budget=budget)
        width = 1 if dr is None else (16 if budget is None else budget + 1)
        lens = np.array([len(p) for p in prompts], np.int32)
        p_pad, n_buf, cap = buffer_sizes(int(lens.max()), 24, width)
        ids = np.zeros((2, p_pad), np.int32)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        prefill, decode, _ = generate_programs(
            tmod,
            dmod,
            plan,
            cap,
            n_buf,
            None,
            target.params,
            None if dr is None else dr.params,
            2,
            p_pad,
        )
        dp = None if dr is None else dr.params
        s = prefill(
            target.params,
            dp,
            jnp.asarray(ids),
            jnp.asarray(lens),
            jnp.int32(24),
            jax.random.PRNGKey(0),
        )
        states[name] = decode(target.params, dp, s)
    ar, chain, tree = states["ar"], states["chain"], states["tree"]
    np.testing.assert_array_equal(tree.tokens[:, :24], ar.tokens[:, :24])
    assert int(jnp.max(tree.accepted)) >= 4  # multi-token tree steps were compacted
    lens = np.asarray(tree.cache.lengths)
    np.testing.assert_array_equal(lens, np.asarray(ar.cache.lengths))
    for b in range(2):
        n = int(lens[b])
        for mine, ref in ((tree.cache, ar.cache), (tree.ctx, chain.ctx)):
            for x, y in zip(mine.k + mine.v, ref.k + ref.v):
                np.testing.assert_allclose(x[b, :n], y[b, :n], atol=2e-5, rtol=1e-5)


def test_tree_from_denoising_passes_equals_autoregressive(bundled_pair):
    """tree_budget with denoise_steps = 2: the tree is built from the two passes' distributions
    (each position's from the pass that drafted it: the 8 of 15 fixed after the first pass keep
    its log-probs, the other 7 get the second pass's, which differ), and decoding with it gives
    the autoregressive tokens with the tree accepted."""
    import dflash_jax as dj
    from dflash_jax.decoding.programs import buffer_sizes, generate_programs
    from dflash_jax.decoding.step import Decoder, Plan

    target, drafter, prompts = bundled_pair
    tmod, dmod = dj.Transformer(target.config), dj.DFlashDrafter(drafter.config)
    plan1 = Plan(block_size=16, tree_budget=16)
    plan2 = Plan(block_size=16, tree_budget=16, denoise_steps=2)
    lens = np.array([len(p) for p in prompts], np.int32)
    p_pad, n_buf, cap = buffer_sizes(int(lens.max()), 8, 17)
    ids = np.zeros((len(prompts), p_pad), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    prefill, _, _ = generate_programs(
        tmod, dmod, plan1, cap, n_buf, None, target.params, drafter.params, len(prompts), p_pad
    )
    st = prefill(
        target.params, drafter.params, jnp.asarray(ids), jnp.asarray(lens), jnp.int32(8),
        jax.random.PRNGKey(0),
    )  # fmt: skip
    x_last, start = st.tokens[:, 0], st.cache.lengths
    decoder = Decoder(target.params, drafter.params, tmod, dmod, plan1)
    lp1 = np.asarray(decoder.kind.draft_logprobs(decoder, st.ctx, x_last, start))
    decoder2 = decoder.replace(plan=plan2)
    lp2 = np.asarray(decoder2.kind.draft_logprobs(decoder2, st.ctx, x_last, start))
    n1 = int(round(15 / 2))  # 8 (Python rounds half to even)
    first = np.argsort(-lp1.max(-1), axis=1, kind="stable")[:, :n1]  # fixed after pass 1
    kept = np.zeros(lp1.shape[:2], bool)
    np.put_along_axis(kept, first, True, axis=1)
    np.testing.assert_allclose(lp2[kept], lp1[kept], atol=1e-5)
    assert np.abs(lp2 - lp1).max(-1)[~kept].min() > 1e-4  # every later one re-predicted
    ar = dj.generate(target, None, prompts, 40).tokens
    res = dj.generate(target, drafter, prompts, 40, tree_budget=16, denoise_steps=2)
    assert res.tokens == ar
    assert res.tau > 1.5 and max(max(a) for a in res.acceptance_lengths) >= 4


def test_bad_tree_requests_are_one_line_errors(bundled_pair):
    import dflash_jax as dj

    target, drafter, prompts = bundled_pair
    cases = [
        (dict(tree_budget=0), "tree_budget must be in"),
        (dict(tree_budget=2000), "tree_budget must be in"),
        (dict(tree_budget=8, confidence_threshold=0.5), "does not combine with confidence"),
        (dict(tree_budget=8, return_drafts=True), "does not combine with return_drafts"),
        (dict(tree_budget=1.5), "must be an int"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            dj.generate(target, drafter, prompts[:1], 8, **kwargs)
    with pytest.raises(ValueError, match="needs a drafter"):
        dj.generate(target, None, prompts[:1], 8, tree_budget=4)


# ------------------------------------------------------------------ the tree kernel


@pytest.mark.parametrize(
    "b,t,hq,hkv,d,s",
    [(2, 9, 8, 2, 128, 300), (1, 17, 4, 2, 64, 1024), (3, 5, 4, 4, 64, 130)],
)
def test_tree_kernel_equals_the_xla_reference(b, t, hq, hkv, d, s):
    """The TPU decode kernel with a tree mask (interpret mode) equals the XLA reference: GQA,
    head dims 128 and 64 (two heads per lane block), ragged prefixes, random masks."""
    import pallas_kernels as pk

    rng = np.random.default_rng(b * 1000 + s)
    shape = lambda *x: jnp.asarray(rng.normal(size=x), jnp.float32)
    q, k, v = shape(b, t, hq, d), shape(b, s, hkv, d), shape(b, s, hkv, d)
    bk, bv = shape(b, t, hkv, d), shape(b, t, hkv, d)
    m = rng.random((b, t, t)) < 0.4
    m[:, np.arange(t), np.arange(t)] = True
    m = jnp.asarray(m)
    pre = jnp.asarray(rng.integers(0, s - t, size=b), jnp.int32)
    ref = pk.reference.tree_attention(q, k, v, pre, bk, bv, m)
    got = pk.tree_attention(q, k, v, pre, bk, bv, m, impl="pallas_tpu", interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5)
    # The mask binds: all-visible blocks give another answer.
    other = pk.reference.tree_attention(q, k, v, pre, bk, bv, jnp.ones_like(m))
    assert float(jnp.max(jnp.abs(other - ref))) > 1e-2


def test_tree_decoding_through_the_kernels_equals_autoregressive(bundled_pair):
    """The model's tree verify through the Pallas kernels (interpret mode: the tree kernel,
    the cache-write kernel, the draft kernel) gives the autoregressive tokens."""
    import dflash_jax as dj

    target, drafter, prompts = bundled_pair
    prompts = prompts[:2]
    ar = dj.generate(target, None, prompts, 12)
    r = dj.generate(target, drafter, prompts, 12, tree_budget=8, attention_impl="pallas_interpret")
    assert r.tokens == ar.tokens
    assert max(max(a) for a in r.acceptance_lengths) >= 3, r.acceptance_lengths


def test_tree_results_readme_holds_the_scripts_tables():
    """benchmarks/results/tree_budget/README.md's tables are what
    benchmarks/experiments/trees/tree_table.py makes of the committed JSONs (rerun
    `python benchmarks/experiments/trees/tree_table.py --write`)."""
    import os

    from benchmarks.experiments.trees import tree_table

    doc = open(os.path.join(tree_table.TREES, "README.md")).read()
    assert tree_table.table(tree_table.rows()) in doc
    assert tree_table.cpu_table() in doc
