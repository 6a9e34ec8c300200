"""Training curves of the bundled pair, stage after stage, from the trainer's metrics.jsonl files.

  python benchmarks/plot_training.py --out=benchmarks/results/tiny-code/training.png

Left: the target's training loss (moving average) and in-loop eval loss; middle: during the
target's unlikelihood stage, the share of its own greedy-continuation tokens that sit in a
repeated 4-gram (measured on fresh training prompts at every step); right: the drafter's in-loop
tau (real `generate` on held-out regenerated prompts). Stages given in order are drawn
one after the other (a stage's steps continue from the last step of the one before), with a
line where each new stage starts (the drafter's stage 2 is measured against the stage-2 target,
whose less repetitive text is harder to draft; its stage 3 adds 16K responses and holds out
other prompts).

Committed results: `python benchmarks/plot_training.py
--out=benchmarks/results/tiny-code/training.png`.
"""

import json
import os

import numpy as np
from absl import flags

R = "benchmarks/results/tiny-code/training"
FLAGS = flags.FLAGS
flags.DEFINE_list(
    "target_runs",
    [
        f"{R}/target_metrics.jsonl",
        f"{R}/target_stage2_metrics.jsonl",
        f"{R}/target_unlikelihood_metrics.jsonl",
    ],
    "Target metrics files, in stage order (an unlikelihood stage's rep_frac "
    "goes to the middle panel).",
)
flags.DEFINE_list(
    "drafter_runs",
    [
        f"{R}/drafter_metrics.jsonl",
        f"{R}/drafter_stage2_metrics.jsonl",
        f"{R}/drafter_stage3_metrics.jsonl",
        f"{R}/drafter_stage4_metrics.jsonl",
    ],
    "Drafter metrics files, in stage order.",
)
flags.DEFINE_list(
    "target_names", ["stage 1", "stage 2", "unlikelihood"], "Labels of the target stages."
)
flags.DEFINE_integer("smooth", 25, "Moving-average window of the training loss (log points).")
flags.DEFINE_string("out", "benchmarks/results/tiny-code/training.png", "PNG to write.")


def read_stages(paths):
    """[(train rows, eval rows, step offset)] with each stage's steps after the previous one."""
    stages, offset = [], 0
    for path in paths:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        train = [r for r in rows if r.get("split") == "train"]
        evals = [r for r in rows if r.get("split") == "eval"]
        if not train and not evals:
            raise SystemExit(f"{path}: no train or eval rows")
        stages.append((train, evals, offset))
        offset += max(r["step"] for r in train + evals)
    return stages


def moving_average(x, n):
    if len(x) < n or n <= 1:
        return np.asarray(x, float)
    return np.convolve(x, np.ones(n) / n, mode="valid")


def mark_stage(ax, step, label):
    ax.axvline(step, color="gray", ls="--", lw=0.8)
    ax.text(step, 0.97, f" {label}", transform=ax.get_xaxis_transform(), va="top", color="gray")


def main(argv):
    del argv
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a3, a2) = plt.subplots(1, 3, figsize=(15, 3.8))

    def target_stage(train, evals, off, first):
        steps = np.array([r["step"] for r in train]) + off
        loss = moving_average([r["loss"] for r in train], FLAGS.smooth)
        a1.plot(
            steps[len(steps) - len(loss) :],
            loss,
            color="C0",
            lw=1,
            label="train (moving avg)" if first else None,
        )
        a1.plot(
            [r["step"] + off for r in evals],
            [r["loss"] for r in evals],
            "o-",
            color="C1",
            label="eval" if first else None,
        )
        rep = [r for r in train if "rep_frac" in r]
        if rep:
            frac = moving_average([100 * r["rep_frac"] for r in rep], max(1, FLAGS.smooth // 5))
            a3.plot(
                np.array([r["step"] for r in rep])[len(rep) - len(frac) :] + off,
                frac,
                color="C3",
                lw=1,
            )

    def drafter_stage(train, evals, off, first):
        a2.plot(
            [r["step"] + off for r in evals],
            [r["tau"] for r in evals],
            "o-",
            color="C2",
            label="in-loop tau" if first else None,
        )

    for ax, paths, draw, names in (
        (a1, FLAGS.target_runs, target_stage, FLAGS.target_names),
        (a2, FLAGS.drafter_runs, drafter_stage, []),
    ):
        for i, (train, evals, off) in enumerate(read_stages(paths)):
            draw(train, evals, off, first=i == 0)
            if i:
                mark_stage(ax, off, names[i] if i < len(names) else f"stage {i + 1}")
    a1.set(xlabel="step", ylabel="loss (nats/token)", title="target")
    a3.set(
        xlabel="step",
        ylabel="% of greedy tokens in a repeated 4-gram",
        title="target: unlikelihood stage (moving avg of 5 logs)",
    )
    a2.set(xlabel="step", ylabel="tau (block 16)", title="drafter")
    a1.legend()
    a2.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    fig.savefig(FLAGS.out, dpi=110)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
