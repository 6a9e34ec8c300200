"""Turning target logits into tokens: greedy, or samples from the temperature / top-k / top-p
adjusted distribution. The same adjusted distribution is used by the autoregressive baseline and
by speculative verification, which is what makes sampled speculative decoding lossless."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

# Candidates of a filtered sample: top-k draws within its k (lax.top_k, never a sort of the
# vocabulary); top-p alone within the top CANDIDATES logits of each row when their mass reaches
# top_p (checked at every call; the nucleus then lies inside them), else over the sorted
# vocabulary: exact either way.
CANDIDATES = 256


def _nucleus(vals, lse, top_p):
    """Candidates [..., C] sorted descending, their normalizer `lse` [..., 1]: vals with the
    tokens outside the smallest top-p nucleus at -inf (a token is kept iff the mass before it
    is below top_p; the first always is)."""
    probs = jnp.exp(vals - lse)
    before = jnp.cumsum(probs, axis=-1) - probs
    return jnp.where(before < top_p, vals, -jnp.inf)


def _filtered(x, top_k: Optional[int], top_p: Optional[float], width: int):
    """The `width` largest of x [..., V] (sorted, with ids) with top-k (exactly k of them: ties
    at the k-th value go to the lower id) and then the top-p nucleus (renormalized over the
    top-k, or over the whole row without top-k) applied; -inf marks excluded candidates."""
    vals, ids = jax.lax.top_k(x, width)
    if top_p is not None:
        scope = vals if top_k is not None else x
        vals = _nucleus(vals, jax.nn.logsumexp(scope, axis=-1, keepdims=True), top_p)
    return vals, ids.astype(jnp.int32)


def _filters(v: int, top_k, top_p):
    top_k = int(top_k) if top_k is not None and 0 < top_k < v else None
    top_p = float(top_p) if top_p is not None and top_p < 1.0 else None
    return top_k, top_p


def candidates(logits, temperature: float, top_k: Optional[int], top_p: Optional[float]):
    """(log-weights [..., C], token ids [..., C]) of the distribution to sample from: logits /
    temperature restricted to the top-k (exactly k: ties at the k-th value go to the lower id)
    and then to the smallest top-p nucleus (renormalized after top-k). Tokens outside are not
    in the arrays; -inf marks excluded candidates. C = k with top-k; V (sorted) with top-p
    alone (`pick_tokens` samples within the top CANDIDATES where the nucleus fits there); no
    filter: the whole vocabulary in id order."""
    x = logits.astype(jnp.float32) / temperature
    v = x.shape[-1]
    top_k, top_p = _filters(v, top_k, top_p)
    if top_k is None and top_p is None:
        return x, jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return _filtered(x, top_k, top_p, top_k if top_k is not None else v)


def adjusted_logits(logits, temperature: float, top_k: Optional[int], top_p: Optional[float]):
    """Dense log-weights [..., V] of the distribution `pick_tokens` samples from (`candidates`
    scattered back into the vocabulary, -inf elsewhere): for tests and analysis."""
    vals, ids = candidates(logits, temperature, top_k, top_p)
    out = jnp.full(logits.shape, -jnp.inf, jnp.float32)
    return jnp.put_along_axis(out, ids, vals, axis=-1, inplace=False)


def _gumbel_pick(key, vals, ids):
    """A sample from softmax(vals) over the candidates, as the candidate's token id: the
    Gumbel-max draw (argmax of vals + Gumbel noise), which can only pick a finite (kept)
    candidate; C random numbers per row, C <= k or CANDIDATES."""
    g = jax.random.gumbel(key, vals.shape, jnp.float32)
    j = jnp.argmax(vals + g, axis=-1)
    return jnp.take_along_axis(ids, j[..., None], axis=-1)[..., 0]


def greedy_argmax(logits):
    """[..., V] -> [...] int32: the first index of the maximum, like `jnp.argmax`.

    Written as a max and a min-reduce of the matching indices: XLA:CPU lowers `argmax` to a
    variadic (value, index) reduce that does not vectorize, ~4x slower over a 16x4096 block
    (two per DFlash step; `benchmarks/experiments/token_choosers/op_costs.py`). A row with NaN gives the last index, not
    the NaN's.
    """
    m = jnp.max(logits, axis=-1, keepdims=True)
    v = logits.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.minimum(jnp.min(jnp.where(logits == m, iota, v), axis=-1), v - 1)


def pick_tokens(logits, key, temperature: float, top_k=None, top_p=None):
    """[..., V] logits -> [...] int32 tokens: argmax at temperature 0, else a sample of the
    `candidates` distribution. Filtered samples are drawn among candidates (never outside
    top-k / top-p: the tokens outside are not in the arrays drawn from), with no sort of the
    vocabulary: top-k within its k, top-p alone within the top CANDIDATES when every row's
    nucleus fits there (else the sorted vocabulary: exact either way). Unfiltered samples use
    the inverse-CDF sampler over the vocabulary (every token has mass)."""
    if temperature == 0.0:
        return greedy_argmax(logits)
    x = logits.astype(jnp.float32) / temperature
    v = x.shape[-1]
    top_k, top_p = _filters(v, top_k, top_p)
    if top_k is None and top_p is None:
        return sample_categorical(key, x)
    if top_k is not None:
        return _gumbel_pick(key, *_filtered(x, top_k, top_p, top_k))
    c = min(CANDIDATES, v)
    if c == v:
        return _gumbel_pick(key, *_filtered(x, None, top_p, v))
    vals, ids = jax.lax.top_k(x, c)
    lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
    fits = jnp.all(jnp.sum(jnp.exp(vals - lse), axis=-1) >= top_p)
    return jax.lax.cond(
        fits,
        lambda: _gumbel_pick(key, _nucleus(vals, lse, top_p), ids.astype(jnp.int32)),
        lambda: _gumbel_pick(key, *_filtered(x, None, top_p, v)),
    )


def sample_categorical(key, log_weights):
    """[..., V] unnormalized log-weights (-inf allowed) -> [...] int32 samples, by inverse
    transform: one uniform per row against the cumulative distribution.

    `jax.random.categorical` draws V Gumbel variates per row instead; for a 16-token verify
    block that random-bit generation is most of the sampling cost (about 6x slower on CPU at
    V = 4096; `benchmarks/experiments/token_choosers/op_costs.py`). Token i is drawn iff cdf[i-1] <= u < cdf[i], with
    probability p_i (up to float32 rounding of the running sum); zero-probability tokens have
    an empty interval.
    """
    x = log_weights.astype(jnp.float32)
    p = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    cdf = jnp.cumsum(p, axis=-1)
    u = jax.random.uniform(key, x.shape[:-1] + (1,), jnp.float32) * cdf[..., -1:]
    idx = jnp.sum((cdf <= u).astype(jnp.int32), axis=-1)
    return jnp.minimum(idx, x.shape[-1] - 1).astype(jnp.int32)
