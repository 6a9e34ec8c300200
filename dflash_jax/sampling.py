"""Turning target logits into tokens: greedy, or samples from the temperature / top-k / top-p
adjusted distribution. The same adjusted distribution is used by the autoregressive baseline and
by speculative verification, which is what makes sampled speculative decoding lossless."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def adjusted_logits(logits, temperature: float, top_k: Optional[int], top_p: Optional[float]):
    """Log-weights of the distribution to sample from: logits/temperature, with everything
    outside the top-k and outside the smallest top-p nucleus set to -inf."""
    x = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k > 0 and top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if top_p is not None and top_p < 1.0:
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_x, axis=-1)
        # Keep the tokens whose preceding cumulative mass is below top_p (always the first).
        before = jnp.cumsum(probs, axis=-1) - probs
        keep = before < top_p
        cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, -jnp.inf, x)
    return x


def greedy_argmax(logits):
    """[..., V] -> [...] int32: the first index of the maximum, like `jnp.argmax`.

    Written as a max and a min-reduce of the matching indices: XLA:CPU lowers `argmax` to a
    variadic (value, index) reduce that does not vectorize, ~4x slower over a 16x4096 block
    (two per DFlash step; `benchmarks/op_costs.py`). A row with NaN gives the last index, not
    the NaN's.
    """
    m = jnp.max(logits, axis=-1, keepdims=True)
    v = logits.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.minimum(jnp.min(jnp.where(logits == m, iota, v), axis=-1), v - 1)


def pick_tokens(logits, key, temperature: float, top_k=None, top_p=None):
    """[..., V] logits -> [...] int32 tokens: argmax at temperature 0, else a sample."""
    if temperature == 0.0:
        return greedy_argmax(logits)
    return sample_categorical(key, adjusted_logits(logits, temperature, top_k, top_p))


def sample_categorical(key, log_weights):
    """[..., V] unnormalized log-weights (-inf allowed) -> [...] int32 samples, by inverse
    transform: one uniform per row against the cumulative distribution.

    `jax.random.categorical` draws V Gumbel variates per row instead; for a 16-token verify
    block that random-bit generation is most of the sampling cost (about 6x slower on CPU at
    V = 4096; `benchmarks/op_costs.py`). Token i is drawn iff cdf[i-1] <= u < cdf[i], with
    probability p_i (up to float32 rounding of the running sum); zero-probability tokens have
    an empty interval.
    """
    x = log_weights.astype(jnp.float32)
    p = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    cdf = jnp.cumsum(p, axis=-1)
    u = jax.random.uniform(key, x.shape[:-1] + (1,), jnp.float32) * cdf[..., -1:]
    idx = jnp.sum((cdf <= u).astype(jnp.int32), axis=-1)
    return jnp.minimum(idx, x.shape[-1] - 1).astype(jnp.int32)
