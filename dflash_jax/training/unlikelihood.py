"""Sequence-level unlikelihood against greedy loops (a remedy for a target's degenerate output).

A small language model trained by maximum likelihood alone often loops when decoded greedily:
once a phrase repeats, repeating it again becomes the most likely continuation. Welleck et al.
(2020, "Neural text generation with unlikelihood training") fine-tune with an extra term on the
model's *own* greedy continuations: every token that belongs to an n-gram already seen earlier
in the continuation is a negative candidate c, penalised by -log(1 - p(c | prefix)). Maximum
likelihood on real text continues alongside, so the model keeps what it knew.

Here, per training step (`trainer`, `unlikelihood.weight > 0` in target mode):

  1. `RepetitionSampler` decodes `batch_size` prompts from the training documents greedily with
     the current parameters (the project's compiled `generate`, one program for every step);
  2. `repeated_ngram_mask` marks the continuation tokens that complete or lie inside a repeated
     n-gram (prompt tokens are never marked: only what the model chose to repeat);
  3. `unlikelihood_loss` is the mean -log(1 - p) over the marked tokens, added to the
     next-token loss with weight `unlikelihood.weight`.

The share of marked continuation tokens (`rep_frac`) is logged each step: it is the loop rate
of the model being trained, measured on fresh prompts as it goes.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding.generation import generate
from dflash_jax.models.target import Target
from dflash_jax.models.transformer import Transformer


def repeated_ngram_mask(seq: Sequence[int], start: int, n: int) -> np.ndarray:
    """bool [len(seq)]: True at every position >= start inside an n-gram that lies wholly in
    seq[start:] and already occurred (starting earlier) in seq[start:]."""
    seq = list(map(int, seq))
    mask = np.zeros(len(seq), bool)
    seen = set()
    for i in range(start, len(seq) - n + 1):
        gram = tuple(seq[i : i + n])
        if gram in seen:
            mask[i : i + n] = True
        seen.add(gram)
    return mask


def build_batch(
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    length: int,
    n: int,
    pad_id: int = 0,
) -> Tuple[Dict[str, np.ndarray], float]:
    """Left-aligned prompt + continuation rows of `length` tokens and their negative-candidate
    mask. Returns ({"ul_ids", "ul_mask", "ul_segment_ids"} int32 [B, length], rep_frac): the
    share of continuation tokens marked."""
    b = len(prompts)
    ids = np.full((b, length), pad_id, np.int32)
    mask = np.zeros((b, length), np.int32)
    seg = np.zeros((b, length), np.int32)
    marked = total = 0
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        row = (list(p) + list(c))[:length]
        m = repeated_ngram_mask(row, min(len(p), len(row)), n)
        ids[i, : len(row)] = row
        mask[i, : len(row)] = m
        seg[i, : len(row)] = 1
        marked += int(m.sum())
        total += max(len(row) - len(p), 0)
    return ({"ul_ids": ids, "ul_mask": mask, "ul_segment_ids": seg}, marked / max(total, 1))


def unlikelihood_loss(tmod: Transformer, params, batch) -> Tuple[jnp.ndarray, Dict]:
    """Mean of -log(1 - p(x_t | x_<t)) over positions t with ul_mask[t] (0 when none)."""
    ids, mask, seg = batch["ul_ids"], batch["ul_mask"], batch["ul_segment_ids"]
    hidden, _, _ = tmod.apply({"params": params}, ids, segment_ids_BT=seg)
    logits = tmod.apply({"params": params}, hidden[:, :-1], method="logits")
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp_tok = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    one_minus_p = jnp.clip(-jnp.expm1(logp_tok), 1e-5, 1.0)
    w = (mask[:, 1:] > 0).astype(jnp.float32)
    count = jnp.sum(w)
    loss = jnp.sum(w * -jnp.log(one_minus_p)) / jnp.maximum(count, 1.0)
    p_marked = jnp.sum(w * jnp.exp(logp_tok)) / jnp.maximum(count, 1.0)
    return loss, {"ul_loss": loss, "ul_count": count, "ul_p": p_marked}


class RepetitionSampler:
    """Greedy continuations of a fixed pool of prompts under the current parameters, as
    unlikelihood batches. Step s uses pool entries s*B .. s*B+B-1 (mod the pool), so a resumed
    run sees the same prompts as an uninterrupted one."""

    def __init__(
        self,
        target_cfg,
        prompts: List[List[int]],
        *,
        batch_size: int,
        prompt_len: int,
        max_new_tokens: int,
        ngram: int,
        stop_ids: tuple = (),
        pad_id: int = 0,
    ):
        prompts = [list(p)[-prompt_len:] for p in prompts if len(p)]
        if len(prompts) < batch_size:
            raise ValueError(
                f"unlikelihood needs at least batch_size={batch_size} prompts from "
                f"the training documents, got {len(prompts)}"
            )
        self.target_cfg = target_cfg
        self.prompts = prompts
        self.batch_size = batch_size
        self.length = prompt_len + max_new_tokens
        self.max_new_tokens = max_new_tokens
        self.ngram = ngram
        self.stop_ids = tuple(stop_ids)
        self.pad_id = pad_id

    def __call__(self, params, step: int, mesh=None) -> Tuple[Dict[str, np.ndarray], float]:
        n = len(self.prompts)
        chunk = [self.prompts[(step * self.batch_size + j) % n] for j in range(self.batch_size)]
        res = generate(
            Target(self.target_cfg, params),
            None,
            chunk,
            self.max_new_tokens,
            stop_token_ids=self.stop_ids,
            mesh=mesh,
        )
        return build_batch(chunk, res.tokens, self.length, self.ngram, self.pad_id)


def combined_loss(
    tmod: Transformer, params, batch, weight: float, mle_loss_fn
) -> Tuple[jnp.ndarray, Dict]:
    """Next-token loss (`mle_loss_fn(tmod, params, batch)`) + weight x unlikelihood when the
    batch carries unlikelihood rows; metrics keep "loss" as the next-token loss alone."""
    loss, metrics = mle_loss_fn(tmod, params, batch)
    if weight <= 0 or "ul_ids" not in batch:
        return loss, metrics
    ul, ul_metrics = unlikelihood_loss(tmod, params, batch)
    return loss + weight * ul, {**metrics, **ul_metrics}
