"""A drafter's learning curve: in-loop tau and losses against the training tokens it has seen.

  python benchmarks/plot_learning_curve.py \
      --runs=benchmarks/results/smollm2/training/stage1_metrics.jsonl \
      --tokens_per_step=4096 --out=benchmarks/results/smollm2/learning_curve.png

Reads the trainer's metrics.jsonl files (stages in order: a stage's steps continue after the
previous one's last step) and draws, against the training tokens (steps x rows x row length,
packed rows, so prompt tokens included) or the training hours (`--x=hours`): left, the
training loss (moving average) and the held-out loss; right, the in-loop tau (real `generate`
on held-out regenerated prompts, greedy). Also writes the points as JSON beside the PNG (same
name, .json).

Several drafters on one figure (the same CPU budget, issue 43): `--groups` gives each run its
drafter (runs of one group are its stages, in order; each group starts at 0), e.g. DFlash's
four stages and EAGLE-3's two:

  python benchmarks/plot_learning_curve.py --runs=d1,d2,d3,d4,e1,e2 --groups=0,0,0,0,1,1 \
      --x=hours --out=...

Hours are the trainer's own clock: each logged window's steps x tokens_per_step /
tokens_per_s (the window's wall time: its steps, and any in-loop evaluation, checkpoint or
first compile that fell in it), summed over the windows. (Before 2026-12-04 a window could
leave out a wait on the device inside the previous log line, overstating the rate; the
SmolLM2 DFlash stage 1 sums to 26.4 minutes for 80 steps against its wall clock's 27 for 82,
so its logs did not.)
"""

import json
import os

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS


def _define_flags():
    """The CLI's flags, defined when run as a script (importing `read_runs` defines none: absl
    flags are global, and other scripts imported beside it in one process, e.g.
    benchmarks/plot_training.py in the tests, define some of the same names)."""
    flags.DEFINE_list("runs", None, "Trainer metrics.jsonl files, in stage order.")
    flags.DEFINE_list("labels", None, "A label per run (default: the file names).")
    flags.DEFINE_list(
        "groups",
        None,
        "A drafter index per run (runs of one index are its stages; default: all 0).",
    )
    flags.DEFINE_enum("x", "tokens", ["tokens", "hours"], "The horizontal axis.")
    flags.DEFINE_integer("tokens_per_step", 4096, "Training tokens per step (batch x seq_len).")
    flags.DEFINE_integer("smooth", 10, "Moving-average window of the training loss (log points).")
    flags.DEFINE_string("title", "SmolLM2-135M-Instruct drafter", "Figure title.")
    flags.DEFINE_string("out", None, "PNG to write.")


def read_runs(paths, tokens_per_step, groups=None):
    """[(train points, eval points)] per run, steps (and hours) offset so that the stages of a
    group follow each other, each group from 0: train = [(tokens, hours, loss)], eval =
    [(tokens, hours, loss, tau)]; hours summed from the train records' tokens_per_s (module
    doc; an eval record takes the hours of the train record at its step or before it)."""
    groups = [0] * len(paths) if groups is None else [int(g) for g in groups]
    if len(groups) != len(paths):
        raise ValueError(f"{len(groups)} groups for {len(paths)} runs: give one per run")
    out, offset, hours0 = [], {}, {}
    for path, g in zip(paths, groups):
        train, evals, last, hours, prev = [], [], 0, hours0.get(g, 0.0), 0
        off = offset.get(g, 0)
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                step = int(r["step"])
                last = max(last, step)
                tokens = (off + step) * tokens_per_step
                if r.get("split") == "train" and "loss" in r:
                    rate = float(r.get("tokens_per_s") or 0.0)
                    if rate > 0 and step > prev:
                        hours += (step - prev) * tokens_per_step / rate / 3600.0
                    prev = max(prev, step)
                    train.append((tokens, hours, float(r["loss"])))
                elif r.get("split") == "eval" and "tau" in r:
                    evals.append((tokens, hours, float(r["loss"]), float(r["tau"])))
        out.append((train, evals))
        offset[g], hours0[g] = off + last, hours
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
    try:
        runs = read_runs(FLAGS.runs, FLAGS.tokens_per_step, FLAGS.groups)
    except (ValueError, OSError) as e:
        raise app.UsageError(str(e)) from None
    hours = FLAGS.x == "hours"
    xlabel = "training hours (the trainer's clock)" if hours else "training tokens (M)"
    fig, (ax_l, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    groups = [int(g) for g in FLAGS.groups] if FLAGS.groups else None
    for i, ((train, evals), label) in enumerate(zip(runs, labels)):
        # one colour per drafter when there are groups (its stages differ in shade), else per run
        color = None
        if groups:
            stage = groups[:i].count(groups[i])
            color = plt.get_cmap(("Blues", "Oranges", "Greens", "Purples")[groups[i] % 4])(
                0.45 + 0.5 * stage / max(1, groups.count(groups[i]) - 1)
            )
        if train:
            tok, hrs, y = np.array(train).T
            x = hrs if hours else tok / 1e6
            k = max(1, min(FLAGS.smooth, len(y)))
            ys = np.convolve(y, np.ones(k) / k, mode="valid")
            ax_l.plot(x[k - 1 :], ys, color=color, label=f"{label}: train (avg of {k})")
        if evals:
            tok, hrs, loss, tau = np.array(evals).T
            x = hrs if hours else tok / 1e6
            ax_l.plot(x, loss, "o--", color=color, label=f"{label}: held-out")
            ax_t.plot(x, tau, "o-", color=color, label=label)
    ax_l.set(xlabel=xlabel, ylabel="loss (weighted CE)", yscale="log")
    ax_t.set(xlabel=xlabel, ylabel="tau (in-loop, greedy)")
    ax_t.axhline(1.0, color="grey", lw=0.5)
    for ax in (ax_l, ax_t):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(FLAGS.title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    fig.savefig(FLAGS.out, dpi=110)
    points = {
        label: {
            "train": [(t, round(h, 4), l) for t, h, l in train],
            "eval": [dict(tokens=t, hours=round(h, 4), loss=l, tau=u) for t, h, l, u in evals],
        }
        for (train, evals), label in zip(runs, labels)
    }
    from dflash_jax.support import provenance

    with open(os.path.splitext(FLAGS.out)[0] + ".json", "w") as f:
        json.dump(
            {
                "tokens_per_step": FLAGS.tokens_per_step,
                "groups": FLAGS.groups,
                "runs": points,
                **provenance.record(),
            },
            f,
            indent=1,
        )
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
