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

`--project=2.5,3` adds a third panel: a power law tau - 1 = c * tokens^alpha fitted (least
squares in log-log) to the in-loop tau of the first drafter (group 0), drawn on log axes out to
the training tokens at which it would reach each given tau, and written to the JSON
(`projection`: c, alpha, the tokens per target tau, and the hours at the drafter's mean rate).
An extrapolation, not a measurement: it says how far the curve so far would have to run.

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
    flags.DEFINE_list(
        "project", None, "Target taus to project the first drafter's power-law fit to."
    )


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


def project(evals, targets, hours=None):
    """Fit tau - 1 = c * tokens^alpha to eval points [(tokens, hours, loss, tau)] (least squares
    of log(tau - 1) on log(tokens), points with tau <= 1 left out) and give the tokens at which
    the fit reaches each target tau, and the hours at `hours` (training hours per token, the
    drafter's mean so far) if given. Raises ValueError with fewer than two usable points or a
    curve that does not rise (alpha <= 0: it never gets there)."""
    pts = [(t, u) for t, _, _, u in evals if u > 1.0 and t > 0]
    if len({t for t, _ in pts}) < 2:
        raise ValueError(f"{len(pts)} eval points with tau > 1: the fit needs two")
    x = np.log([t for t, _ in pts])
    y = np.log([u - 1.0 for _, u in pts])
    alpha, logc = np.polyfit(x, y, 1)
    if alpha <= 0:
        raise ValueError(f"tau does not rise with tokens (alpha {alpha:.3f}): nothing to project")
    c = float(np.exp(logc))
    out = {"c": c, "alpha": float(alpha), "points": len(pts), "targets": {}}
    for target in targets:
        tokens = ((float(target) - 1.0) / c) ** (1.0 / alpha)
        row = {"tokens": tokens}
        if hours is not None:
            row["hours"] = tokens * hours
        out["targets"][str(target)] = row
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
    groups = [int(g) for g in FLAGS.groups] if FLAGS.groups else None
    projection = None
    if FLAGS.project:
        try:
            targets = [float(t) for t in FLAGS.project]
        except ValueError:
            raise app.UsageError(f"--project takes taus, got {FLAGS.project}") from None
        first = [r for r, g in zip(runs, groups or [0] * len(runs)) if g == 0]
        evals = [e for _, ev in first for e in ev]
        last = max((tr[-1] for tr, _ in first if tr), default=None)
        per_token = last[1] / last[0] if last and last[0] > 0 and last[1] > 0 else None
        try:
            projection = project(evals, targets, per_token)
        except ValueError as e:
            raise app.UsageError(f"--project: {e}") from None
    ncol = 3 if projection else 2
    fig, axes = plt.subplots(1, ncol, figsize=(5.5 * ncol, 4))
    ax_l, ax_t = axes[0], axes[1]
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
    if projection:
        ax_p = axes[2]
        tok = np.array([e[0] for _, ev in first for e in ev], float)
        tau = np.array([e[3] for _, ev in first for e in ev], float)
        ax_p.plot(tok / 1e6, tau - 1.0, "o", label="in-loop tau (first drafter)")
        far = max(r["tokens"] for r in projection["targets"].values())
        xs = np.geomspace(tok[tok > 0].min(), max(far, tok.max()), 100)
        c, a = projection["c"], projection["alpha"]
        ax_p.plot(xs / 1e6, c * xs**a, "--", label=f"fit: tau-1 = {c:.2g} T^{a:.2f}")
        for target, row in projection["targets"].items():
            when = f"{row['tokens'] / 1e6:,.0f}M tokens"
            if "hours" in row:
                when += f", ~{row['hours']:,.0f} h here"
            ax_p.axhline(float(target) - 1.0, color="grey", lw=0.6, ls=":")
            ax_p.plot([row["tokens"] / 1e6], [float(target) - 1.0], "x", color="black")
            ax_p.annotate(
                f"tau {target}: {when}",
                (row["tokens"] / 1e6, float(target) - 1.0),
                fontsize=7,
                ha="right",
                va="bottom",
            )
        ax_p.set(
            xscale="log",
            yscale="log",
            xlabel="training tokens (M), log",
            ylabel="tau - 1",
            title="extrapolated (a fit, not a measurement)",
        )
    for ax in axes:
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
                "projection": projection,
                **provenance.record(),
            },
            f,
            indent=1,
        )
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
