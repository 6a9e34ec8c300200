"""Draft trees against the chain on this machine: tau and decode tokens/s per tree budget, on
the bundled trained pair (assets/tiny-code), with autoregressive decoding timed in the same
run (ratios side by side, the machine's load shared), every output checked against it.

    python benchmarks/experiments/trees/tree_budget.py --budgets=8,16,32,64,128 --batches=1,4 \\
        --max_new_tokens=64 --json_out=benchmarks/results/tree_budget/cpu.json

A tree of B nodes makes the target verify B + 1 tokens per step instead of the chain's
block_size: on a compute-bound machine (this CPU; a large batch on an accelerator) that costs
about B / block_size chain steps, while the drafter's pass is the same. The plot (beside the
JSON) shows tau and tokens/s against the budget, the chain as budget 0.
"""

from __future__ import annotations

import json
import os
import sys
from typing import List

from absl import app, flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_list("budgets", ["8", "16", "32", "64", "128"], "Tree budgets (nodes).")
    flags.DEFINE_list("batches", ["1", "4"], "Batch sizes (the code prompts, repeated).")
    flags.DEFINE_integer("max_new_tokens", 64, "New tokens per prompt.", lower_bound=1)
    flags.DEFINE_integer("block_size", 16, "Block size (the tree's depth is block_size - 1).")
    flags.DEFINE_integer("repeats", 3, "Timed runs per setting (the fastest is kept).")
    flags.DEFINE_list(
        "confidence_thresholds",
        [],
        "Also the chain under these confidence thresholds (each step verifies only the drafts "
        "some row trusts: 4, 8 or 16 tokens at block 16).",
    )
    flags.DEFINE_string("json_out", None, "Write the rows (and provenance) here.")
    flags.DEFINE_string("plot", None, "PNG path (default: beside --json_out).")


def _ints(name: str, values: List[str]) -> List[int]:
    try:
        out = [int(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{name} wants comma-separated integers, got {values}") from None
    if not out or min(out) < 1:
        raise app.UsageError(f"--{name} wants integers >= 1, got {values}")
    return out


def _timed(fn, repeats: int):
    """(result of the first call after a warm-up, fastest decode seconds over `repeats`)."""
    res = fn()  # compiles
    best = float("inf")
    for _ in range(repeats):
        best = min(best, fn().stats["decode_s"])
    return res, best


def rows_for(budgets, batches, max_new_tokens, block_size, repeats, thresholds=()):
    import dflash_jax as dj
    from dflash_jax.data.tokenizer import load_tokenizer

    pair = os.path.join(ROOT, "assets", "tiny-code")
    target = dj.load_target(os.path.join(pair, "target"), dtype="float32")
    drafter = dj.load_drafter(os.path.join(pair, "drafter"), target=target)
    tok = load_tokenizer(os.path.join(pair, "target"))
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from _pair import CODE

    base = [tok.encode(c) for c in CODE]
    rows = []
    for batch in batches:
        prompts = [base[i % len(base)] for i in range(batch)]
        gen = lambda d, tree=None, thr=None: dj.generate(
            target,
            d,
            prompts,
            max_new_tokens,
            block_size=block_size,
            tree_budget=tree,
            confidence_threshold=thr,
        )
        ar, ar_s = _timed(lambda: gen(None), repeats)
        tokens = sum(len(t) for t in ar.tokens) - batch  # the first token comes from prefill
        settings = [(b, None) for b in [0] + list(budgets)] + [(0, t) for t in thresholds]
        for budget, thr in settings:
            r, s = _timed(lambda: gen(drafter, budget or None, thr), repeats)
            if r.tokens != ar.tokens:
                raise SystemExit(f"budget {budget} batch {batch}: output differs from AR")
            name = f"tree {budget}" if budget else "chain" + (f" conf>={thr}" if thr else "")
            rows.append(
                {
                    "batch": batch,
                    "budget": budget,  # 0: the chain
                    "confidence_threshold": thr,
                    "verify_tokens": block_size if budget == 0 else budget + 1,
                    "tau": round(r.tau, 3),
                    "decode_tokens_per_s": round(tokens / s, 1),
                    "ar_decode_tokens_per_s": round(tokens / ar_s, 1),
                    "speedup_vs_ar": round(ar_s / s, 3),
                    "identical_to_ar": True,
                }
            )
            print(
                f"batch {batch:3d}  {name:>15}  "
                f"tau {r.tau:5.2f}  {tokens / s:8.1f} tok/s  ({ar_s / s:4.2f}x AR)",
                flush=True,
            )
    return rows


def plot(rows, path: str, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for batch in sorted({r["batch"] for r in rows}):
        rs = [r for r in rows if r["batch"] == batch and r["confidence_threshold"] is None]
        xs = [max(r["budget"], 1) for r in rs]
        ax1.plot(xs, [r["tau"] for r in rs], "o-", label=f"batch {batch}")
        ax2.plot(xs, [r["speedup_vs_ar"] for r in rs], "o-", label=f"batch {batch}")
    for ax, label in ((ax1, "tau (tokens per target pass)"), (ax2, "decode speed / AR's")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget (1 = the chain)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    ax2.axhline(1.0, color="grey", lw=0.8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv):
    del argv
    budgets, batches = _ints("budgets", FLAGS.budgets), _ints("batches", FLAGS.batches)
    if not 2 <= FLAGS.block_size <= 64:
        raise app.UsageError(f"--block_size must be in [2, 64], got {FLAGS.block_size}")
    try:
        thresholds = [float(t) for t in FLAGS.confidence_thresholds]
    except ValueError:
        raise app.UsageError(f"--confidence_thresholds: numbers, got {FLAGS.confidence_thresholds}")
    if any(not 0 < t <= 1 for t in thresholds):
        raise app.UsageError(f"--confidence_thresholds must be in (0, 1], got {thresholds}")
    rows = rows_for(
        budgets, batches, FLAGS.max_new_tokens, FLAGS.block_size, FLAGS.repeats, thresholds
    )
    if FLAGS.json_out:
        from dflash_jax.support import provenance

        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(
                {
                    **provenance.record(),
                    "pair": "assets/tiny-code (float32)",
                    "block_size": FLAGS.block_size,
                    "max_new_tokens": FLAGS.max_new_tokens,
                    "note": "measured on this machine's CPU (XLA attention)",
                    "rows": rows,
                },
                f,
                indent=1,
            )
        print(f"wrote {FLAGS.json_out}")
    path = FLAGS.plot or (os.path.splitext(FLAGS.json_out)[0] + ".png" if FLAGS.json_out else None)
    if path:
        plot(rows, path, f"draft trees vs the chain, bundled pair, CPU, block {FLAGS.block_size}")
        print(f"wrote {path}")


if __name__ == "__main__":
    define_flags()
    from dflash_jax.support import cli

    cli.run(main)
