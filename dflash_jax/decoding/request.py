"""The host side of `decoding.generate`: every argument checked before any compute, and the
decode state read back into a `GenerationResult` (also across the processes of a pod)."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import jax
import numpy as np

from dflash_jax.drafters.dflash import validate_pair
from dflash_jax.support import checks
from dflash_jax.support.checks import DENOISE_SCHEDULES, check_denoise  # noqa: F401 (re-exported)


@dataclasses.dataclass
class GenerationResult:
    """tokens: per sequence, the new token ids (prompt excluded, truncated after a stop token).
    acceptance_lengths: per sequence, tokens committed at each decode step (target pass).
    drafts: per sequence, the drafted block (bs-1 ids) of each step, when requested.
    stats: prefill_s, decode_s, compile_s, decode_tokens_per_s, steps, tau, new_tokens; tau
    (tokens per target pass) is None where no decode step ran (every token from the prefill).
    """

    tokens: List[List[int]]
    acceptance_lengths: List[List[int]]
    drafts: Optional[List[List[List[int]]]]
    stats: dict

    @property
    def tau(self) -> Optional[float]:
        return self.stats["tau"]


def check_request(
    target,
    drafter,
    prompts,
    max_new_tokens,
    block_size,
    temperature,
    top_k,
    top_p,
    seed,
    stop_token_ids,
    denoise_steps,
    confidence_threshold,
    labels=None,
) -> dict:
    """The arguments of `generate` checked (types, ranges, ids in the vocabulary, the context
    length) and normalized (`checks.check_generate_args`'s dict). Raises ValueError naming
    a bad prompt by its label (`labels[i]`, e.g. "file.jsonl:3"; default "prompt i")."""
    if drafter is not None:
        validate_pair(drafter.config, target.config)
    v = checks.check_generate_args(
        target.config,
        drafter.config if drafter is not None else None,
        prompts,
        max_new_tokens,
        block_size,
        temperature,
        top_k,
        top_p,
        seed,
        stop_token_ids,
        denoise_steps,
        confidence_threshold,
    )
    validate_request(
        target,
        drafter,
        v["prompts"],
        v["max_new_tokens"],
        v["block_size"],
        v["denoise_steps"],
        labels=labels,
    )
    return v


# Tree budgets above this are refused: the builder is O(budget^2) per row and step, and the
# published speed peaks at 256-512 nodes on an H200 (DDTree).
MAX_TREE_BUDGET = 1024


def check_tree_request(target, drafter, block_size, tree_budget, v, return_drafts=False):
    """`generate`'s tree_budget checked against the rest of the request (one ValueError, before
    any compute): None (the chain) or an int in [1, MAX_TREE_BUDGET] that the block's depth can
    hold, with a drafter, no confidence threshold and no draft recording."""
    if tree_budget is None:
        return None
    if isinstance(tree_budget, bool) or not isinstance(tree_budget, (int, np.integer)):
        raise ValueError(f"tree_budget must be an int or None, got {tree_budget!r}")
    tree_budget = int(tree_budget)
    if drafter is None:
        raise ValueError("tree_budget needs a drafter (autoregressive decoding drafts nothing)")
    if not 1 <= tree_budget <= MAX_TREE_BUDGET:
        raise ValueError(f"tree_budget must be in [1, {MAX_TREE_BUDGET}], got {tree_budget}")
    from dflash_jax.decoding.tree import max_nodes

    most = max_nodes(block_size - 1, min(tree_budget, target.config.vocab_size))
    if tree_budget > most:
        raise ValueError(
            f"tree_budget {tree_budget} exceeds the {most} draft prefixes a block of "
            f"{block_size} can hold"
        )
    for name, bad, why in (
        (
            "confidence_threshold",
            v["confidence_threshold"] is not None,
            "a tree spends its budget where the drafter is unsure by construction",
        ),
        ("return_drafts", bool(return_drafts), "drafts are recorded for chains only"),
    ):
        if bad:
            raise ValueError(f"tree_budget does not combine with {name}: {why}")
    return tree_budget


def validate_request(
    target, drafter, prompts, max_new_tokens, block_size, denoise_steps, labels=None
):
    """Raises ValueError for bad input before any compute (a prompt named by `labels[i]`)."""
    cfg = target.config
    if drafter is not None:
        validate_pair(drafter.config, cfg)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if drafter is not None and not 2 <= block_size <= 64:
        raise ValueError(f"block_size must be in [2, 64], got {block_size}")
    if denoise_steps < 1 or (drafter is not None and denoise_steps > block_size - 1):
        raise ValueError(f"denoise_steps must be in [1, block_size-1], got {denoise_steps}")
    for i, p in enumerate(prompts):
        where = labels[i] if labels is not None else f"prompt {i}"
        if len(p) == 0:
            raise ValueError(f"{where} is empty")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(
                f"{where} has token ids outside [0, {cfg.vocab_size}): range [{lo}, {hi}]"
            )
        if len(p) + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"{where}: {len(p)} prompt tokens + max_new_tokens {max_new_tokens} exceed "
                f"the model's context length max_position_embeddings="
                f"{cfg.max_position_embeddings}"
            )


def gather_multiprocess(state, plan, times):
    """A mesh over several processes: the outputs `collect` reads, gathered to numpy on every
    process (a collective), and process 0's timings, so every process returns the same
    result."""
    from dflash_jax.parallel import distributed

    out = dict(tokens=state.tokens, num_out=state.num_out, accepted=state.accepted, step=state.step)
    if plan.record_drafts:
        out["drafts"] = state.drafts
    out = distributed.gather(out)
    times = distributed.broadcast(np.asarray(times, np.float64))
    return state.replace(**out), tuple(float(t) for t in times)


def collect(
    state, plan, b: int, *, prefill_s: float, decode_s: float, compile_s: float
) -> GenerationResult:
    """Host-side result of a final `decoding.DecodeState`: per-sequence tokens, acceptance
    lengths, drafts, and stats."""
    tokens, num_out, accepted, steps = jax.device_get(
        (state.tokens, state.num_out, state.accepted, state.step)
    )
    drafts_np = np.asarray(state.drafts) if plan.record_drafts else None
    out_tokens, acc, drafts = [], [], [] if plan.record_drafts else None
    for i in range(b):
        out_tokens.append(tokens[i, : num_out[i]].tolist())
        active = accepted[i, :steps] > 0
        acc.append(accepted[i, :steps][active].tolist())
        if drafts is not None:
            drafts.append(drafts_np[:steps, i][active].tolist())
    all_acc = [a for seq in acc for a in seq]
    new_tokens = int(num_out.sum())
    decode_tokens = int(sum(sum(a) for a in acc))
    stats = {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "compile_s": compile_s,
        "steps": int(steps),
        "new_tokens": new_tokens,
        "decode_tokens_per_s": decode_tokens / max(decode_s, 1e-9),
        "tokens_per_s": new_tokens / max(prefill_s + decode_s, 1e-9),
        "tau": float(np.mean(all_acc)) if all_acc else None,  # None: no decode step ran
        "block_size": plan.block_size,
        "batch": b,
    }
    return GenerationResult(tokens=out_tokens, acceptance_lengths=acc, drafts=drafts, stats=stats)
