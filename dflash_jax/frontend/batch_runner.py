"""Generation over many prompts: fixed-size batches grouped by length, JSON Lines written as
batches finish (`records`), resume, progress, per-prompt and total tau / throughput.

    report = run_prompts(target, drafter, prompts, batch_size=8, out_path="out.jsonl",
                         resume=True, max_new_tokens=128, stop_token_ids=[0])
    report.records   # per prompt, in prompt order: tokens, tau, tokens/s, ... (`records`)
    report.totals    # prompts, new_tokens, tau, decode_tokens_per_s, ...

Prompts are sorted by length and cut into batches of `batch_size`, so a batch's padding is
small and every batch has the same shape class (one compiled program per prompt-length
bucket, not per batch). A short last batch is filled with copies of its last prompt, whose
outputs are dropped. Greedy outputs do not depend on the batching (tested against one prompt
at a time); sampled ones use seed + batch number, so they depend on `batch_size`. The settings
are checked once (`textgen.Generators`) and each batch runs the same generators.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from dflash_jax.frontend import textgen
from dflash_jax.frontend.records import (  # noqa: F401  (batch_runner.X, as before the split)
    RECORD_START,
    RecordWriter,
    model_identity,
    prompt_sha,
    read_done,
    record,
    read_records,
    run_settings,
    settings_key,
)
from dflash_jax.support import checks, console


@dataclasses.dataclass
class BatchReport:
    """records: per prompt (prompt order), done in this run or resumed; totals: see
    `summarize`; resumed: how many prompts were taken from an earlier run's file."""

    records: List[dict]
    totals: dict
    resumed: int = 0


