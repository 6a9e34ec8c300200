"""Draft trees from one drafter pass (DDTree-style), with static shapes for the compiled loop.

The drafter's pass gives a distribution per block position d = 1 .. L (L = block_size - 1),
each conditioned on the context only, so the probability of a drafted prefix t_1 .. t_d is the
product of its per-position probabilities. `build_tree` keeps the `budget` most probable
prefixes: the K most likely tokens per position (K <= budget) enumerated best-first, one node
per pop, from a frontier that each pop grows by at most two candidates (the popped node's best
child and its next sibling). A child is never more probable than its parent, so best-first
order visits every node after its parent and the first `budget` pops are exactly the `budget`
most probable prefixes (ties broken by the order of discovery).

Tree arrays (per batch row; index 0 is the root, the last committed token, at depth 0):
  tokens  [B, N+1]  the root's token, then each node's drafted token
  parents [B, N+1]  parent index (-1 for the root), always < the node's own index
  depths  [B, N+1]  0 for the root; a node's position is start + depth
  mask    [B, N+1, N+1]  mask[i, j]: j is i itself or an ancestor of i (the verify's view
                         inside the tree; the committed prefix is visible to every node)
N = budget. `accept_path` walks from the root by the target's token at each node.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Tree:
    tokens: jnp.ndarray
    parents: jnp.ndarray
    depths: jnp.ndarray
    mask: jnp.ndarray
    scores: jnp.ndarray  # [B, N+1] log-probability of each node's prefix (root: 0)


def sharded_top_k(x, k: int):
    """`jax.lax.top_k(x, k)` over the last (vocabulary) axis of [B, ..., V] logits split over
    the context mesh's `tensor` axis (as the LM head leaves them): each device takes the top k
    of its own slice (`shard_map`, batch over the data axes), then the top k of the
    tensor * k candidates; the logits never cross devices (GSPMD's top-k gathers them).
    Plain `lax.top_k` without such a mesh or when the axis does not split in slices of >= k."""
    mesh = jax.sharding.get_abstract_mesh()
    shape = {} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes))
    n, v = shape.get("tensor", 1), x.shape[-1]
    if n == 1 or v % n or v // n < k:
        return jax.lax.top_k(x, k)
    from jax.sharding import PartitionSpec as P

    data = tuple(a for a in ("data", "fsdp") if shape.get(a, 1) > 1)
    n_data = 1
    for a in data:
        n_data *= shape[a]
    bax = data if data and x.shape[0] % n_data == 0 else None
    spec = P(bax, *([None] * (x.ndim - 2)), "tensor")
    out = P(bax)
    size = v // n

    def local(xs):
        vals, idx = jax.lax.top_k(xs, k)
        idx = idx + jax.lax.axis_index("tensor") * size
        # The tensor * k candidates on every device, in vocabulary order (ties as top_k).
        vals, idx = (
            jax.lax.all_gather(a, "tensor", axis=a.ndim - 1, tiled=True) for a in (vals, idx)
        )
        best, pos = jax.lax.top_k(vals, k)
        return best, jnp.take_along_axis(idx, pos, axis=-1)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=(out, out), check_vma=False)(
        x
    )


def max_nodes(depth: int, width: int) -> int:
    """How many distinct prefixes of length 1..depth exist with `width` tokens per position."""
    return sum(width**d for d in range(1, depth + 1))


def build_tree(root_B, logp_BLV, budget: int, top_k: int | None = None) -> Tree:
    """The `budget` most probable drafted prefixes below `root_B` [B] (see the module doc).

    logp_BLV: [B, L, V] log-probabilities of the drafter at block positions 1 .. L.
    top_k: tokens considered per position (default: min(budget, V)). Needs
    budget <= max_nodes(L, top_k), so that exactly `budget` nodes exist.
    """
    b, depth, v = logp_BLV.shape
    k = min(budget, v) if top_k is None else min(top_k, budget, v)
    if budget < 1 or depth < 1:
        raise ValueError(f"a draft tree needs budget >= 1 and depth >= 1, got {budget}, {depth}")
    if budget > max_nodes(depth, k):
        raise ValueError(
            f"tree budget {budget} exceeds the {max_nodes(depth, k)} prefixes of depth <= {depth}"
            f" with {k} tokens per position"
        )
    vals, toks = sharded_top_k(logp_BLV.astype(jnp.float32), k)
    # Without the barriers XLA:CPU fuses top_k with the slices below into a full sort of the
    # vocabulary (100x slower at V = 4096). One barrier per output: a barrier over both would
    # take the top_k's tuple itself once the partitioner simplifies tuple(gte 0, gte 1), and
    # XLA:CPU's TopkDecomposer then aborts the process (a batch replicated over `data`).
    vals = jax.lax.optimization_barrier(vals)
    toks = jax.lax.optimization_barrier(toks)
    n, f = budget, 2 * budget + 1
    neg = jnp.float32(-jnp.inf)
    bidx = jnp.arange(b)

    # Frontier candidates: (parent node index, depth 1..L, rank 0..K-1, score); slot 0 holds
    # the root's best child.
    c_par = jnp.zeros((b, f), jnp.int32)
    c_dep = jnp.ones((b, f), jnp.int32)
    c_rank = jnp.zeros((b, f), jnp.int32)
    c_score = jnp.full((b, f), neg).at[:, 0].set(vals[:, 0, 0])
    # Nodes 1..N (node 0 = the root).
    parents = jnp.full((b, n + 1), -1, jnp.int32)
    depths = jnp.zeros((b, n + 1), jnp.int32)
    tokens = jnp.zeros((b, n + 1), jnp.int32).at[:, 0].set(root_B.astype(jnp.int32))
    scores = jnp.zeros((b, n + 1), jnp.float32)
    mask = jnp.zeros((b, n + 1, n + 1), bool).at[:, 0, 0].set(True)

    def pop(i, carry):
        c_par, c_dep, c_rank, c_score, parents, depths, tokens, scores, mask = carry
        j = jnp.argmax(c_score, axis=1)  # first of the best: ties by order of discovery
        par, dep, rank, score = (x[bidx, j] for x in (c_par, c_dep, c_rank, c_score))
        node = i + 1
        parents = parents.at[:, node].set(par)
        depths = depths.at[:, node].set(dep)
        tokens = tokens.at[:, node].set(toks[bidx, dep - 1, rank])
        scores = scores.at[:, node].set(score)
        mask = mask.at[:, node].set(mask[bidx, par].at[:, node].set(True))
        c_score = c_score.at[bidx, j].set(neg)
        # The next sibling (same parent, next rank) and the best child (next depth, rank 0).
        sib = 2 * i + 1
        sib_ok = rank + 1 < k
        sib_score = scores[bidx, par] + vals[bidx, dep - 1, jnp.minimum(rank + 1, k - 1)]
        c_par = c_par.at[:, sib].set(par)
        c_dep = c_dep.at[:, sib].set(dep)
        c_rank = c_rank.at[:, sib].set(rank + 1)
        c_score = c_score.at[:, sib].set(jnp.where(sib_ok, sib_score, neg))
        kid = 2 * i + 2
        kid_ok = dep < depth
        kid_score = score + vals[bidx, jnp.minimum(dep, depth - 1), 0]
        c_par = c_par.at[:, kid].set(node)
        c_dep = c_dep.at[:, kid].set(dep + 1)
        c_rank = c_rank.at[:, kid].set(0)
        c_score = c_score.at[:, kid].set(jnp.where(kid_ok, kid_score, neg))
        return c_par, c_dep, c_rank, c_score, parents, depths, tokens, scores, mask

    carry = (c_par, c_dep, c_rank, c_score, parents, depths, tokens, scores, mask)
    *_, parents, depths, tokens, scores, mask = jax.lax.fori_loop(0, n, pop, carry)
    return Tree(tokens=tokens, parents=parents, depths=depths, mask=mask, scores=scores)


def accept_path(tree: Tree, y_BN, max_depth: int):
    """Walks from the root: at node c the target's token y[c] (its argmax, or a fresh sample)
    moves to the child of c drafted as y[c], if there is one. Returns (path [B, max_depth]:
    the accepted nodes by depth, padded with the last one; a [B]: how many were accepted).
    The committed tokens are y at [root, path[:a]]: a + 1 target tokens."""
    b, n1 = tree.tokens.shape
    bidx = jnp.arange(b)
    nodes = jnp.arange(n1)[None]

    def step(carry, _):
        cur, a, alive = carry
        want = y_BN[bidx, cur]
        hit = (tree.parents == cur[:, None]) & (tree.tokens == want[:, None]) & (nodes > 0)
        found = alive & jnp.any(hit, axis=1)
        nxt = jnp.where(found, jnp.argmax(hit, axis=1), cur).astype(jnp.int32)
        return (nxt, a + found, found), nxt

    init = (jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool))
    (_, a, _), path = jax.lax.scan(step, init, None, length=max_depth)
    return path.T, a
