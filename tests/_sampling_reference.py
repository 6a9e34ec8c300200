"""An independent NumPy reference of the sampling rules (no dflash_jax code): the probabilities
of each token under temperature, top-k (exactly k, by a stable argsort: ties at the k-th value
go to the lower id) and top-p (the smallest nucleus by sorted cumulative mass, renormalized
after top-k). Shared by test_sampling.py (single rows) and test_sampled_lossless.py (the exact
joint distribution of generated sequences)."""

import numpy as np


def reference(logits, temperature, top_k=None, top_p=None, widen=0):
    """NumPy float64: the probabilities [V] of each token of one row of logits [V] under
    temperature / top-k / top-p. `widen` keeps that many extra tokens in the nucleus (a wrong
    rule, for the controls)."""
    x = np.asarray(logits, np.float64) / temperature
    v = len(x)
    order = np.lexsort((np.arange(v), -x))  # descending, ties to the lower id
    keep = np.zeros(v, bool)
    keep[order[: (top_k if top_k else v)]] = True
    if top_p is not None:
        xs = x[order][keep[order]]
        p = np.exp(xs - xs.max())
        p /= p.sum()
        before = np.cumsum(p) - p
        n = int(np.sum(before < top_p)) + widen
        keep = np.zeros(v, bool)
        keep[order[:n]] = True
    w = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    return w / w.sum()
