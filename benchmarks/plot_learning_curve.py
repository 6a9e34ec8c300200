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

The ledger (`--ledger`): every drafter training run of a project in one JSON file, e.g.
benchmarks/results/smollm2/ledger.json, drawn as one figure and one table, so that the CPU
each run cost sits beside the tau it bought:

  python benchmarks/plot_learning_curve.py --ledger=benchmarks/results/smollm2/ledger.json \
      --project=2.5,3 --out=benchmarks/results/smollm2/ledger.png \
      --json_out=benchmarks/results/smollm2/ledger_curve.json \
      --table_out=benchmarks/results/smollm2/ledger.md

The file is a list of runs, or an object whose "runs" is that list (its other keys are notes).
A run: `name`, `label`, `drafter_kind` (dflash, dflash2, eagle3, ...: one colour family per
kind), `metrics` (the trainer's metrics.jsonl, relative to the repository root),
`tokens_per_step`, `command` (what ran it), `status` ("shipped", "superseded", "lost": a losing
variant, drawn dashed); optional: `continues` (the name of an earlier run this one started
from: its end gives `start_tokens` and `start_cpu_hours`, which, when also written, must agree
with it), else `start_tokens` / `start_cpu_hours` (default 0: what the run stands on, e.g. a
from-scratch run's reused data), `data_cpu_hours` (data generation first used by this run,
default 0), `steps` (the steps trained when the log stops short of them: the hours are then
extrapolated at the run's own rate), `x_hours_field` (a record field holding the seconds since
the run began), `train_cpu_hours` (used only when the metrics have no clock: neither that
field nor `tokens_per_s`; spread linearly over the steps), `main_line` (true on the runs whose
in-loop tau `--project` fits), `notes`. CPU-hours are wall hours of the machine the ledger
names. A run's points sit at cumulative CPU-hours start + data + its training hours so far
(left), and at cumulative training tokens start + steps x tokens_per_step (right); with
`--project` a power law tau - 1 = c * x^alpha is fitted to the main line against each, and the
hours (and tokens) at which it would reach each target tau are written to the JSON and table.
Bad input (a missing ledger or metrics file, a missing key, a start that disagrees with the run
it continues) is one line, `error: ...`, exit status 2, before anything is written.

Every flag, input and output path is checked before anything is read or drawn: an empty metrics
file, a record without a step or with a loss, tau or rate that is not a finite number,
`--tokens_per_step` 0, a `--project` goal at or below 1 (tau is 1 without a drafter), a fit that
reaches a goal at no finite x, or an output that is an input (e.g. the JSON beside
`--out=ledger.png` when the ledger is ledger.json) is one line, exit 2. Ctrl-C / SIGTERM: one
line, exit 130 / 143; the outputs are written whole, all or none (dflash_jax/support/outputs.py).

Committed results: `python benchmarks/plot_learning_curve.py
--ledger=benchmarks/results/smollm2/ledger.json --project=2.5,3
--out=benchmarks/results/smollm2/ledger.png
--json_out=benchmarks/results/smollm2/ledger_curve.json
--table_out=benchmarks/results/smollm2/ledger.md`; the SmolLM2 learning and budget curves
(`benchmarks/results/smollm2/{learning_curve,budget_curve}.json`, PNGs beside them) each name
their `--runs=...` command in the JSON.
"""

import io
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
if __name__ == "__main__":  # Ctrl-C / SIGTERM from here on: one line, exit 130 / 143
    sys.path.insert(0, ROOT)  # dflash_jax from this checkout
    from dflash_jax.support import interrupts

    interrupts.guard("interrupted: nothing was written")

import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

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
        "project",
        None,
        "Target taus to project the first drafter's (with --ledger: the main line's) "
        "power-law fit to.",
    )
    flags.DEFINE_string(
        "ledger", None, "A ledger of runs (JSON, module doc): draws all of them, not --runs."
    )
    flags.DEFINE_string("json_out", None, "The points as JSON (default: --out with .json).")
    flags.DEFINE_string("table_out", None, "With --ledger: the table as markdown.")


def _number(r, key, where=None, lo=None):
    """r[key] as a finite float (>= lo if given); ValueError naming `where` otherwise."""
    v, at = r[key], f"{where}: " if where else ""
    if isinstance(v, bool):
        raise ValueError(f"{at}{key} {v!r} is not a number")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{at}{key} {v!r} is not a number") from None
    if not math.isfinite(x) or (lo is not None and x < lo):
        more = f" >= {lo:g}" if lo is not None else ""
        raise ValueError(f"{at}{key} {v!r} is not a finite number{more}")
    return x


def _records(path):
    """(line number, record) of a metrics.jsonl, each a JSON object with an integer step >= 0;
    ValueError (one line naming the file and line) for a missing or empty file or a bad line."""
    try:
        f = open(path)
    except FileNotFoundError:
        raise ValueError(f"metrics file {path} not found") from None
    except IsADirectoryError:
        raise ValueError(f"metrics file {path} is a directory") from None
    out = []
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError:
                raise ValueError(f"{path}:{n}: not JSON") from None
            if not isinstance(r, dict) or "step" not in r:
                raise ValueError(f"{path}:{n}: not a metrics record (a JSON object with a step)")
            step = r["step"]
            if isinstance(step, bool) or not isinstance(step, (int, float)) or step != int(step):
                raise ValueError(f"{path}:{n}: step {step!r} is not an integer")
            if step < 0:
                raise ValueError(f"{path}:{n}: step {step} is negative")
            out.append((n, dict(r, step=int(step))))
    if not out:
        raise ValueError(f"metrics file {path} has no records (empty): no data to draw")
    return out


def read_runs(paths, tokens_per_step, groups=None):
    """[(train points, eval points)] per run, steps (and hours) offset so that the stages of a
    group follow each other, each group from 0: train = [(tokens, hours, loss)], eval =
    [(tokens, hours, loss, tau)]; hours summed from the train records' tokens_per_s (module
    doc; an eval record takes the hours of the train record at its step or before it).
    ValueError (one line) for a missing or empty file, a bad record (no step, a loss, tau or
    rate that is not a finite number) or a file with no train loss and no eval tau."""
    if int(tokens_per_step) < 1:
        raise ValueError(f"tokens per step must be >= 1, got {tokens_per_step}")
    groups = [0] * len(paths) if groups is None else list(groups)
    if len(groups) != len(paths):
        raise ValueError(f"{len(groups)} groups for {len(paths)} runs: give one per run")
    try:
        groups = [int(g) for g in groups]
    except ValueError:
        raise ValueError(f"groups must be integers, got {groups}") from None
    out, offset, hours0 = [], {}, {}
    for path, g in zip(paths, groups):
        train, evals, last, hours, prev = [], [], 0, hours0.get(g, 0.0), 0
        off = offset.get(g, 0)
        for n, r in _records(path):
            where = f"{path}:{n}"
            step = r["step"]
            last = max(last, step)
            tokens = (off + step) * tokens_per_step
            if r.get("split") == "train" and "loss" in r:
                rate = _number(r, "tokens_per_s", where, lo=0) if "tokens_per_s" in r else 0.0
                if rate > 0 and step > prev:
                    hours += (step - prev) * tokens_per_step / rate / 3600.0
                prev = max(prev, step)
                train.append((tokens, hours, _number(r, "loss", where)))
            elif r.get("split") == "eval" and "tau" in r:
                if "loss" not in r:
                    raise ValueError(f"{where}: an eval record without a loss")
                tau = _number(r, "tau", where, lo=0)
                evals.append((tokens, hours, _number(r, "loss", where), tau))
        if not train and not evals:
            raise ValueError(
                f"metrics file {path}: no train loss or eval tau records: no data to draw"
            )
        out.append((train, evals))
        offset[g], hours0[g] = off + last, hours
    return out


def project_targets(values, what="--project"):
    """The target taus of `values` (strings or numbers) as floats, each finite and above 1 (tau
    counts the tokens a target pass commits: 1 without a drafter, so a goal at or below 1 is no
    goal); ValueError, one line."""
    out = []
    for v in values:
        try:
            x = float(str(v).strip())
        except ValueError:
            raise ValueError(
                f"{what}: {v!r} is not a number (give target taus, e.g. 2.5,3)"
            ) from None
        if not math.isfinite(x) or x <= 1.0:
            raise ValueError(
                f"{what}: target tau {v!r} must be a finite number above 1 (tau is at least 1 "
                "with no drafter)"
            )
        out.append(x)
    if not out:
        raise ValueError(f"{what}: give one or more target taus above 1")
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
    targets = project_targets(targets, "target")
    x = np.log([t for t, _ in pts])
    y = np.log([u - 1.0 for _, u in pts])
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("an eval point is not a finite number: nothing to fit")
    with np.errstate(all="ignore"):
        alpha, logc = np.polyfit(x, y, 1)
        c = float(np.exp(logc))
    if not (math.isfinite(alpha) and math.isfinite(c) and c > 0):
        raise ValueError(f"the fit is not finite (c {c}, alpha {alpha}): nothing to project")
    if alpha <= 0:
        raise ValueError(f"tau does not rise with tokens (alpha {alpha:.3f}): nothing to project")
    out = {"c": c, "alpha": float(alpha), "points": len(pts), "targets": {}}
    for target in targets:
        with np.errstate(all="ignore"):
            try:
                tokens = float(((target - 1.0) / c) ** (1.0 / alpha))
            except OverflowError:
                tokens = math.inf
        row = {"tokens": tokens}
        if hours is not None:
            row["hours"] = tokens * hours
        if not (math.isfinite(tokens) and tokens > 0 and math.isfinite(row.get("hours", 0.0))):
            raise ValueError(
                f"the fit tau - 1 = {c:.3g} x^{alpha:.3g} reaches tau {target:g} at no finite "
                "x: nothing to project"
            )
        out["targets"][str(target)] = row
    return out


# The ledger (module doc). Keys every run must have; statuses drawn dashed (losing variants).
LEDGER_KEYS = ("name", "label", "drafter_kind", "metrics", "tokens_per_step", "command", "status")
LOSING = ("lost",)
# Tolerance of a written start_cpu_hours against the end of the run it continues (18 s).
START_HOURS_TOL = 0.005


def _read_clocked(path, tokens_per_step, hours_field=None):
    """One metrics file: (evals {step: (hours or None, loss, tau)}, last step, hours at the
    last step or None, the clock's name or None). Hours: `hours_field` (seconds since the run
    began) where given, else the trainer's clock (summed windows of tokens_per_s, as
    `read_runs`); None where the file has neither. An eval record takes the hours of the record
    before it (or its own field); a step evaluated twice keeps its last record."""
    evals, last, hours, prev, clock, field_h = {}, 0, 0.0, 0, None, None
    for n, r in _records(path):
        where = f"{path}:{n}"
        step = r["step"]
        last = max(last, step)
        if hours_field:
            if r.get(hours_field) is not None:
                field_h = _number(r, hours_field, where, lo=0) / 3600.0
                clock = f"{hours_field} (seconds)"
        elif r.get("split") == "train" and "loss" in r:
            rate = _number(r, "tokens_per_s", where, lo=0) if "tokens_per_s" in r else 0.0
            if rate > 0 and step > prev:
                hours += (step - prev) * tokens_per_step / rate / 3600.0
                clock = "trainer clock (tokens_per_s windows)"
            prev = max(prev, step)
        if r.get("split") == "eval" and "tau" in r:
            now = (field_h or 0.0) if hours_field else hours
            loss = _number(r, "loss", where) if r.get("loss") is not None else None
            evals[step] = (now, loss, _number(r, "tau", where, lo=0))
    if clock is None:
        return {s: (None, l, u) for s, (_, l, u) in evals.items()}, last, None, None
    return evals, last, (field_h if hours_field else hours), clock


def read_ledger(path, root=ROOT):
    """The ledger at `path` read and checked: (its notes: the top-level keys but "runs", [run]),
    each run its entry plus steps, start_tokens, end_tokens, start_cpu_hours, data_cpu_hours,
    train_cpu_hours, end_cpu_hours (cumulative: start + data + training), hours_source,
    last_tau, best_tau, `evals` [dict(step, tokens, cpu_hours, loss, tau)] (cumulative
    tokens and hours) and `origin` (the continued run's last eval point, or None). Raises
    ValueError (one line) on any bad input, before anything is drawn."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"ledger {path} not found") from None
    except IsADirectoryError:
        raise ValueError(f"ledger {path} is a directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"ledger {path} is not JSON: {e}") from None
    if not isinstance(data, (list, dict)):
        raise ValueError(f'ledger {path}: a list of runs, or {{"runs": [...]}}, not {data!r:.40}')
    meta, entries = ({}, data) if isinstance(data, list) else (dict(data), data.get("runs"))
    meta.pop("runs", None)
    if not isinstance(entries, list) or not entries:
        raise ValueError(f'ledger {path}: no runs (a list of runs, or {{"runs": [...]}})')
    if not isinstance(meta.get("cpu_hours", ""), str):
        raise ValueError(f"ledger {path}: cpu_hours is {meta['cpu_hours']!r}, not a sentence")
    spare = meta.get("unattributed_data", [])
    if not isinstance(spare, list) or not all(isinstance(u, dict) for u in spare):
        raise ValueError(f"ledger {path}: unattributed_data is not a list of objects")
    runs, by_name = [], {}
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise ValueError(f"ledger {path}, run {i + 1}: not an object")
        who = f"ledger {path}, run {i + 1} ({e.get('name', 'no name')})"
        missing = [k for k in LEDGER_KEYS if k not in e]
        if missing:
            raise ValueError(f"{who}: missing key(s) {', '.join(missing)}")
        if not isinstance(e["name"], str) or not e["name"]:
            raise ValueError(f"{who}: name {e['name']!r} is not a name")
        if e["name"] in by_name:
            raise ValueError(f"{who}: a second run named {e['name']!r}")
        if not isinstance(e["metrics"], str):
            raise ValueError(f"{who}: metrics is {e['metrics']!r}, not a path")
        metrics = os.path.join(root, e["metrics"])  # an absolute path stays itself
        if not os.path.isfile(metrics):
            raise ValueError(f"{who}: metrics file {e['metrics']} not found")
        try:
            for key in ("tokens_per_step", "steps", "start_tokens"):
                v = e.get(key)
                if key in e and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise ValueError(f"{key} {v!r} is not an integer >= 0")
            tps = e["tokens_per_step"]
            if tps < 1:
                raise ValueError(f"tokens_per_step {tps}: no tokens per step, no data")
            for key in ("data_cpu_hours", "start_cpu_hours", "train_cpu_hours"):
                if e.get(key) is not None:
                    _number(e, key, lo=0)
            if not isinstance(e.get("x_hours_field") or "", str):
                raise ValueError(f"x_hours_field {e['x_hours_field']!r} is not a field name")
            data_h = float(e.get("data_cpu_hours") or 0.0)
            evals, last, last_h, clock = _read_clocked(metrics, tps, e.get("x_hours_field"))
            steps = int(e.get("steps", last))
            train_cpu_h = e.get("train_cpu_hours")
            train_cpu_h = None if train_cpu_h is None else float(train_cpu_h)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{who}: {err}") from None
        if last <= 0:
            raise ValueError(f"{who}: its metrics file {e['metrics']} logs no step")
        if steps < last:
            raise ValueError(f"{who}: steps {steps}, but its metrics log step {last}")
        if clock is None:
            if train_cpu_h is None:
                raise ValueError(
                    f"{who}: its metrics have no clock (no tokens_per_s"
                    + (f", no {e['x_hours_field']}" if e.get("x_hours_field") else "")
                    + "): give train_cpu_hours"
                )
            train_h = train_cpu_h
            evals = {s: (train_h * s / steps, l, u) for s, (_, l, u) in evals.items()}
            source = "ledger train_cpu_hours, linear in steps"
        else:
            # steps trained past the last log line: at the run's own mean rate
            train_h = last_h * steps / last
            source = clock + (f", extrapolated from step {last}" if steps > last else "")
        origin = None
        if e.get("continues") is not None:
            prev = by_name.get(e["continues"])
            if prev is None:
                raise ValueError(f"{who}: continues {e['continues']!r}, not an earlier run")
            start_t, start_h = prev["end_tokens"], prev["end_cpu_hours"]
            for key, have, tol in (
                ("start_tokens", start_t, 0),
                ("start_cpu_hours", start_h, START_HOURS_TOL),
            ):
                if key in e and abs(float(e[key]) - have) > tol:
                    raise ValueError(
                        f"{who}: {key} {e[key]}, but {prev['name']}, which it continues, "
                        f"ends at {have:.4g}: fix one (or drop {key})"
                    )
            if prev["evals"]:
                origin = prev["evals"][-1]
        else:
            start_t = int(e.get("start_tokens", 0))
            start_h = float(e.get("start_cpu_hours", 0.0))
        points = [
            dict(
                step=s,
                tokens=start_t + s * tps,
                cpu_hours=start_h + data_h + h,
                loss=l,
                tau=u,
            )
            for s, (h, l, u) in sorted(evals.items())
        ]
        run = dict(
            e,
            steps=steps,
            tokens=steps * tps,
            start_tokens=start_t,
            end_tokens=start_t + steps * tps,
            start_cpu_hours=start_h,
            data_cpu_hours=data_h,
            train_cpu_hours=train_h,
            end_cpu_hours=start_h + data_h + train_h,
            hours_source=source,
            last_tau=points[-1]["tau"] if points else None,
            best_tau=max(p["tau"] for p in points) if points else None,
            evals=points,
            origin=origin,
        )
        runs.append(run)
        by_name[e["name"]] = run
    return meta, runs


def project_ledger(runs, targets):
    """The power law tau - 1 = c * x^alpha fitted to the in-loop tau of the runs marked
    `main_line`, once against cumulative CPU-hours and once against cumulative training tokens
    (`project`), with the x at which each fit reaches each target; the tokens fit also gives
    the hours at the main line's mean cumulative CPU-hours per token."""
    main = [r for r in runs if r.get("main_line")]
    if not main:
        raise ValueError("no run of the ledger has main_line: true: nothing to fit")
    pts = [p for r in main for p in r["evals"]]
    end = main[-1]
    per_token = end["end_cpu_hours"] / end["end_tokens"] if end["end_tokens"] else None
    by_tokens = project(
        [(p["tokens"], p["cpu_hours"], p["loss"], p["tau"]) for p in pts], targets, per_token
    )
    by_hours = project([(p["cpu_hours"], 0.0, p["loss"], p["tau"]) for p in pts], targets)
    by_hours["targets"] = {
        t: {"cpu_hours": row["tokens"]} for t, row in by_hours["targets"].items()
    }
    for row in by_tokens["targets"].values():
        if "hours" in row:
            row["cpu_hours"] = row.pop("hours")
    return {
        "runs": [r["name"] for r in main],
        "against_cpu_hours": by_hours,
        "against_tokens": by_tokens,
        "now": {"cpu_hours": end["end_cpu_hours"], "tokens": end["end_tokens"]},
    }


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def ledger_table(runs, meta=None, projection=None):
    """The ledger as a markdown table (one row per run), its totals and the projection."""
    rows = [
        "| run | kind | steps | tokens (M) | cum. tokens (M) | data h | train h | cum. h "
        "| last tau | best tau | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        rows.append(
            f"| {r['label']} | {r['drafter_kind']} | {r['steps']} | {r['tokens'] / 1e6:.2f} "
            f"| {r['end_tokens'] / 1e6:.2f} | {r['data_cpu_hours']:.2f} "
            f"| {r['train_cpu_hours']:.2f} | {r['end_cpu_hours']:.2f} "
            f"| {_f(r['last_tau'], '.3f')} | {_f(r['best_tau'], '.3f')} | {r['status']} |"
        )
    data = sum(r["data_cpu_hours"] for r in runs)
    train = sum(r["train_cpu_hours"] for r in runs)
    out = rows + [
        "",
        "CPU-hours (h): "
        + ((meta or {}).get("cpu_hours") or "wall hours of the machine that ran them").rstrip(".")
        + ". cum. h = start (what the run continued from) + data + train: the x of its last "
        "point; cum. tokens likewise.",
        "",
        f"Spent over the ledger: {data + train:.2f} h ({data:.2f} h data generation, "
        f"{train:.2f} h training, {len(runs)} runs).",
    ]
    for u in (meta or {}).get("unattributed_data", []):
        out.append(f"Not yet attributed to a run: {u.get('what')}, {u.get('cpu_hours')} h.")
    if projection:
        h, t, now = projection["against_cpu_hours"], projection["against_tokens"], projection["now"]
        out += [
            "",
            f"Extrapolated (a fit, not a measurement) over the in-loop tau of "
            f"{', '.join(projection['runs'])}, now at {now['cpu_hours']:.2f} h and "
            f"{now['tokens'] / 1e6:.2f}M tokens: tau - 1 = {h['c']:.3g} x hours^{h['alpha']:.2f}"
            f" and = {t['c']:.3g} x tokens^{t['alpha']:.2f} ({h['points']} points).",
            "",
            "| target tau | CPU-hours (hours fit) | tokens (tokens fit) | CPU-hours at the "
            "line's mean h/token |",
            "|---|---|---|---|",
        ]
        for target in h["targets"]:
            th, tt = h["targets"][target], t["targets"][target]
            out.append(
                f"| {target} | {th['cpu_hours']:,.0f} | {tt['tokens'] / 1e6:,.0f}M "
                f"| {_f(tt.get('cpu_hours'), ',.0f')} |"
            )
    return "\n".join(out) + "\n"


def _ledger_colors(runs, plt):
    """A colour per run: a family per drafter kind, a shade per run of the kind in order."""
    families = {"dflash": "Blues", "dflash2": "Greens", "eagle3": "Oranges"}
    spare = iter(["Purples", "Reds", "Greys", "YlOrBr"] * 4)
    kinds = {}
    for r in runs:
        kinds.setdefault(r["drafter_kind"], []).append(r["name"])
    for k in kinds:
        if k not in families:
            families[k] = next(spare)
    out = {}
    for k, names in kinds.items():
        for i, name in enumerate(names):
            shade = 0.75 if len(names) == 1 else 0.45 + 0.5 * i / (len(names) - 1)
            out[name] = plt.get_cmap(families[k])(shade)
    return out


def check_flags():
    """Every flag checked before anything is read, fitted, drawn or written: (target taus of
    --project or None, {what: path} of the files to write). One line (ValueError) for a bad
    one."""
    from dflash_jax.support import checks, outputs

    if FLAGS.ledger:
        if FLAGS.runs or FLAGS.groups or FLAGS.labels:
            raise ValueError("--ledger draws the ledger's runs: leave out --runs/--groups/--labels")
        for name in ("tokens_per_step", "x", "smooth"):
            if FLAGS[name].present:
                raise ValueError(f"--{name} is for --runs (the ledger gives each run's own)")
    else:
        if not FLAGS.runs:
            raise ValueError("--runs (or --ledger) is required")
        if FLAGS.table_out:
            raise ValueError("--table_out is written with --ledger only")
        checks.int_param("--tokens_per_step", FLAGS.tokens_per_step, lo=1)
        checks.int_param("--smooth", FLAGS.smooth, lo=1)
        if FLAGS.labels and len(FLAGS.labels) != len(FLAGS.runs):
            raise ValueError(
                f"--labels: {len(FLAGS.labels)} labels for {len(FLAGS.runs)} runs: one per run"
            )
        if FLAGS.groups:
            if len(FLAGS.groups) != len(FLAGS.runs):
                raise ValueError(
                    f"{len(FLAGS.groups)} groups for {len(FLAGS.runs)} runs: give one per run"
                )
            for g in FLAGS.groups:
                if not g.strip().isdigit():
                    raise ValueError(f"--groups: {g!r} is not a drafter index (0, 1, ...)")
    if not FLAGS.out:
        raise ValueError("--out (the figure to write) is required")
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(FLAGS.out)[1].lstrip(".").lower()
    if ext not in kinds:
        raise ValueError(
            f"--out {FLAGS.out}: not a figure file name (end it in .{', .'.join(sorted(kinds))})"
        )
    targets = project_targets(FLAGS.project) if FLAGS.project is not None else None
    json_out = FLAGS.json_out or os.path.splitext(FLAGS.out)[0] + ".json"
    files = {
        "--out": FLAGS.out,
        "--json_out" if FLAGS.json_out else "the JSON beside --out": json_out,
        "--table_out": FLAGS.table_out,
    }
    outputs.check_outputs(files, [FLAGS.ledger] + list(FLAGS.runs or []), create_dirs=True)
    return targets, {k: v for k, v in files.items() if v}


def _write(files, figure, named):
    """The figure (rendered in memory) and the texts in `named` {path: text} written whole, all
    or none (dflash_jax.support.outputs), their directories made."""
    from dflash_jax.support import outputs

    buf = io.BytesIO()
    figure.savefig(buf, format=os.path.splitext(FLAGS.out)[1].lstrip(".").lower(), dpi=110)
    for path in files.values():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    outputs.write_all({FLAGS.out: buf.getvalue(), **named})


def _main_ledger(targets, files):
    from dflash_jax.support import outputs

    meta, runs = read_ledger(FLAGS.ledger)
    metrics = [os.path.join(ROOT, r["metrics"]) for r in runs]
    outputs.check_outputs(files, metrics)  # an output that is a run's metrics file: refused
    projection = None
    if targets:
        try:
            projection = project_ledger(runs, targets)
        except ValueError as e:
            raise ValueError(f"--project: {e}") from None
    table = ledger_table(runs, meta, projection)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.lines import Line2D

    colors = _ledger_colors(runs, plt)
    handles, labels = [], []  # the legend: a line per run, in its style
    nrow = 2 if projection else 1
    fig, axes = plt.subplots(nrow, 2, figsize=(16, 4.6 * nrow), squeeze=False)
    ax_h, ax_t = axes[0]
    spans = sorted(
        {(r["start_cpu_hours"], r["data_cpu_hours"]) for r in runs if r["data_cpu_hours"] > 0}
    )
    for j, (x0, w) in enumerate(spans):
        ax_h.axvspan(
            x0, x0 + w, color="grey", alpha=0.12, lw=0, label=None if j else "data generation"
        )
    for r in runs:
        pts = ([r["origin"]] if r["origin"] else []) + r["evals"]
        if not pts:
            continue
        style = "--" if r["status"] in LOSING else "-"
        kw = dict(color=colors[r["name"]], ls=style, lw=1.6)
        label = f"{r['label']} [{r['status']}]"
        ax_h.plot([p["cpu_hours"] for p in pts], [p["tau"] for p in pts], **kw)
        ax_t.plot([p["tokens"] / 1e6 for p in pts], [p["tau"] for p in pts], **kw)
        for ax, key, scale in ((ax_h, "cpu_hours", 1), (ax_t, "tokens", 1e6)):
            ev = r["evals"]
            ax.plot(
                [p[key] / scale for p in ev],
                [p["tau"] for p in ev],
                "o",
                ms=4,
                color=colors[r["name"]],
                mfc="white" if r["status"] in LOSING else colors[r["name"]],
            )
        handles.append(
            Line2D([], [], marker="o", ms=4, **kw, mfc="white" if style == "--" else kw["color"])
        )
        labels.append(label)
        # the run's end (its CPU spent), where its last eval stops short of it
        ax_h.plot([r["end_cpu_hours"]], [pts[-1]["tau"]], "|", ms=9, color=colors[r["name"]])
    ax_h.set(
        xlabel="cumulative CPU-hours (data generation + training; | marks a run's end)",
        ylabel="in-loop tau (held-out, greedy)",
    )
    ax_t.set(xlabel="cumulative training tokens (M)", ylabel="in-loop tau (held-out, greedy)")
    for ax in (ax_h, ax_t):
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    span = ax_h.get_legend_handles_labels()  # the data-generation band, if any
    handles, labels = span[0] + handles, span[1] + labels
    ax_t.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    if projection:
        main = [p for r in runs if r.get("main_line") for p in r["evals"]]
        for ax, key, scale, fit, unit in (
            (axes[1][0], "cpu_hours", 1, projection["against_cpu_hours"], "h"),
            (axes[1][1], "tokens", 1e6, projection["against_tokens"], "M tokens"),
        ):
            xs = np.array([p[key] for p in main], float)
            ax.plot(xs / scale, [p["tau"] - 1.0 for p in main], "o", color="C0", ms=4)
            c, a = fit["c"], fit["alpha"]
            tkey = "cpu_hours" if key == "cpu_hours" else "tokens"
            far = max(row[tkey] for row in fit["targets"].values())
            grid = np.geomspace(xs[xs > 0].min(), max(far, xs.max()), 100)
            ax.set_xlim(xs[xs > 0].min() / 1.5 / scale, max(far, xs.max()) * 1.5 / scale)
            ax.plot(grid / scale, c * grid**a, "--", color="C0", label=f"tau-1 = {c:.2g} x^{a:.2f}")
            for target, row in fit["targets"].items():
                y = float(target) - 1.0
                ax.axhline(y, color="grey", lw=0.6, ls=":")
                ax.plot([row[tkey] / scale], [y], "x", color="black")
                ax.annotate(
                    f"tau {target}: {row[tkey] / scale:,.0f} {unit}",
                    (row[tkey] / scale, y),
                    fontsize=7,
                    ha="right",
                    va="bottom",
                )
            ax.set(
                xscale="log",
                yscale="log",
                ylabel="tau - 1 (main line)",
                xlabel=("cumulative CPU-hours, log" if key == "cpu_hours" else "tokens (M), log"),
                title="extrapolated (a fit, not a measurement)",
            )
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"{FLAGS.title}: every training run, tau against what it cost")
    fig.tight_layout()
    json_out = [p for w, p in files.items() if w not in ("--out", "--table_out")][0]
    from dflash_jax.support import provenance

    keep = [
        "name", "label", "drafter_kind", "status", "continues", "main_line", "steps", "tokens",
        "start_tokens", "end_tokens", "start_cpu_hours", "data_cpu_hours", "train_cpu_hours",
        "end_cpu_hours", "hours_source", "last_tau", "best_tau", "evals",
    ]  # fmt: skip
    record = json.dumps(
        {
            "ledger": FLAGS.ledger,
            "cpu_hours": meta.get("cpu_hours"),
            "runs": [{k: r[k] for k in keep if k in r} for r in runs],
            "totals": {
                "data_cpu_hours": sum(r["data_cpu_hours"] for r in runs),
                "train_cpu_hours": sum(r["train_cpu_hours"] for r in runs),
            },
            "projection": projection,
            "table": table,
            **provenance.record(),
        },
        indent=1,
        allow_nan=False,
    )
    texts = {json_out: record}
    if FLAGS.table_out:
        texts[FLAGS.table_out] = table
    _write(files, fig, texts)
    sys.stdout.write(table)
    print(f"wrote {FLAGS.out}, {json_out}" + (f", {FLAGS.table_out}" if FLAGS.table_out else ""))


def main(argv):
    del argv
    targets, files = check_flags()
    if FLAGS.ledger:
        return _main_ledger(targets, files)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = FLAGS.labels or [os.path.basename(p) for p in FLAGS.runs]
    runs = read_runs(FLAGS.runs, FLAGS.tokens_per_step, FLAGS.groups)
    hours = FLAGS.x == "hours"
    xlabel = "training hours (the trainer's clock)" if hours else "training tokens (M)"
    groups = [int(g) for g in FLAGS.groups] if FLAGS.groups else None
    projection = None
    if targets:
        first = [r for r, g in zip(runs, groups or [0] * len(runs)) if g == 0]
        evals = [e for _, ev in first for e in ev]
        last = max((tr[-1] for tr, _ in first if tr), default=None)
        per_token = last[1] / last[0] if last and last[0] > 0 and last[1] > 0 else None
        try:
            projection = project(evals, targets, per_token)
        except ValueError as e:
            raise ValueError(f"--project: {e}") from None
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
    points = {
        label: {
            "train": [(t, round(h, 4), l) for t, h, l in train],
            "eval": [dict(tokens=t, hours=round(h, 4), loss=l, tau=u) for t, h, l, u in evals],
        }
        for (train, evals), label in zip(runs, labels)
    }
    from dflash_jax.support import provenance

    record = json.dumps(
        {
            "tokens_per_step": FLAGS.tokens_per_step,
            "groups": FLAGS.groups,
            "runs": points,
            "projection": projection,
            **provenance.record(),
        },
        indent=1,
        allow_nan=False,
    )
    json_out = [p for w, p in files.items() if w != "--out"][0]
    _write(files, fig, {json_out: record})
    print(f"wrote {FLAGS.out}, {json_out}")


if __name__ == "__main__":
    from dflash_jax.support import cli

    _define_flags()
    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
