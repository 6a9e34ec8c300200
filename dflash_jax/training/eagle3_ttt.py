"""EAGLE-3 training with training-time test (TTT, issue 43): the draft vocabulary from token
counts, and the loss of J unrolled drafting steps over packed sequences.

The drafter drafts one token a step, each step fed its own output of the step before; trained
only on the target's features (step 0) it would never see its own, so TTT unrolls the J steps
in training as the decode loop runs them (`Eagle3Drafter.unrolled`, equal to the decode loop's
cached steps: tests/test_eagle3_training.py). Step j at row p reads the embedding of the token
at p + 1 + j (teacher forced: the data's token, which on regenerated data is the target's own
greedy choice) and predicts the token at p + 2 + j, over the draft vocabulary.

Facts (public descriptions of EAGLE-3 and SpecForge's trainer, read with the search tools;
nothing copied): the draft vocabulary is the most frequent target tokens of the training data,
stored as `d2t` offsets (draft id i is target id i + d2t[i]); a target token outside it is not
a label; later steps' losses weigh less (a geometric decay, 0.8 in SpecForge).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafters.eagle3 import Eagle3Drafter


def draft_vocabulary(token_counts, draft_vocab_size: int) -> np.ndarray:
    """d2t int64 [Vd] of the `draft_vocab_size` most frequent target ids (ties to the smaller
    id), in increasing id order: draft id i is target id i + d2t[i]."""
    counts = np.asarray(token_counts)
    if counts.ndim != 1 or not 0 < draft_vocab_size <= counts.shape[0]:
        raise ValueError(
            f"draft_vocab_size must be in [1, {counts.shape[-1]}] (the target's vocabulary), "
            f"got {draft_vocab_size}"
        )
    order = np.lexsort((np.arange(counts.shape[0]), -counts))  # count desc, then id asc
    ids = np.sort(order[:draft_vocab_size])
    return (ids - np.arange(draft_vocab_size)).astype(np.int64)


def target_to_draft(d2t, vocab_size: int) -> np.ndarray:
    """int32 [V]: the draft id of each target id, -1 where the draft vocabulary lacks it."""
    d2t = np.asarray(d2t, np.int64)
    out = np.full((vocab_size,), -1, np.int32)
    out[np.arange(d2t.shape[0]) + d2t] = np.arange(d2t.shape[0], dtype=np.int32)
    return out


def ttt_mask(segment_ids_BS):
    """[B, S, S]: row p sees row r <= p of its own sequence (segment); a padding row (segment
    0) sees itself only, so its softmax stays finite (its loss is masked)."""
    seg = segment_ids_BS
    s = seg.shape[1]
    causal = jnp.tril(jnp.ones((s, s), bool))[None]
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    return (causal & same) | jnp.eye(s, dtype=bool)[None]


def shifted(x_BS, by: int, fill=0):
    """x shifted left by `by` along the sequence: out[b, p] = x[b, p + by], `fill` past the end."""
    s = x_BS.shape[1]
    if by >= s:
        return jnp.full_like(x_BS, fill)
    pad = jnp.full((x_BS.shape[0], by), fill, x_BS.dtype)
    return jnp.concatenate([x_BS[:, by:], pad], axis=1)


def ttt_loss(dmod: Eagle3Drafter, dparams, embed_VH, taps_BS3F, batch, t2d_V, steps: int, decay):
    """(loss, metrics) of `steps` unrolled drafting steps (module doc).

    batch: input_ids, loss_mask (1 on the tokens to learn: the assistant's), segment_ids [B, S]
    (0: padding); taps_BS3F the target's three tapped layers (frozen); embed_VH the target's
    (frozen, shared) embedding; t2d_V `target_to_draft`. Step j's loss is the mean
    cross-entropy over its valid labels (the token at p + 2 + j in p's segment, on the loss
    mask, in the draft vocabulary); loss = sum_j decay^j loss_j / sum_j decay^j.
    metrics: loss, per step `loss_k`, `correct_k`, `count_k` [steps], and `accept_sum` /
    `accept_rows`: summed over rows p whose first label is valid, the number of leading steps
    whose argmax equals its label (teacher forced), so accept_sum / accept_rows + 1 estimates
    tokens per target pass for a chain of `steps` drafts."""
    ids, seg = batch["input_ids"], batch["segment_ids"]
    lmask = batch["loss_mask"].astype(bool)
    b, s = ids.shape
    positions = _positions(seg)
    embs = jnp.stack([embed_VH[shifted(ids, 1 + j)] for j in range(steps)])
    logits = dmod.apply(
        {"params": dparams},
        taps_BS3F,
        embs,
        positions,
        ttt_mask(seg),
        method=Eagle3Drafter.unrolled,
    )  # [J, B, S, Vd]
    t2d = jnp.asarray(t2d_V, jnp.int32)
    losses, correct, count, hits = [], [], [], []
    still = jnp.ones((b, s), bool)
    for j in range(steps):
        label_t = shifted(ids, 2 + j)
        label = t2d[label_t]
        valid = (
            (shifted(seg, 2 + j) == seg)
            & (seg > 0)
            & shifted(lmask, 2 + j, False)
            & (label >= 0)
            & (jnp.arange(s)[None] + 2 + j < s)
        )
        lg = logits[j].astype(jnp.float32)
        ce = (
            jax.nn.logsumexp(lg, -1)
            - jnp.take_along_axis(lg, jnp.maximum(label, 0)[..., None], -1)[..., 0]
        )
        n = jnp.sum(valid)
        losses.append(jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.maximum(n, 1))
        right = valid & (jnp.argmax(lg, -1) == label)
        correct.append(jnp.sum(right))
        count.append(n)
        if j == 0:
            first = valid
        still = still & right
        hits.append(jnp.sum(still & first))
    w = jnp.asarray([float(decay) ** j for j in range(steps)], jnp.float32)
    per_step = jnp.stack(losses)
    loss = jnp.sum(w * per_step) / jnp.sum(w)
    metrics = dict(
        loss=loss,
        loss_k=per_step,
        correct_k=jnp.stack(correct),
        count_k=jnp.stack(count),
        accept_sum=jnp.sum(jnp.stack(hits)),
        accept_rows=jnp.sum(first),
    )
    return loss, metrics


def _positions(segment_ids_BS):
    """Each row's position within its segment (packed sequences restart at 0)."""
    seg = segment_ids_BS
    s = seg.shape[1]
    idx = jnp.broadcast_to(jnp.arange(s), seg.shape)
    starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return (idx - start_idx).astype(jnp.int32)
