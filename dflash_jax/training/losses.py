"""Training losses: the DFlash drafter objective and the target's next-token objective.

Both are pure functions `(params, frozen_params, batch, key) -> (loss, metrics)` over a batch
`{input_ids, loss_mask, segment_ids}` (int32 [B, S]); the trainer differentiates w.r.t. the
first argument only, so the target (its embedding and LM head included) stays frozen when the
drafter trains. The index arithmetic (anchors, mask, labels, weights) lives in `masks.py`.

Attention during drafter training: "xla" is `blockwise_training_attention` (the same mask as
`masks.training_mask`, segment-aware, without its dense [N*bs, S + N*bs] form; the dense
reference stays reachable as `training_attend(..., impl="xla_dense")`);
"pallas" / "pallas_interpret" call the fused `pallas_kernels.training_attention` with the same
mask: with packed rows each block's context window starts at the first position of its anchor's
document (`ctx_start`, from the segment ids), so no block sees an earlier document's features.
(This equals the segment mask because packed documents are contiguous runs of one segment id.)
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

import jax
import jax.numpy as jnp

from dflash_jax.drafters import registry
from dflash_jax.models import attention
from dflash_jax.models.layers import masked_attention
from dflash_jax.models.transformer import Transformer
from dflash_jax.training import masks


@dataclasses.dataclass(frozen=True)
class DrafterRecipe:
    """Static settings of the drafter objective (hashable: part of the jit key).

    loss: "ce" (hard same-position labels) or "kl" (distill the target: block position k gets
      the target's next-token distribution at position p+k-1, the one that predicts x_{p+k}),
      or "topk_kl" (the same from the top-k of that distribution that the batch brings from a
      tap store, renormalized over the drafter's vocabulary; CE on batches without it), or
      "topk_lk" (the negative log of the acceptance rate of sampled drafting against that
      distribution, -log sum_x min(p(x), q(x)) over its top-k; CE without it).
    mask_schedule: "all" (paper), "random" (partially revealed blocks, loss on masked only) or
      "mdlm" (fully masked blocks with probability mask_full_fraction, else masked-diffusion
      blocks at ratio t weighted 1/t: `masks.mask_draw`).
    loss_chunk_anchors: > 0 bounds the live logits to that many anchors' blocks (see
      `block_scores`); 0 computes all N*bs rows at once.
    """

    block_size: int
    mask_token_id: int
    tap_layers: Tuple[int, ...]
    num_anchors: int = 512
    gamma: float = 7.0
    loss: str = "ce"
    mask_schedule: str = "all"
    mask_full_fraction: float = 0.5  # "mdlm": the fraction of fully masked blocks
    attention_impl: str = "xla"
    use_segments: bool = True
    loss_chunk_anchors: int = 0  # > 0: logits for this many anchors at a time (block_scores)
    selector_weight: float = 1.0  # DFlash 2: the selector's cross-entropy weight in the loss
    anchors_per_row: int = (
        0  # blocks per packed row (static); 0: num_anchors (masks.sample_anchors)
    )
    # "decay": the recipe's exp(-(k-1)/gamma); "dpace": each position weighted by how much the
    # expected accepted length sum_m prod_{j<=m} a_j grows with its log-probability,
    # sum_{m>=k} prod_{j<=m} a_j, a_j = exp(-loss_j) held constant (`dpace_weights`)
    position_weights: str = "decay"
    loss_positions: int = 0  # > 0: only block positions 1..loss_positions are scored

    def __post_init__(self):
        if self.loss not in ("ce", "kl", "topk_kl", "topk_lk"):
            raise ValueError(f"loss must be 'ce', 'kl', 'topk_kl' or 'topk_lk', got {self.loss!r}")
        if self.position_weights not in ("decay", "dpace"):
            raise ValueError(
                f"position_weights must be 'decay' or 'dpace', got {self.position_weights!r}"
            )
        if self.mask_schedule not in masks.MASK_SCHEDULES:
            raise ValueError(
                f"mask_schedule must be one of {masks.MASK_SCHEDULES}, got {self.mask_schedule!r}"
            )
        if not 0.0 <= self.mask_full_fraction <= 1.0:
            raise ValueError(f"mask_full_fraction must be in [0, 1], got {self.mask_full_fraction}")
        if self.attention_impl not in ("xla", "pallas", "pallas_interpret"):
            raise ValueError(
                f"attention_impl must be xla, pallas or pallas_interpret, got "
                f"{self.attention_impl!r}"
            )


def blockwise_training_attention(
    q,
    k_blk,
    v_blk,
    ctx_k,
    ctx_v,
    anchors_BN,
    valid_BN,
    block_size: int,
    segment_ids_BS=None,
    chunk_anchors: int = 0,
    window=None,
    causal: bool = False,
):
    """`masks.training_mask` attention without the dense [N*bs, S + N*bs] mask: each block's
    queries score the S context keys (j < anchor, same document) and only their own bs block
    keys (the other N*bs - bs keys are masked anyway), `chunk_anchors` blocks at a time in a
    rematerialized `lax.map` (0: all at once). Invalid blocks give zeros. Values and gradients
    are those of the dense form. window: a sliding layer's (block position i at anchor + i sees
    context j when anchor + i - j < window and block position r when |i - r| < window); causal:
    block position i sees block positions r <= i only (DFlash 2's is_causal)."""
    b, rows, nh, d = q.shape
    n, bs, s = anchors_BN.shape[1], block_size, ctx_k.shape[1]
    kh = ctx_k.shape[2]
    g = nh // kh
    c = n if chunk_anchors <= 0 or chunk_anchors >= n else int(chunk_anchors)
    m = -(-n // c)
    pad = m * c - n
    seg = jnp.zeros((b, s), jnp.int32) if segment_ids_BS is None else segment_ids_BS[:, :s]
    anchor_seg = jnp.take_along_axis(seg, jnp.clip(anchors_BN, 0, s - 1), axis=1)

    def chunked(x):  # [B, N, ...] -> [m, B, c, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((b, m, c) + x.shape[2:]), 1, 0)

    def one(args):
        qc, kc, vc, anc, val, aseg = args  # [B,c,bs,N,D], [B,c,bs,K,D] x2, [B,c] x3
        qc = qc.reshape(b, c, bs, kh, g, d)
        ctx_ok = (
            (jnp.arange(s)[None, None] < anc[:, :, None])
            & (seg[:, None] == aseg[:, :, None])
            & val[:, :, None]
        )[:, :, None, :]  # [B,c,1,S]
        blk_ok = None
        i = jnp.arange(bs)
        if window is not None:
            qpos = anc[:, :, None] + i[None, None]  # [B,c,bs]
            ctx_ok = ctx_ok & (qpos[..., None] - jnp.arange(s)[None, None, None] < window)
            if window < bs:
                blk_ok = jnp.abs(i[:, None] - i[None, :]) < window  # [bs,bs]
        if causal:
            tri = i[None, :] <= i[:, None]
            blk_ok = tri if blk_ok is None else blk_ok & tri
        lc = (
            jnp.einsum("bcqkgd,bskd->bckgqs", qc, ctx_k, preferred_element_type=jnp.float32)
            * d**-0.5
        )
        lb = (
            jnp.einsum(
                "bcqkgd,bcrkd->bckgqr",
                qc,
                kc.astype(ctx_k.dtype),
                preferred_element_type=jnp.float32,
            )
            * d**-0.5
        )
        neg = jnp.float32(-0.7 * float(jnp.finfo(jnp.float32).max))
        ok = ctx_ok[:, :, None, None]  # [B,c,1,1,bs|1,S] against [B,c,K,g,bs,S]
        lc = jnp.where(ok, lc, neg)
        if blk_ok is not None:
            lb = jnp.where(blk_ok, lb, neg)
        mx = jnp.maximum(jnp.max(lc, -1, keepdims=True), jnp.max(lb, -1, keepdims=True))
        pc, pb = jnp.exp(lc - mx), jnp.exp(lb - mx)
        pc = jnp.where(ok, pc, 0.0)
        if blk_ok is not None:
            pb = jnp.where(blk_ok, pb, 0.0)
        z = jnp.sum(pc, -1, keepdims=True) + jnp.sum(pb, -1, keepdims=True)
        pc, pb = (pc / z).astype(ctx_v.dtype), (pb / z).astype(ctx_v.dtype)
        out = jnp.einsum(
            "bckgqs,bskd->bcqkgd", pc, ctx_v, preferred_element_type=jnp.float32
        ) + jnp.einsum(
            "bckgqr,bcrkd->bcqkgd", pb, vc.astype(ctx_v.dtype), preferred_element_type=jnp.float32
        )
        out = jnp.where(val[:, :, None, None, None, None], out, 0.0)
        return out.reshape(b, c, bs, nh, d).astype(q.dtype)

    xs = (
        chunked(q.reshape(b, n, bs, nh, d)),
        chunked(k_blk.reshape(b, n, bs, kh, d)),
        chunked(v_blk.reshape(b, n, bs, kh, d)),
        chunked(anchors_BN),
        chunked(valid_BN),
        chunked(anchor_seg),
    )
    if m == 1:
        out = one(tuple(x[0] for x in xs))[None]
    else:
        out = jax.lax.map(jax.checkpoint(one), xs)
    return jnp.moveaxis(out, 0, 1).reshape(b, m * c * bs, nh, d)[:, :rows]


def training_attend(
    anchors_BN,
    valid_BN,
    block_size: int,
    ctx_len: int,
    segment_ids_BS=None,
    impl: str = "xla",
    chunk_anchors: int = 0,
):
    """An `attend(q, k_blk, v_blk, ctx_k, ctx_v, window=None)` for `DFlashDrafter`
    implementing `masks.training_mask` over N blocks of `block_size` query rows ("xla":
    blockwise, see `blockwise_training_attention`, `chunk_anchors` blocks at a time). A
    sliding layer (window) runs the blockwise form under every impl (the Pallas kernel masks
    by anchor, not by query position)."""

    def blockwise(q, k, v, ctx_k, ctx_v, window=None, causal=False):
        return blockwise_training_attention(
            q,
            k,
            v,
            ctx_k,
            ctx_v,
            anchors_BN,
            valid_BN,
            block_size,
            segment_ids_BS,
            chunk_anchors,
            window,
            causal,
        )

    if impl == "xla":
        return blockwise

    if impl == "xla_dense":

        def attend(q, k, v, ctx_k, ctx_v, window=None, causal=False):
            mask = masks.training_mask(
                anchors_BN,
                valid_BN,
                block_size,
                ctx_len,
                segment_ids_BS,
                window=window,
                causal=causal,
            )
            return masked_attention(
                q,
                jnp.concatenate([ctx_k, k.astype(ctx_k.dtype)], 1),
                jnp.concatenate([ctx_v, v.astype(ctx_v.dtype)], 1),
                mask,
            )

        return attend

    ctx_start = None
    if segment_ids_BS is not None:
        ctx_start = jnp.take_along_axis(
            _segment_starts(segment_ids_BS[:, :ctx_len]),
            jnp.clip(anchors_BN, 0, ctx_len - 1),
            axis=1,
        )

    def attend(
        q, k, v, ctx_k, ctx_v, window=None, causal=False
    ):  # per shard: GSPMD cannot split it
        if window is not None or causal:
            return blockwise(q, k, v, ctx_k, ctx_v, window, causal)
        return attention.training_attention(
            q, ctx_k, ctx_v, k, v, anchors_BN, valid_BN, block_size, ctx_start, impl
        )

    return attend


def _segment_starts(segment_ids_BS):
    """[B,S] int32: index of the first position of each position's segment run (a cumulative
    max over the positions where the segment id changes)."""
    pos = jnp.arange(segment_ids_BS.shape[1], dtype=jnp.int32)[None]
    boundary = jnp.concatenate(
        [
            jnp.ones_like(segment_ids_BS[:, :1], bool),
            segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1],
        ],
        axis=1,
    )
    return jax.lax.cummax(jnp.where(boundary, pos, 0), axis=1)


def block_scores(
    tmod: Transformer,
    tparams,
    hidden_BNKH,
    labels_BNK,
    t_hidden_BNKH=None,
    loss: str = "ce",
    chunk_anchors: int = 0,
    adjust=None,
    selector=None,
    prev_BNK=None,
    rows=None,
    soft=None,
):
    """Per block position: the loss term ([B,N,bs] f32: CE against the label, or KL(target ||
    drafter) from the target's hidden states at the teacher positions) and whether the drafter's
    argmax equals the label ([B,N,bs] bool).

    DFlash 2: `adjust(logits)` gives the drafter's logits (scaled, capped) from the LM head's,
    and `selector(h, logits, labels, prev)` its selector terms (`DFlashDrafter.selector_terms`,
    `prev_BNK` the true previous tokens); then a third value (ce, correct, covered) [B,N,bs].

    The [B, N*bs, V] logits dominate training memory at real sizes (512 anchors x 16 x 151,936
    float32 is 5 GB per sequence, twice with "kl"). chunk_anchors > 0 computes them for that many
    anchors at a time in a `lax.map` whose body is rematerialized in the backward pass, so only
    one chunk's logits are ever live; the values and gradients are those of the one-shot form.

    `rows` (int32 [K]): the drafter's draft vocabulary, its logits only those rows of the head
    (labels, and `soft` ids, are then draft-vocabulary indices). `soft` = (ids [B,N,bs,k],
    probs [B,N,bs,k]): soft labels, the loss their cross-entropy against the drafter.
    """
    tvars = {"params": tparams}

    def scores(h, lab, th, prev, sft=None):
        c, k = h.shape[1], h.shape[2]
        flat = h.reshape(h.shape[0], c * k, -1)
        if rows is None:
            logits = tmod.apply(tvars, flat, method="logits")
        else:
            logits = tmod.apply(tvars, flat, rows, method="logits")
        if adjust is not None:
            logits = adjust(logits)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(h.shape[0], c, k, -1)
        if sft is not None:
            s_ids, s_p = sft
            lq = jnp.take_along_axis(logp, s_ids, axis=-1)
            if loss == "topk_lk":  # -log of sum_x min(p, q): the sampled acceptance rate
                per_pos = -jnp.log(jnp.sum(jnp.minimum(s_p, jnp.exp(lq)), axis=-1) + 1e-6)
            else:
                per_pos = -jnp.sum(s_p * lq, axis=-1)
        elif th is None:
            per_pos = -jnp.take_along_axis(logp, lab[..., None], axis=-1)[..., 0]
        else:
            t_logits = tmod.apply(tvars, th.reshape(h.shape[0], c * k, -1), method="logits")
            t_logp = jax.nn.log_softmax(t_logits.astype(jnp.float32), axis=-1).reshape(logp.shape)
            per_pos = jnp.sum(jnp.exp(t_logp) * (t_logp - logp), axis=-1)
        out = (per_pos, jnp.argmax(logp, axis=-1) == lab)
        if selector is not None:
            # log-probabilities as the unary term: the logits less a per-slot constant, which
            # the softmax over a slot's candidates does not see
            out += (selector(h, logp, lab, prev),)
        return out

    if loss == "ce":
        t_hidden_BNKH = None
    b, n = labels_BNK.shape[:2]
    if chunk_anchors <= 0 or chunk_anchors >= n:
        return scores(hidden_BNKH, labels_BNK, t_hidden_BNKH, prev_BNK, soft)

    m = -(-n // chunk_anchors)
    pad = m * chunk_anchors - n

    def chunked(x):  # [B, N, ...] -> [m, B, chunk, ...] (padding rows are dropped afterwards)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((b, m, chunk_anchors) + x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    xs = (
        chunked(hidden_BNKH),
        chunked(labels_BNK),
        None if t_hidden_BNKH is None else chunked(t_hidden_BNKH),
        None if prev_BNK is None else chunked(prev_BNK),
        None if soft is None else tuple(chunked(x) for x in soft),
    )
    out = jax.lax.map(jax.checkpoint(lambda a: scores(*a)), xs)

    def unchunked(y):  # [m, B, chunk, bs] -> [B, N, bs]
        return jnp.moveaxis(y, 0, 1).reshape((b, m * chunk_anchors) + y.shape[3:])[:, :n]

    return jax.tree_util.tree_map(unchunked, out)


def row_keys(key, batch_size: int):
    """One random key per batch row: `key` itself when it already is one per row ([B] typed
    keys or [B, 2] raw ones), else `jax.random.split(key, batch_size)`. A loss that draws each
    row's randomness from its row's key draws the same for a row wherever that row is in the
    batch: `make_train_step` hands each micro-batch the slice of the full batch's row keys, so
    gradient accumulation changes nothing but memory."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if key.ndim == (0 if typed else 1):
        return jax.random.split(key, batch_size)
    if key.shape[0] != batch_size:
        raise ValueError(f"{key.shape[0]} row keys for a batch of {batch_size} rows")
    return key


def drafter_draws(recipe: DrafterRecipe, loss_mask_BS, segment_ids_BS, keys_B):
    """The objective's random draws, row by row from the row keys `keys_B`: (anchors [B,N],
    block_valid [B,N], masked [B,N,bs], scale [B,N,1]) as `masks.sample_anchors` /
    `masks.mask_draw` draw them for one row."""
    bs = recipe.block_size

    def one(key, lm, seg):
        k_anchor, k_mask = jax.random.split(key)
        anchors, valid = masks.sample_anchors(
            k_anchor,
            lm[None],
            recipe.num_anchors,
            bs,
            None if seg is None else seg[None],
            recipe.anchors_per_row,
        )
        masked, scale = masks.mask_draw(
            k_mask, (1, anchors.shape[1]), bs, recipe.mask_schedule, recipe.mask_full_fraction
        )
        return anchors[0], valid[0], masked[0], scale[0]

    if segment_ids_BS is None:
        return jax.vmap(lambda k, lm: one(k, lm, None))(keys_B, loss_mask_BS)
    return jax.vmap(one)(keys_B, loss_mask_BS, segment_ids_BS)


def drafter_loss(
    tmod: Transformer,
    dmod,
    recipe: DrafterRecipe,
    dparams,
    tparams,
    batch,
    key,
    draft_vocab=None,
):
    """The DFlash objective for one batch. Returns (loss, metrics).

    One frozen target forward gives the taps (and, for "kl", the teacher logits); random anchors
    open N blocks per row (drawn per row from `row_keys(key, B)`: `key` is one key, or one per
    row); the drafter predicts every block position at once under the training
    mask; loss = sum(w * CE) / sum(w) with the weights of `masks.loss_weights`.
    metrics: loss, weight_sum, per-position `correct_k` / `count_k` [bs] (k = 0 unused) and
    `accept_sum` (sum over valid blocks of the acceptance length the block would get: 1 + the
    length of the correct prefix of k = 1..bs-1), `num_blocks`.

    `draft_vocab` (int32 [K], a constant): the head restricted to those rows of the target's;
    a label outside them weighs 0 (and is never "correct"), soft labels keep their mass inside.
    The batch may bring "taps" (a tap cache or store: no target pass) and, for "topk_kl",
    "topk_ids" / "topk_logp" [B,S,k] (the target's top-k next-token distribution).
    """
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    seg = batch["segment_ids"] if recipe.use_segments else None
    b, s = ids.shape
    bs = recipe.block_size
    tvars = {"params": tparams}

    hidden_t, taps = _target_pass(tmod, tvars, recipe, batch)

    anchors, valid, masked, scale = drafter_draws(recipe, loss_mask, seg, row_keys(key, b))
    n = anchors.shape[1]
    tokens = masks.block_inputs(ids, anchors, bs, recipe.mask_token_id, masked)
    labels = masks.block_labels(ids, anchors, bs)
    weights = masks.loss_weights(
        anchors,
        valid,
        loss_mask,
        bs,
        recipe.gamma,
        seg,
        None if recipe.mask_schedule == "all" else masked,
        scale if recipe.mask_schedule == "mdlm" else None,
    )

    rows = t2d = soft = None
    if draft_vocab is not None:  # labels as draft-vocabulary indices; outside it: weight 0
        rows = jnp.asarray(draft_vocab, jnp.int32)
        t2d = (
            jnp.full((tmod.cfg.vocab_size,), -1, jnp.int32)
            .at[rows]
            .set(jnp.arange(rows.shape[0], dtype=jnp.int32))
        )
        labels_d = t2d[labels]
        weights = weights * (labels_d >= 0)
        labels = jnp.maximum(labels_d, 0)
    if recipe.loss.startswith("topk_") and "topk_ids" in batch:
        soft = _soft_labels(batch, anchors, bs, s, t2d)

    emb = jax.lax.stop_gradient(tmod.apply(tvars, tokens.reshape(b, n * bs), method="embed"))
    positions = masks.block_positions(anchors, bs).reshape(b, n * bs)
    ctx_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    ctx_k, ctx_v = dmod.apply({"params": dparams}, taps, ctx_pos, method="context_kv")
    attend = training_attend(
        anchors, valid, bs, s, seg, recipe.attention_impl, chunk_anchors=recipe.loss_chunk_anchors
    )
    hidden = dmod.apply({"params": dparams}, emb, positions, ctx_k, ctx_v, attend, bs)
    scored_out = _block_scores(
        tmod, tparams, dmod, dparams, recipe, hidden, hidden_t, labels, anchors, rows, soft
    )
    per_pos, correct = scored_out[:2]
    if recipe.loss_positions > 0:
        k = jnp.arange(bs)
        weights = weights * (k <= recipe.loss_positions)[None, None]
    if recipe.position_weights == "dpace":
        weights = dpace_weights(per_pos, weights)

    selector_out = scored_out[2] if dmod.cfg.dflash2 else None
    return _loss_and_metrics(recipe, weights, per_pos, correct, valid, selector_out)


def _block_scores(
    tmod, tparams, dmod, dparams, recipe, hidden, hidden_t, labels, anchors, rows, soft
):
    """`block_scores` of the drafter's block hidden states [B, N*bs, H]: against the labels,
    the target's distribution ("kl": its hidden states at p+k-1, the soft label of block
    position k, gathered before the LM head so only N*bs rows of logits exist; k = 0 has
    weight 0 and reads position p-1 clipped, harmlessly), or the soft labels ("topk_*"); with
    the drafter's logit rule and DFlash 2's selector terms (the true previous token as each
    slot's predecessor)."""
    b, n = anchors.shape
    bs = recipe.block_size
    t_hidden = None
    if recipe.loss == "kl":
        src = masks.teacher_positions(anchors, bs, hidden_t.shape[1]).reshape(b, n * bs)
        t_hidden = jax.lax.stop_gradient(
            jnp.take_along_axis(hidden_t, src[..., None], axis=1)
        ).reshape(b, n, bs, -1)
    dflash2 = dmod.cfg.dflash2
    selector = prev = None
    if dflash2:
        prev = jnp.concatenate([labels[..., :1], labels[..., :-1]], axis=-1)
        selector = lambda h, logits, lab, pv: dmod.apply(
            {"params": dparams}, h, logits, lab, pv, method="selector_terms"
        )
    return block_scores(
        tmod,
        tparams,
        hidden.reshape(b, n, bs, -1),
        labels,
        t_hidden,
        recipe.loss,
        recipe.loss_chunk_anchors,
        adjust=(
            (lambda lg: registry.of(dmod).logits(dmod.cfg, lg))
            if dflash2 or dmod.cfg.scales_logits
            else None
        ),
        selector=selector,
        prev_BNK=prev,
        rows=rows,
        soft=soft,
    )


def _target_pass(tmod, tvars, recipe, batch):
    """(the target's final hidden states or None, its taps): "ce" needs only the taps, so the
    target stops at the last tapped layer, with chunked causal attention (no [B, N, S, S]
    scores), or none runs when the batch brings them (kept from an earlier epoch:
    `tap_cache`); "kl" needs the final hidden states: a full forward."""
    ids = batch["input_ids"]
    if recipe.loss != "kl" and "taps" in batch:
        hidden_t, taps = None, batch["taps"]
    elif recipe.loss != "kl":
        hidden_t = None
        taps = tmod.apply(
            tvars,
            ids,
            recipe.tap_layers,
            segment_ids_BT=batch["segment_ids"],
            method="taps",
        )
    else:
        hidden_t, _, taps = tmod.apply(
            tvars, ids, segment_ids_BT=batch["segment_ids"], tap_layers=recipe.tap_layers
        )
    return hidden_t, jax.lax.stop_gradient(taps)


def _soft_labels(batch, anchors, bs, s, t2d=None):
    """(ids, probabilities) [B, N, bs, k]: the soft label of block position k, the target's
    top-k at p+k-1 (`masks.teacher_positions`) from the batch's "topk_ids" / "topk_logp",
    mapped into the draft vocabulary by `t2d` (ids outside it: probability 0), renormalized."""
    b, n = anchors.shape
    src = masks.teacher_positions(anchors, bs, s).reshape(b, n * bs)
    take = lambda x: jnp.take_along_axis(x, src[..., None], axis=1).reshape(b, n, bs, -1)
    s_ids, s_p = take(batch["topk_ids"]), jnp.exp(take(batch["topk_logp"]))
    if t2d is not None:
        s_d = t2d[s_ids]
        s_p, s_ids = jnp.where(s_d >= 0, s_p, 0.0), jnp.maximum(s_d, 0)
    s_p = s_p / jnp.maximum(jnp.sum(s_p, axis=-1, keepdims=True), 1e-9)
    return s_ids, jax.lax.stop_gradient(s_p)


def _loss_and_metrics(recipe, weights, per_pos, correct, valid, selector_out=None):
    """(loss, metrics) of `drafter_loss` from the weighted per-position losses (and DFlash 2's
    selector terms: `selector_out`)."""
    weight_sum = jnp.sum(weights)
    total = jnp.sum(weights * per_pos)
    extra = {}
    if selector_out is not None:
        sel_ce, sel_correct, covered = selector_out
        sel_sum = jnp.sum(weights * sel_ce)
        total = total + recipe.selector_weight * sel_sum
        on = weights > 0
        extra = {
            "selector_loss_sum": sel_sum.astype(jnp.float32),
            "selector_correct": jnp.sum(sel_correct & on).astype(jnp.float32),
            "selector_covered": jnp.sum(covered & on).astype(jnp.float32),
        }
    loss = total / jnp.maximum(weight_sum, 1e-9)

    scored = weights > 0
    # Acceptance length of each block if it were drafted: 1 + correct prefix of k >= 1, where a
    # position that is not scored (past the end, prompt) stops the prefix.
    prefix = jnp.cumprod((correct & scored)[..., 1:].astype(jnp.int32), axis=-1)
    metrics = {
        "loss": loss,
        "weight_sum": weight_sum,
        "correct_k": jnp.sum(correct & scored, axis=(0, 1)).astype(jnp.float32),
        "count_k": jnp.sum(scored, axis=(0, 1)).astype(jnp.float32),
        "accept_sum": jnp.sum((1 + jnp.sum(prefix, axis=-1)) * valid).astype(jnp.float32),
        "num_blocks": jnp.sum(valid).astype(jnp.float32),
        **extra,
    }
    return loss, metrics


def dpace_weights(per_pos_BNK, weights_BNK):
    """Position weights from the expected accepted length of each block (D-PACE's idea; the
    rule here is this module's): with a_k = exp(-loss_k) the drafter's chance at position k
    (0 where the position is not scored, which ends the block), E[L] = sum_m prod_{j<=m} a_j
    and d E[L] / d log a_k = sum_{m>=k} prod_{j<=m} a_j, held constant (no gradient). Weights
    keep the input's zeros; a block's weights fall where its earlier positions are unlikely,
    so while the drafter is weak the loss sits on its first positions."""
    scored = weights_BNK > 0
    a = jnp.where(scored, jnp.exp(-jax.lax.stop_gradient(per_pos_BNK)), 0.0)
    a = a.at[..., 0].set(1.0)  # k = 0 holds the real token: not drafted
    prefix = jnp.cumprod(a, axis=-1)
    tail = jnp.flip(jnp.cumsum(jnp.flip(prefix, -1), axis=-1), -1)
    return jnp.where(scored, tail, 0.0)


def target_loss(tmod: Transformer, params, batch):
    """Next-token cross-entropy of a target: position t predicts x_{t+1} when loss_mask[t+1]
    and both are in the same (non-padding) segment. Returns (loss, metrics)."""
    ids, loss_mask, seg = batch["input_ids"], batch["loss_mask"], batch["segment_ids"]
    hidden, _, _ = tmod.apply({"params": params}, ids, segment_ids_BT=seg)
    logits = tmod.apply({"params": params}, hidden[:, :-1], method="logits")
    logp = jax.nn.log_softmax(logits, axis=-1)
    labels = ids[:, 1:]
    w = ((loss_mask[:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).astype(
        jnp.float32
    )
    ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    weight_sum = jnp.sum(w)
    loss = jnp.sum(w * ce) / jnp.maximum(weight_sum, 1e-9)
    correct = jnp.sum(w * (jnp.argmax(logits, -1) == labels))
    return loss, {"loss": loss, "weight_sum": weight_sum, "correct": correct}
