"""A frequency-ranked draft vocabulary for DFlash drafters (FR-Spec's idea; EAGLE-3's d2t).

A DFlash drafter has no LM head of its own: it scores its block with the target's. On a small
target that head is most of the drafter's work (SmolLM2: 49,152 rows of 576 against two
drafter layers), in training (its forward and input gradient for every block position) and in
drafting. Most of those rows are tokens the target's answers almost never hold, so the head is
restricted to the K most frequent tokens of the training answers: `draft_vocab` int32 [K], the
target ids of the draft vocabulary, most frequent first.

- Training: the head's K rows (frozen, the target's); a label outside them gets weight 0
  (EAGLE-3 masks the same way), a soft label's mass outside them is dropped.
- Drafting: the drafter's logits over the K rows, scattered into the full vocabulary with -inf
  elsewhere (`full_logits`); the target verifies on its full vocabulary, so the output is the
  target's, whatever the drafter proposes (only tau changes).
- Format: a tensor `draft_vocab` (int32 [K]) beside the z-lab weights and `draft_vocab_size` in
  config.json. Loaders that do not know it ignore it (the reference code and Hugging Face's
  loaders warn about an unused tensor), which is correct: the head the drafter was trained with
  is K rows of the target's, so the full head scores the same K tokens the same way and only adds
  the rest; a drafter read that way drafts over the full vocabulary, still lossless.
  `load_drafter(..., draft_vocab=False)` does the same here.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np

from dflash_jax.models.safetensors_io import CheckpointError

TENSOR = "draft_vocab"


def token_counts(docs: Iterable, tokenize_fn, vocab_size: int) -> np.ndarray:
    """int64 [V]: how often each token is a loss-masked (answer) token of the documents."""
    counts = np.zeros(vocab_size, np.int64)
    for doc in docs:
        ids, mask = tokenize_fn(doc)
        ids = np.asarray(ids)[np.asarray(mask) > 0]
        counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def top_tokens(counts: np.ndarray, k: int) -> np.ndarray:
    """int32 [k]: the k most frequent token ids, most frequent first (ties: lower id first)."""
    counts = np.asarray(counts)
    if not 1 <= k <= counts.shape[0]:
        raise ValueError(f"draft vocabulary size must be in [1, {counts.shape[0]}], got {k}")
    order = np.lexsort((np.arange(counts.shape[0]), -counts))
    return order[:k].astype(np.int32)


def coverage(counts: np.ndarray, vocab: np.ndarray) -> float:
    """The fraction of the counted tokens that the vocabulary holds."""
    counts = np.asarray(counts)
    total = counts.sum()
    return float(counts[np.asarray(vocab)].sum() / total) if total else 0.0


def target_to_draft(vocab: Sequence[int], vocab_size: int) -> np.ndarray:
    """int32 [V]: each target id's index in the draft vocabulary, -1 outside it."""
    t2d = np.full(vocab_size, -1, np.int32)
    t2d[np.asarray(vocab)] = np.arange(len(vocab), dtype=np.int32)
    return t2d


def check(vocab, vocab_size: int, source: str = TENSOR, size: Optional[int] = None) -> np.ndarray:
    """`vocab` as int32 [K], checked: integers, distinct, within the target's vocabulary, and
    K == `size` when given (a one-line CheckpointError otherwise)."""
    arr = np.asarray(vocab)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise CheckpointError(
            f"{source}: draft vocabulary must be a 1-D integer tensor, got {arr.dtype} {arr.shape}"
        )
    if size is not None and arr.shape[0] != size:
        raise CheckpointError(f"{source}: {arr.shape[0]} draft tokens, config says {size}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise CheckpointError(f"{source}: draft vocabulary ids outside [0, {vocab_size})")
    if np.unique(arr).size != arr.size:
        raise CheckpointError(f"{source}: draft vocabulary lists a token twice")
    return arr.astype(np.int32)


def full_logits(logits_K, vocab, vocab_size: int):
    """[..., K] logits over the draft vocabulary -> [..., V] with -inf outside it."""
    import jax.numpy as jnp

    shape = logits_K.shape[:-1] + (vocab_size,)
    out = jnp.full(shape, -jnp.inf, logits_K.dtype)
    return out.at[..., jnp.asarray(vocab)].set(logits_K)