def length_batches(lengths: Sequence[int], batch_size: int) -> List[List[int]]:
    """Prompt indices cut into batches of `batch_size` after sorting by length (stable)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _is_primary() -> bool:
    import jax

    return jax.process_index() == 0


def _batch_seed(seed: int, b: int) -> int:
    """seed + b, wrapped into the 64-bit range `generate` accepts."""
    return (seed + b + 2**63) % 2**64 - 2**63


def run_prompts(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    batch_size: int = 8,
    out_path: Optional[str] = None,
    resume: bool = False,
    tokenizer=None,
    compare_ar: bool = False,
    warmup: bool = True,
    profile_dir: Optional[str] = None,
    extra_settings: Optional[dict] = None,
    on_batch: Optional[Callable[[int, List[dict]], None]] = None,
    stream_callback: Optional[Callable[[List[List[int]]], None]] = None,
    **gen_kw,
) -> BatchReport:
    """Runs `generate` over `prompts` (token-id lists) in length-grouped batches.

    gen_kw: `generate` keyword arguments (max_new_tokens, temperature, top_k, top_p, seed,
    stop_token_ids, block_size, denoise_steps, confidence_threshold). The drafter-only ones are
    dropped for the autoregressive comparison (compare_ar), which decodes the same batches.
    warmup: run the first batch once untimed first (compiles, first-run allocations).
    stream_callback: an extra, untimed run over `prompts` before anything else that calls it
    with each step's commits (infer.py prints a single prompt's completion as it comes).
    extra_settings: more values that must match on resume (e.g. model paths).
    on_batch(batch_number, records): called after each batch's lines are written.
    """
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts:
        raise ValueError("no prompts")
    settings = run_settings(gen_kw, batch_size, drafter is not None, extra_settings)
    seed = checks.seed_param("seed", gen_kw.pop("seed", 0))  # batch b: seed + b, wrapped
    gen_kw.setdefault("stop_token_ids", ())
    batches = length_batches([len(p) for p in prompts], batch_size)
    done: Dict[int, dict] = {}
    keep = 0
    if out_path and resume:  # read only; the file is replaced when the first batch is done
        done, keep = read_records(out_path, prompts, settings)
    resumed = len(done)
    todo = [(b, [i for i in idx if i not in done]) for b, idx in enumerate(batches)]
    todo = [(b, idx) for b, idx in todo if idx]

    def padded(idx):
        rows = [prompts[i] for i in idx]
        return rows + [rows[-1]] * (batch_size - len(rows))

    max_new_tokens = gen_kw.pop("max_new_tokens")
    # Checked once, run per batch (each batch's seed its own).
    gens = textgen.Generators.build(target, drafter, compare_ar=compare_ar, seed=seed, **gen_kw)
    if stream_callback is not None:
        gens.spec(prompts, max_new_tokens, stream_callback=stream_callback)
    if warmup and todo:
        gens.warm_up(padded(todo[0][1]), max_new_tokens)
    if profile_dir:
        import jax

        jax.profiler.start_trace(profile_dir)
    # With several processes every one computes the same records; the first one writes them.
    out = RecordWriter(out_path, keep) if out_path and _is_primary() else None
    bar = console.progress(total=len(prompts) - resumed, desc="generate", unit="prompt")
    run_tokens, run_decode_s, run_acc = 0, 0.0, []
    try:
        for b, idx in todo:
            c = gens.run(padded(idx), max_new_tokens, seed=_batch_seed(seed, b), warmup=False)
            res = c.spec
            recs = [
                record(i, row, prompts[i], b, settings, c.spec, c.ar, tokenizer)
                for row, i in enumerate(idx)
            ]
            done.update((r["index"], r) for r in recs)
            if out is not None:
                out.write("".join(json.dumps(r) + "\n" for r in recs))
            run_tokens += sum(sum(r["acceptance_lengths"]) for r in recs)
            run_decode_s += res.stats["decode_s"]
            run_acc += [a for r in recs for a in r["acceptance_lengths"]]
            bar.update(len(idx))
            bar.set_postfix_str(
                f"{run_tokens / max(run_decode_s, 1e-9):,.0f} tok/s, "
                f"tau {np.mean(run_acc) if run_acc else 0:.2f}"
            )
            if on_batch is not None:
                on_batch(b, recs)
    finally:
        bar.close()
        if out is not None:
            out.close()
        if profile_dir:
            import jax

            jax.profiler.stop_trace()
    records = [done[i] for i in range(len(prompts))]
    return BatchReport(records=records, totals=summarize(records), resumed=resumed)


def summarize(records: Sequence[dict]) -> dict:
    """Totals over records: tau over every committed block, throughput = committed decode
    tokens / decode time of the distinct batches, per-prompt tau quantiles. Without a decode
    step (max_new_tokens=1: every token came from the prefill) tau and its quantiles are None,
    and so is the speedup."""
    acc = [a for r in records for a in r["acceptance_lengths"]]
    batch_s = {r["batch"]: r["batch_decode_s"] for r in records}
    decode_tokens = sum(acc)
    taus = [r["tau"] for r in records if r["tau"] is not None]
    out = {
        "prompts": len(records),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "decode_tokens": decode_tokens,
        "tau": float(np.mean(acc)) if acc else None,
        "decode_s": float(sum(batch_s.values())),
        "decode_tokens_per_s": decode_tokens / max(sum(batch_s.values()), 1e-9),
        "prefill_s": float(sum({r["batch"]: r["prefill_s"] for r in records}.values())),
        "compile_s": float(sum({r["batch"]: r["compile_s"] for r in records}.values())),
        "tau_per_prompt": {
            q: float(np.quantile(taus, p)) if taus else None
            for q, p in (("min", 0), ("median", 0.5), ("max", 1))
        },
    }
    if records and all("identical_to_ar" in r for r in records):
        ar_s = {r["batch"]: r["ar_batch_decode_s"] for r in records}
        ar_tokens = sum(r["ar_decode_tokens"] for r in records)
        out["ar_decode_tokens_per_s"] = ar_tokens / max(sum(ar_s.values()), 1e-9)
        out["speedup"] = (
            out["decode_tokens_per_s"] / max(out["ar_decode_tokens_per_s"], 1e-9)
            if decode_tokens and ar_tokens
            else None  # nothing was decoded: no rate to compare
        )
        out["identical_to_ar"] = all(r["identical_to_ar"] for r in records)
    return out
