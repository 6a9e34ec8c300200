"""The DFlash training recipe's index arithmetic, in one place (../../shared/docs/dflash.md).

Per sequence of length S, with N = num_anchors blocks of bs = block_size positions:

  anchors      p_n: distinct positions p <= S - 2 with loss_mask[p] == loss_mask[p+1] == 1,
               up to num_anchors per document (per packed segment), sampled uniformly
               without replacement; blocks beyond the chosen count are invalid. Blocks may run
               past the end: labels beyond S (or the document) get weight 0.
  block input  position k of block n holds x_{p_n} at k = 0 and MASK at k >= 1 (the
               "random" and "mdlm" schedules keep some real tokens x_{p_n+k} at k >= 1
               instead: `mask_draw`);
               block positions are p_n .. p_n + bs - 1.
  mask         `training_mask`: block n sees context positions j < p_n (STRICTLY less, and in
               the anchor's document when rows are packed) and all bs keys of its own block;
               nothing of other blocks; invalid blocks see nothing.
  labels       `block_labels`: block position k predicts x_{p_n + k} (same position, no shift).
  weights      `loss_weights`: w_k = exp(-(k - 1) / gamma) for k >= 1, 0 at k = 0, times
               loss_mask[p+k], in-bounds (p + k < S, same document), block valid, and (random
               and mdlm schedules) the position being masked; "mdlm" also multiplies a
               partially masked block's weights by 1 / max(t, 1/(bs-1)) (`mask_draw`).

Packed rows (segment_ids): the target forward is segment-masked, so every tap belongs to one
document; `training_mask` additionally hides context of other documents from a block, and
`loss_weights` zeroes labels that fall in another document. (The fused Pallas training kernel gets
the same lower bound as `ctx_start`, the first position of the anchor's document: `losses.py`.)
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

# The one training mask lives with the fused kernels it checks (the library imports the kernel
# package, never the reverse).
from pallas_kernels.reference import training_mask  # noqa: F401


def sample_anchors(
    key,
    loss_mask_BS,
    num_anchors: int,
    block_size: int,
    segment_ids_BS: Optional[jnp.ndarray] = None,
    anchors_per_row: int = 0,
):
    """Random anchors as SpecForge samples them: (anchors [B,N] int32, block_valid [B,N] bool).

    Eligible: p <= S - 2 with loss_mask[p] == 1 and loss_mask[p+1] == 1 (and, with segment ids,
    p + 1 in p's document). Blocks may run past the end of the sequence (their out-of-range
    labels get weight 0 in `loss_weights`), so `block_size` does not restrict anchors.

    Budget per SEQUENCE: every document (a segment of a packed row; the whole row without
    segment ids) gets up to `num_anchors` distinct eligible positions, uniformly without
    replacement. The row holds N = min(anchors_per_row or num_anchors, S - 1) blocks (a static
    shape); when its documents' anchors exceed N, N of them are kept uniformly at random.
    Missing blocks are invalid (anchor 0, valid False). Valid anchors come first, ascending.
    """
    del block_size  # blocks past the end are masked, not avoided
    b, s = loss_mask_BS.shape
    n = max(1, min(int(anchors_per_row) or int(num_anchors), s - 1))
    lm = loss_mask_BS > 0
    nxt = jnp.concatenate([lm[:, 1:], jnp.zeros_like(lm[:, :1])], axis=1)  # p = S-1: no p+1
    eligible = lm & nxt
    seg = jnp.zeros((b, s), jnp.int32) if segment_ids_BS is None else segment_ids_BS
    if segment_ids_BS is not None:
        eligible &= jnp.concatenate(
            [seg[:, 1:] == seg[:, :-1], jnp.zeros_like(eligible[:, :1])], axis=1
        )
    k_doc, k_row = jax.random.split(key)
    # Rank of each eligible position among its document's, by an i.i.d. uniform score: sort by
    # (segment, score), rank = sorted index - first sorted index of that segment.
    u = jax.random.uniform(k_doc, (b, s))
    sort_key = jnp.where(eligible, seg.astype(jnp.float32) * 2.0 + u, jnp.inf)
    order = jnp.argsort(sort_key, axis=1)
    seg_sorted = jnp.take_along_axis(seg, order, axis=1)
    idx = jnp.arange(s, dtype=jnp.int32)[None]
    first = jax.lax.cummax(
        jnp.where(
            jnp.concatenate([jnp.ones((b, 1), bool), seg_sorted[:, 1:] != seg_sorted[:, :-1]], 1),
            idx,
            0,
        ),
        axis=1,
    )
    rank = jnp.zeros((b, s), jnp.int32).at[jnp.arange(b)[:, None], order].set(idx - first)
    chosen = eligible & (rank < num_anchors)
    # The row's N blocks: N of the chosen, uniformly (an independent score).
    score = jnp.where(chosen, 1.0 + jax.random.uniform(k_row, (b, s)), 0.0)
    top, pick = jax.lax.top_k(score, n)
    valid = top > 0.0
    order = jnp.argsort(jnp.where(valid, pick, s + pick), axis=1)
    pick = jnp.take_along_axis(pick, order, axis=1)
    valid = jnp.take_along_axis(valid, order, axis=1)
    return jnp.where(valid, pick, 0).astype(jnp.int32), valid


def block_positions(anchors_BN, block_size: int):
    """[B,N,bs] absolute positions p_n + k."""
    return anchors_BN[:, :, None] + jnp.arange(block_size, dtype=jnp.int32)[None, None]


def teacher_positions(anchors_BN, block_size: int, seq_len: int | None = None):
    """[B,N,bs] positions p+k-1 whose target next-token distribution is the soft label of block
    position k ("kl" loss): the target's logits at p+k-1 predict x_{p+k}. Clipped at 0 (k = 0 of
    an anchor at 0 has weight 0 anyway) and, given `seq_len`, at seq_len - 1: a block may run
    past the end of the row, and those positions have weight 0 (an out-of-range gather would
    read NaN, and NaN * 0 is NaN)."""
    pos = jnp.maximum(block_positions(anchors_BN, block_size) - 1, 0)
    return pos if seq_len is None else jnp.minimum(pos, seq_len - 1)


def _gather_rows(x_BS, idx_BNK):
    """x[b, clip(idx)] for idx [B,N,K]."""
    b, n, k = idx_BNK.shape
    flat = jnp.clip(idx_BNK, 0, x_BS.shape[1] - 1).reshape(b, n * k)
    return jnp.take_along_axis(x_BS, flat, axis=1).reshape(b, n, k)


def block_labels(input_ids_BS, anchors_BN, block_size: int):
    """[B,N,bs]: block position k predicts x_{p+k} (same position, NO shift); clipped in range."""
    return _gather_rows(input_ids_BS, block_positions(anchors_BN, block_size))


MASK_SCHEDULES = ("all", "random", "mdlm")


def mask_draw(key, shape_BN, block_size: int, schedule: str = "all", full_fraction: float = 0.5):
    """(masked [B,N,bs] bool, True where the block input is MASK; scale [B,N,1] float32, the
    block's loss-weight factor). k = 0 is never masked.

    "all": every k >= 1 (DFlash, the paper's default), scale 1.
    "random": per block a ratio r ~ U(0,1] and each k >= 1 masked with probability r, at least
      one masked position (one k ~ U{1..bs-1} forced); scale 1.
    "mdlm": the masked-diffusion language-model objective mixed with today's blocks. A block is
      fully masked with probability `full_fraction` (scale 1, exactly the "all" block); otherwise
      its ratio t ~ U(0,1], each k >= 1 masked with probability t, one k ~ U{1..bs-1} forced,
      and scale 1 / max(t, 1/(bs-1)): the 1/t weight of the MDLM / LLaDA ELBO, clamped at the
      smallest ratio a block can have (one masked position of bs - 1), since E[1/t] diverges.
      A block masked at ratio t has 1 + (bs-2) t masked positions in expectation, so its weight
      mass is about (bs-1) t / t = bs - 1, a fully masked block's, plus the forced position's
      share (in all 1.15 (bs - 1) at block 16): the mixture's two halves weigh about alike.
    """
    b, n = shape_BN
    k = jnp.arange(block_size)[None, None]
    full = jnp.broadcast_to(k >= 1, (b, n, block_size))
    one = jnp.ones((b, n, 1), jnp.float32)
    if schedule == "all":
        return full, one
    if schedule not in MASK_SCHEDULES:
        raise ValueError(f"mask_schedule must be one of {MASK_SCHEDULES}, got {schedule!r}")
    k_ratio, k_pos, k_force, k_full = jax.random.split(key, 4)
    ratio = 1.0 - jax.random.uniform(k_ratio, (b, n, 1))  # (0, 1]
    masked = (jax.random.uniform(k_pos, (b, n, block_size)) < ratio) & (k >= 1)
    force = 1 + jax.random.randint(k_force, (b, n, 1), 0, block_size - 1)
    masked = masked | (k == force)
    if schedule == "random":
        return masked, one
    is_full = jax.random.uniform(k_full, (b, n, 1)) < full_fraction
    scale = 1.0 / jnp.maximum(ratio, 1.0 / (block_size - 1))
    return jnp.where(is_full, full, masked), jnp.where(is_full, 1.0, scale).astype(jnp.float32)


def mask_pattern(key, shape_BN, block_size: int, schedule: str = "all", full_fraction: float = 0.5):
    """[B,N,bs] bool, True where the block input is MASK: the `masked` of `mask_draw`."""
    return mask_draw(key, shape_BN, block_size, schedule, full_fraction)[0]


def block_inputs(input_ids_BS, anchors_BN, block_size: int, mask_token_id: int, masked_BNK=None):
    """[B,N,bs] block tokens: x_p at k = 0, MASK where masked (default: every k >= 1), else the
    real token x_{p+k}."""
    labels = block_labels(input_ids_BS, anchors_BN, block_size)
    if masked_BNK is None:
        masked_BNK = jnp.arange(block_size)[None, None] >= 1
    return jnp.where(masked_BNK, jnp.int32(mask_token_id), labels)


def loss_weights(
    anchors_BN,
    block_valid_BN,
    loss_mask_BS,
    block_size: int,
    gamma: float,
    segment_ids_BS: Optional[jnp.ndarray] = None,
    masked_BNK=None,
    scale_BN1=None,
):
    """[B,N,bs] float32 weights of the same-position labels `block_labels`.

    w[b,n,k] = exp(-(k-1)/gamma) if k >= 1 else 0,
               times loss_mask[p+k], times (p+k < S), times block_valid[b,n],
               times (segment[p+k] == segment[p]) with segment ids,
               times masked[b,n,k] when a mask pattern is given (no loss on revealed tokens),
               times scale[b,n] when given (the "mdlm" schedule's 1/t, `mask_draw`).
    """
    s = loss_mask_BS.shape[1]
    k = jnp.arange(block_size, dtype=jnp.float32)
    decay = jnp.where(k >= 1, jnp.exp(-(k - 1.0) / gamma), 0.0)[None, None]
    pos = block_positions(anchors_BN, block_size)
    ok = (pos < s) & block_valid_BN[:, :, None] & (_gather_rows(loss_mask_BS, pos) > 0)
    if segment_ids_BS is not None:
        anchor_seg = jnp.take_along_axis(segment_ids_BS, anchors_BN, axis=1)
        ok &= _gather_rows(segment_ids_BS, pos) == anchor_seg[:, :, None]
    if masked_BNK is not None:
        ok &= masked_BNK
    w = decay * ok.astype(jnp.float32)
    return w if scale_BN1 is None else w * scale_BN1
