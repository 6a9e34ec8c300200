"""A drafter's learning curve: in-loop tau and losses against the training tokens it has seen.

  python benchmarks/plot_learning_curve.py \
      --runs=benchmarks/results/smollm2/training/stage1_metrics.jsonl \
      --tokens_per_step=4096 --out=benchmarks/results/smollm2/learning_curve.png

Reads the trainer's metrics.jsonl files (stages in order: a stage's steps continue after the
previous one's last step) and draws, against the training tokens (steps x rows x row length,
packed rows, so prompt tokens included): left, the training loss (moving average) and the
held-out loss; right, the in-loop tau (real `generate` on held-out regenerated prompts, greedy).
Also writes the points as JSON beside the PNG (same name, .json).
"""

import json
import os

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("runs", None, "Trainer metrics.jsonl files, in stage order.")
flags.DEFINE_list("labels", None, "A label per run (default: the file names).")
flags.DEFINE_integer("tokens_per_step", 4096, "Training tokens per step (batch x seq_len).")
flags.DEFINE_integer("smooth", 10, "Moving-average window of the training loss (log points).")
flags.DEFINE_string("title", "SmolLM2-135M-Instruct drafter", "Figure title.")
flags.DEFINE_string("out", None, "PNG to write.")


def read_runs(paths, tokens_per_step):
    """[(train points, eval points)] per run, steps offset so that stages follow each other:
    train = [(tokens, loss)], eval = [(tokens, loss, tau)]."""
    out, offset = [], 0
    for path in paths:
        train, evals, last = [], [], 0
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                step = int(r["step"])
                last = max(last, step)
                tokens = (offset + step) * tokens_per_step
                if r.get("split") == "train" and "loss" in r:
                    train.append((tokens, float(r["loss"])))
                elif r.get("split") == "eval" and "tau" in r:
                    evals.append((tokens, float(r["loss"]), float(r["tau"])))
        out.append((train, evals))
        offset += last
    return out


def main(argv):
    del argv
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not FLAGS.runs or not FLAGS.out:
        raise app.UsageError("--runs and --out are required")
    labels = FLAGS.labels or [os.path.basename(p) for p in FLAGS.runs]
    if len(labels) != len(FLAGS.runs):
        raise app.UsageError("--labels needs one label per run")
    runs = read_runs(FLAGS.runs, FLAGS.tokens_per_step)
    fig, (ax_l, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    for (train, evals), label in zip(runs, labels):
        if train:
            x, y = np.array(train).T
            k = max(1, min(FLAGS.smooth, len(y)))
            ys = np.convolve(y, np.ones(k) / k, mode="valid")
            ax_l.plot(x[k - 1 :] / 1e6, ys, label=f"{label}: train (avg of {k})")
        if evals:
            x, loss, tau = np.array(evals).T
            ax_l.plot(x / 1e6, loss, "o-", label=f"{label}: held-out")
            ax_t.plot(x / 1e6, tau, "o-", label=label)
    ax_l.set(xlabel="training tokens (M)", ylabel="loss (weighted CE)", yscale="log")
    ax_t.set(xlabel="training tokens (M)", ylabel="tau (in-loop, greedy)")
    ax_t.axhline(1.0, color="grey", lw=0.5)
    for ax in (ax_l, ax_t):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(FLAGS.title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    fig.savefig(FLAGS.out, dpi=110)
    points = {
        label: {"train": train, "eval": [dict(tokens=t, loss=l, tau=u) for t, l, u in evals]}
        for (train, evals), label in zip(runs, labels)
    }
    from dflash_jax.support import provenance

    with open(os.path.splitext(FLAGS.out)[0] + ".json", "w") as f:
        json.dump(
            {"tokens_per_step": FLAGS.tokens_per_step, "runs": points, **provenance.record()},
            f,
            indent=1,
        )
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
