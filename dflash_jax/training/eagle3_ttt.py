"""EAGLE-3 training with training-time test (TTT): the draft vocabulary from token
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


def ttt_attention(q_BSND, k0_BSKD, v0_BSKD, mask_BSS, kj_BSJKD, vj_BSJKD):
    """Attention of training-time test: query row p over the keys r of k0 / v0 with
    mask_BSS[b, p, r] and over row p's own J keys kj / vj [B, S, J, K, D] (its own drafting
    steps), one float32 softmax over both; grouped query heads (N = K x group). [B, S, N, D]
    in q's dtype."""
    b, s, n, d = q_BSND.shape
    kh = k0_BSKD.shape[2]
    f32 = jnp.float32
    q = q_BSND.reshape(b, s, kh, n // kh, d).astype(f32) * d**-0.5
    hi = jax.lax.Precision.HIGHEST
    main = jnp.einsum("bskgd,brkd->bkgsr", q, k0_BSKD.astype(f32), precision=hi)
    main = jnp.where(mask_BSS[:, None, None], main, -jnp.inf)
    own = jnp.einsum("bskgd,bsjkd->bkgsj", q, kj_BSJKD.astype(f32), precision=hi)
    p = jax.nn.softmax(jnp.concatenate([main, own], axis=-1), axis=-1)
    out = jnp.einsum("bkgsr,brkd->bskgd", p[..., :s], v0_BSKD.astype(f32), precision=hi)
    out = out + jnp.einsum("bkgsj,bsjkd->bskgd", p[..., s:], vj_BSJKD.astype(f32), precision=hi)
    return out.reshape(b, s, n, d).astype(q_BSND.dtype)


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


def ttt_loss(dmod, dparams, embed, taps_BS3F, batch, t2d_V, steps: int, decay):
    """(loss, metrics) of `steps` unrolled drafting steps (module doc).

    batch: input_ids, loss_mask (1 on the tokens to learn: the assistant's), segment_ids [B, S]
    (0: padding); taps_BS3F the target's three tapped layers (frozen); embed(ids [B, S]) the
    target's (frozen, shared) embedding [B, S, H]; t2d_V `target_to_draft`. Step j (draft k = j + 1) has a label
    at row p when the token at p + 2 + j is in p's segment, on the loss mask and in the draft
    vocabulary; loss = sum(w * CE) / sum(w) over every step's labels, w = decay^j.
    metrics (each a sum over the batch's rows but the loss, as `make_train_step`'s gradient
    accumulation wants, and named as the DFlash loss names them): loss, weight_sum = sum(w),
    per draft k [steps + 1] (k = 0 unused) `correct_k`, `count_k` and `ce_sum_k`; `accept_sum`
    and `num_blocks`: over the rows whose first label exists, 1 + the number of leading steps
    whose argmax is its label (teacher forced), the acceptance length of a chain of `steps`
    drafts there."""
    ids, seg = batch["input_ids"], batch["segment_ids"]
    lmask = batch["loss_mask"].astype(bool)
    b, s = ids.shape
    positions = _positions(seg)
    embs = jnp.stack([embed(shifted(ids, 1 + j)) for j in range(steps)])
    logits = dmod.apply(
        {"params": dparams},
        taps_BS3F,
        embs,
        positions,
        ttt_mask(seg),
        ttt_attention,
        method="unrolled",
    )  # [J, B, S, Vd]
    t2d = jnp.asarray(t2d_V, jnp.int32)
    zero = jnp.zeros((), jnp.float32)
    correct, count, ce_sum = [zero], [zero], [zero]
    total, weight_sum, accept = zero, zero, zero
    first = still = None
    for j in range(steps):
        label = t2d[shifted(ids, 2 + j)]
        valid = (
            (shifted(seg, 2 + j) == seg)
            & (seg > 0)
            & shifted(lmask, 2 + j, False)
            & (label >= 0)
            & (jnp.arange(s)[None] + 2 + j < s)
        )
        lg = logits[j].astype(jnp.float32)
        picked = jnp.take_along_axis(lg, jnp.maximum(label, 0)[..., None], -1)[..., 0]
        ce = jnp.where(valid, jax.nn.logsumexp(lg, -1) - picked, 0.0)
        right = valid & (jnp.argmax(lg, -1) == label)
        w = float(decay) ** j
        n = jnp.sum(valid).astype(jnp.float32)
        total, weight_sum = total + w * jnp.sum(ce), weight_sum + w * n
        correct.append(jnp.sum(right).astype(jnp.float32))
        count.append(n)
        ce_sum.append(jnp.sum(ce))
        if j == 0:
            first, still = valid, right
        else:
            still = still & right
        accept = accept + jnp.sum(still).astype(jnp.float32)
    num_blocks = jnp.sum(first).astype(jnp.float32)
    loss = total / jnp.maximum(weight_sum, 1e-9)
    metrics = dict(
        loss=loss,
        weight_sum=weight_sum,
        correct_k=jnp.stack(correct),
        count_k=jnp.stack(count),
        ce_sum_k=jnp.stack(ce_sum),
        accept_sum=num_blocks + accept,
        num_blocks=num_blocks,
    )
    return loss, metrics


def _positions(segment_ids_BS):
    """Each row's position within its segment (packed sequences restart at 0)."""
    from dflash_jax.training.losses import _segment_starts

    idx = jnp.arange(segment_ids_BS.shape[1], dtype=jnp.int32)[None]
    return idx - _segment_starts(segment_ids_BS)


def label_counts(docs, tokenize_fn, vocab_size: int) -> np.ndarray:
    """int64 [V]: how often each target id is a label (on the loss mask) in the training docs:
    what the draft vocabulary is chosen from."""
    counts = np.zeros((vocab_size,), np.int64)
    for i in range(len(docs)):
        ids, mask = tokenize_fn(docs[i])[:2]
        ids = np.asarray(ids)[np.asarray(mask) > 0]
        counts += np.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
    return counts


def loss_fn_for(tmod, dmod, t2d_V, steps: int, decay):
    """loss_fn(params, frozen, batch, key) for the trainer: the frozen target's taps of the
    drafter's three layers (stopping at the last; `batch["taps"]` instead where the batch
    brings them), then `ttt_loss` (each packed document its own sequence, as the target sees
    it)."""

    tap_layers = dmod.cfg.tap_layers(tmod.cfg.num_layers)

    def loss_fn(params, frozen, batch, key):
        del key  # no random draws: every row drafts
        tvars = {"params": frozen}
        if "taps" in batch:  # kept from an earlier epoch (`tap_cache`)
            taps = batch["taps"]
        else:
            taps = tmod.apply(
                tvars,
                batch["input_ids"],
                tap_layers,
                segment_ids_BT=batch["segment_ids"],
                method="taps",
            )
        taps = jax.lax.stop_gradient(taps)

        def embed(ids):
            return jax.lax.stop_gradient(tmod.apply(tvars, ids, method="embed"))

        return ttt_loss(dmod, params, embed, taps, batch, t2d_V, steps, decay)

    return loss_fn
