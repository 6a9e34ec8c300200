"""Draft trees (dflash_jax.tree): the builder keeps exactly the most probable prefixes, its
arrays are consistent (parents first, depths, ancestor masks), and the walk accepts the longest
path the target agrees with."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import tree as tree_lib


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
