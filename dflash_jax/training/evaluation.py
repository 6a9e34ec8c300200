"""Evaluation during training: held-out loss and per-position draft accuracy over the
experiment's eval batches, and tau with the real `generate` on its eval prompts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np

if TYPE_CHECKING:
    from dflash_jax.training.experiment import Experiment


def selector_figures(acc) -> dict:
    """DFlash 2's selector from summed step metrics: its accuracy where the label is among its
    candidates, how often it is (coverage), and its mean cross-entropy; {} for DFlash 1."""
    if "selector_covered" not in acc:
        return {}
    scored = max(float(np.sum(acc["count_k"])), 1.0)
    covered = max(float(acc["selector_covered"]), 1.0)
    return {
        "selector_acc": float(acc["selector_correct"]) / covered,
        "selector_coverage": float(acc["selector_covered"]) / scored,
        "selector_loss": float(acc["selector_loss_sum"]) / max(float(acc["weight_sum"]), 1e-9),
    }


def evaluate(exp: Experiment, params, eval_step, step: int, frozen=None, mesh=None) -> dict:
    """Held-out loss and per-position draft accuracy; tau with the real `generate` (on `mesh`
    when given). `frozen`: the target parameters as placed for training (default exp.frozen)."""
    frozen = exp.frozen if frozen is None else frozen
    out = {}
    if exp.eval_batches:
        acc = None
        for batch in exp.eval_batches:
            m = jax.device_get(eval_step(params, frozen, batch))
            acc = m if acc is None else jax.tree_util.tree_map(np.add, acc, m)
        n = len(exp.eval_batches)
        out["loss"] = float(acc["loss"]) / n
        if exp.mode == "drafter":
            per_k = acc["correct_k"] / np.maximum(acc["count_k"], 1)
            for k in range(1, len(per_k)):
                out[f"acc_k{k:02d}"] = float(per_k[k])
            out["block_accept_len"] = float(acc["accept_sum"] / max(acc["num_blocks"], 1))
            out.update(selector_figures(acc))
        else:
            out["accuracy"] = float(acc["correct"] / max(acc["weight_sum"], 1))
            out["perplexity"] = float(np.exp(min(out["loss"], 50.0)))
    if exp.mode == "drafter" and exp.eval_prompts:
        from dflash_jax.decoding.generation import generate

        res = generate(
            exp.target_for(params),
            exp.drafter_for(params),
            exp.eval_prompts,
            exp.config.eval_max_new_tokens,
            stop_token_ids=exp.stop_ids,
            mesh=mesh,
        )
        if res.stats["tau"] is not None:  # None: no decode step ran (eval_max_new_tokens 1)
            out["tau"] = float(res.stats["tau"])
    return out
