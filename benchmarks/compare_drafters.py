"""The paper's comparison on one target: DFlash, DFlash 2, EAGLE-3 and prompt lookup beside
autoregressive decoding, by real decoding on the same prompts, and projected for accelerators
from dry runs of each drafter's own decode loop (issue 43).

  python benchmarks/compare_drafters.py --target=smollm2-135m-instruct \
      --drafter=assets/smollm2-135m-instruct/drafter,assets/smollm2-135m-instruct/drafter_dflash2,assets/smollm2-135m-instruct/drafter_eagle3,prompt_lookup \
      --block_sizes=16,16,8,8 --datasets=mt_bench,humaneval --temperatures=0,1 \
      --num_prompts=4 --max_new_tokens=64 --batch_size=4 \
      --dry_runs='benchmarks/results/smollm2/compare/dry_runs/*.json' \
      --json_out=benchmarks/results/smollm2/compare/compare_drafters.json

Per drafter, dataset and temperature (the first turn of each row through the target's chat
template, `--batch_size` prompts per `generate` call, the same seed everywhere):
- tau: tokens committed per target pass, the mean over responses (z-lab's) and over all steps;
  target passes per token = 1 / tau over steps (autoregressive decoding: 1);
- the CPU speedup, measured: autoregressive decode seconds per token over the drafter's, both
  runs side by side in this process (compile time excluded; the drafter's own passes
  included). Greedy outputs must equal autoregressive decoding token for token (a failure of
  the run if not); at T=1 they are equal in distribution only;
- projected speedups, one per topology in `--dry_runs` (JSONs of `python -m dflash_jax.dry_run
  --mode=infer --drafter=KIND --block_size=N ...`, see the results README for the commands):
  tau over steps x (AR step time / the drafter's step time), matched by drafter kind and block
  size, the drafter's step including its own passes (K sequential EAGLE-3 steps, one DFlash
  pass, a lookup), under two models: "compiled", the HBM bytes counted in each compiled loop
  (what the compiler made of both loops, e.g. a weight kept in VMEM across steps, or a 1-row
  matmul emitted as products written then reduced), and "floor", the bytes each step must read
  at least. PROJECTED: compiled for abstract devices, never run on them.

Writes the JSON (provenance, every figure), a Markdown table (`.md`) and a plot (`.png`), whole
(all three or none; Ctrl-C / SIGTERM: one line, exit 130 / 143). Flags, every dry-run record
(`read_dry_runs`) and the output paths are checked before any model loads (one line, exit 2);
no drafter steps or no decode time is "no data" / "n/a", never a division by zero.

Committed results: `python benchmarks/compare_drafters.py --target=smollm2-135m-instruct
--drafter=assets/smollm2-135m-instruct/drafter,assets/smollm2-135m-instruct/drafter_dflash2,assets/smollm2-135m-instruct/drafter_eagle3,prompt_lookup
--block_sizes=16,16,8,8 --datasets=mt_bench,humaneval --temperatures=0,1 --num_prompts=4
--max_new_tokens=64 --batch_size=4
--dry_runs='benchmarks/results/smollm2/compare/dry_runs/*.json'
--json_out=benchmarks/results/smollm2/compare/compare_drafters.json` (the dry runs' commands in
`benchmarks/results/smollm2/README.md`); the stage-5 and stage-6 comparisons' commands are in
their JSONs (`benchmarks/results/smollm2/stage{5,6}/compare_256.json`).
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
import sys
from typing import Dict, List, Optional

import numpy as np
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if __name__ == "__main__":  # Ctrl-C / SIGTERM from here on: one line, exit 130 / 143
    from dflash_jax.support import interrupts

    interrupts.guard("interrupted: nothing was written")

from benchmarks import drafter_grid, eval_tau  # noqa: E402

FLAGS = flags.FLAGS
AR = "autoregressive"


def define_flags():
    """The flags (defined when run as a script, so tests can import this module)."""
    flags.DEFINE_string("target", "smollm2-135m-instruct", "Target directory, GGUF or name.")
    flags.DEFINE_list(
        "drafter",
        [
            "assets/smollm2-135m-instruct/drafter",
            "assets/smollm2-135m-instruct/drafter_dflash2",
            "assets/smollm2-135m-instruct/drafter_eagle3",
            "prompt_lookup",
        ],
        "Drafters (DFlash / DFlash 2 / EAGLE-3 directories, prompt_lookup[:N-M]).",
    )
    flags.DEFINE_list(
        "block_sizes",
        ["16", "16", "8", "8"],
        "Block size per drafter (tokens a step verifies: x_last + block - 1 drafts), or one "
        "for all.",
    )
    flags.DEFINE_list("datasets", ["mt_bench", "humaneval"], "Datasets (eval_tau's sources).")
    flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures.")
    flags.DEFINE_integer("num_prompts", 4, "Rows per dataset (the first ones).")
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens per response.")
    flags.DEFINE_integer("batch_size", 4, "Prompts per generate call.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_string(
        "dry_runs", "", "Glob of dry-run JSONs of the target's shapes (projected speedups)."
    )
    flags.DEFINE_string("json_out", None, "Write the results here (.md and .png beside it).")


def drafter_kind(drafter) -> str:
    """ "dflash", "dflash2", "eagle3" or "prompt_lookup": what a dry run compiles for it."""
    from dflash_jax.drafters.eagle3 import Eagle3
    from dflash_jax.drafters.prompt_lookup import PromptLookup

    if isinstance(drafter, Eagle3):
        return "eagle3"
    if isinstance(drafter, PromptLookup):
        return "prompt_lookup"
    return "dflash2" if drafter.config.dflash2 else "dflash"


def block_sizes(values: List[str], n: int) -> List[int]:
    """--block_sizes as n integers (one value: for every drafter); ValueError, one line."""
    from dflash_jax.support import checks

    if len(values) not in (1, n):
        raise ValueError(f"--block_sizes: give 1 or {n} values (one per drafter), got {values}")
    out = []
    for v in values:
        try:
            size = int(str(v).strip())
        except ValueError:
            raise ValueError(f"--block_sizes: {v!r} is not an integer") from None
        lo, hi = checks.BLOCK_SIZE_MIN, checks.BLOCK_SIZE_MAX
        out.append(checks.int_param("--block_sizes", size, lo=lo, hi=hi))
    return out * n if len(out) == 1 else out


def measure(target, drafters, prompts, temperature, max_new_tokens, batch_size, stop, seed=0):
    """{label: {"acceptance": [[...] per prompt] (None for AR), "decode_s", "tokens",
    "identical"}} for token-id `prompts`: `drafters` {label: (drafter, block_size)} and
    autoregressive decoding (label `AR`) on the same batches and seeds, one after another per
    batch so that a load on the machine falls on all of them. decode_s: the decode loops'
    seconds (compiles excluded); tokens: the tokens they produced (padding rows included, as
    the loop runs them). Greedy: every output must equal AR's (AssertionError)."""
    from dflash_jax.decoding.generation import generate

    out = {AR: dict(acceptance=None, decode_s=0.0, tokens=0, identical=None)}
    for label in drafters:
        out[label] = dict(acceptance=[], decode_s=0.0, tokens=0, identical=0)
    for b0 in range(0, len(prompts), batch_size):
        batch = prompts[b0 : b0 + batch_size]
        padded = batch + [batch[-1]] * (batch_size - len(batch))  # one program per shape
        n = len(batch)
        kw = dict(temperature=temperature, seed=seed + b0, stop_token_ids=stop)
        ar = generate(target, None, padded, max_new_tokens, **kw)
        out[AR]["decode_s"] += ar.stats["decode_s"]
        out[AR]["tokens"] += sum(map(len, ar.tokens))
        for label, (drafter, bs) in drafters.items():
            res = generate(target, drafter, padded, max_new_tokens, block_size=bs, **kw)
            got = out[label]
            got["acceptance"] += [list(map(int, a)) for a in res.acceptance_lengths[:n]]
            got["decode_s"] += res.stats["decode_s"]
            got["tokens"] += sum(map(len, res.tokens))
            same = sum(a == b for a, b in zip(res.tokens[:n], ar.tokens[:n]))
            got["identical"] += same
            if temperature == 0 and same != n:
                raise AssertionError(f"{label}: greedy decoding differs from AR ({same}/{n} equal)")
    if temperature > 0:
        for label in drafters:
            out[label]["identical"] = None  # equal in distribution, not token for token
    return out


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def dry_run_problem(rec) -> Optional[str]:
    """What keeps `rec` from being a dry run `step_ratios` can read (None: it is one). A
    record without the AR and drafter loops side by side (no hbm_step_ratio) is one, unused."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    if not isinstance(rec.get("topology"), str) or not rec["topology"]:
        return "no topology"
    settings = rec.get("settings")
    if not isinstance(settings, dict):
        return "no settings"
    attention = settings.get("attention")
    if attention is not None and not (
        isinstance(attention, list) and all(isinstance(a, str) for a in attention)
    ):
        return f"settings.attention {attention!r} is not a list of names"
    roofline = rec.get("roofline", {})
    proj = roofline.get("projection", {}) if isinstance(roofline, dict) else None
    if not isinstance(proj, dict):
        return "roofline.projection is not an object"
    impl = (attention or list(proj) or [None])[0]
    p = proj.get(impl)
    if not isinstance(p, dict) or "hbm_step_ratio" not in p:
        return None
    block = settings.get("block_size")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        return f"settings.block_size {block!r} is not a block size"
    if not isinstance(settings.get("drafter", "dflash"), str):
        return f"settings.drafter {settings['drafter']!r} is not a drafter kind"
    where = f"roofline.projection.{impl}"
    if not _positive(p["hbm_step_ratio"]):
        return f"{where}.hbm_step_ratio {p['hbm_step_ratio']!r} is not a finite number > 0"
    for loop in ("ar", "dflash"):
        for key in ("time_s", "floor_time_s"):
            v = p.get(loop, {}).get(key) if isinstance(p.get(loop), dict) else None
            if not _positive(v):
                return f"{where}.{loop}.{key} {v!r} is not a finite number > 0"
    return None


def read_dry_runs(pattern: str):
    """(records, the file of each) of the dry-run JSONs matching the glob `pattern` (a file may
    hold a list: a run of several meshes), every record checked (`dry_run_problem`) before
    anything is measured; ValueError (one line) for no match, a file that is not JSON, a bad
    record, records of two models, or none with the loops side by side."""
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise ValueError(f"--dry_runs: no file matches {pattern!r}")
    records, sources = [], []
    for p in paths:
        try:
            with open(p, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--dry_runs: {p} is not a dry-run JSON ({e})") from None
        recs = data if isinstance(data, list) else [data]
        if not recs:
            raise ValueError(f"--dry_runs: {p} is an empty list: no dry run")
        for i, rec in enumerate(recs):
            problem = dry_run_problem(rec)
            if problem:
                where = p if len(recs) == 1 else f"{p} (record {i + 1})"
                raise ValueError(
                    f"--dry_runs: {where} is not a dry-run JSON of `python -m dflash_jax.dry_run "
                    f"--mode=infer`: {problem}"
                )
            records.append(rec)
            sources.append(p)
    models = sorted({str(r.get("model")) for r in records})
    if len(models) > 1:  # a step ratio is one model's: tau of this target times another's
        raise ValueError(f"--dry_runs: give the dry runs of one model (the target's), got {models}")
    if not step_ratios(records):
        raise ValueError(
            f"--dry_runs: none of the {len(records)} dry runs of {pattern!r} has the AR and "
            "drafter loops side by side (roofline.projection.*.hbm_step_ratio: run dry_run "
            "--mode=infer --drafter=KIND): nothing to project"
        )
    return records, sources


def step_ratios(records: List[dict]) -> Dict[str, Dict[tuple, dict]]:
    """{topology: {(drafter kind, block size): {"ratio", "floor_ratio", "ar_s", "step_s"}}}
    from dry-run JSONs: the drafter's decode step time over the AR step's (the HBM model, the
    first attention implementation), and the same under the analytic floor."""
    out: Dict[str, Dict[tuple, dict]] = {}
    for rec in records:
        settings = rec.get("settings", {})
        proj = rec.get("roofline", {}).get("projection", {})
        impl = (settings.get("attention") or list(proj) or [None])[0]
        p = proj.get(impl)
        if not p or "hbm_step_ratio" not in p:
            continue  # no AR and drafter loop side by side in this run
        key = (settings.get("drafter", "dflash"), int(settings["block_size"]))
        out.setdefault(rec["topology"], {})[key] = {
            "ratio": p["hbm_step_ratio"],
            "floor_ratio": p["dflash"]["floor_time_s"] / p["ar"]["floor_time_s"],
            "ar_s": p["ar"]["time_s"],
            "step_s": p["dflash"]["time_s"],
            "batch": settings.get("batch"),
            "mesh": rec.get("mesh"),
        }
    return out


def rows_of(measured, kinds, sizes, ratios, dataset, temperature) -> List[dict]:
    """One table row per decoder (AR first) for one dataset and temperature: tau, passes per
    token, the measured CPU speedup and the projected ones (None where no dry run matches)."""
    ar = measured[AR]
    ar_tpt = ar["decode_s"] / ar["tokens"] if ar["tokens"] and ar["decode_s"] > 0 else None
    rows = [
        dict(
            drafter=AR, kind="ar", block_size=1, dataset=dataset, temperature=temperature,
            tau=1.0, tau_steps=1.0, passes_per_token=1.0, cpu_speedup=1.0, identical=None,
            projected={topo: {"compiled": 1.0, "floor": 1.0} for topo in ratios},
        )
    ]  # fmt: skip
    for label, got in measured.items():
        if label == AR:
            continue
        s = drafter_grid.summarize(got["acceptance"])  # taus None: no steps, no data
        tpt = got["decode_s"] / got["tokens"] if got["tokens"] and got["decode_s"] > 0 else None
        key = (kinds[label], sizes[label])
        projected = {
            topo: (
                {
                    m: s["tau_steps"] / by[key][r]
                    for m, r in (("compiled", "ratio"), ("floor", "floor_ratio"))
                }
                if key in by and s["tau_steps"]
                else None
            )
            for topo, by in ratios.items()
        }
        rows.append(
            dict(
                drafter=label, kind=kinds[label], block_size=sizes[label], dataset=dataset,
                temperature=temperature, tau=s["tau"], tau_steps=s["tau_steps"],
                passes_per_token=1.0 / s["tau_steps"] if s["tau_steps"] else None,
                cpu_speedup=ar_tpt / tpt if ar_tpt and tpt else None,
                identical=got["identical"], steps=s["steps"],
                acceptance_histogram=s["acceptance_histogram"], projected=projected,
            )
        )  # fmt: skip
    return rows


def _x(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _proj(p: Optional[dict]) -> str:
    return "n/a" if p is None else f"{_x(p['compiled'])} / {_x(p['floor'])}"


def markdown(rows: List[dict], topologies: List[str]) -> str:
    head = "| T | dataset | drafter | block | tau | passes/token | CPU speedup (measured) | "
    head += "".join(f"{t} (projected: compiled / floor) | " for t in topologies)
    head += "greedy == AR |"
    lines = [head, "|" + "---|" * (8 + len(topologies))]
    for r in rows:
        same = "" if r["identical"] is None else f"{r['identical']}"
        cells = [
            f"{r['temperature']:g}", r["dataset"], r["drafter"], str(r["block_size"]),
            drafter_grid.fmt_tau(r["tau"]), drafter_grid.fmt_tau(r["passes_per_token"]),
            _x(r["cpu_speedup"]),
            *(_proj(r["projected"].get(t)) for t in topologies), same,
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: List[dict], topologies: List[str], path: str) -> None:
    """Bars per drafter: tau, the measured CPU speedup and each projected speedup, one colour
    per dataset and temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = list(dict.fromkeys(r["drafter"] for r in rows if r["drafter"] != AR))
    groups = list(dict.fromkeys((r["dataset"], r["temperature"]) for r in rows))
    panels = [("tau (tokens per target pass)", lambda r: r["tau"])]
    panels.append(("CPU speedup over AR (measured)", lambda r: r["cpu_speedup"]))
    for t in topologies:
        panels.append(
            (
                f"{t} speedup (PROJECTED, compiled loops)",
                lambda r, t=t: (r["projected"].get(t) or {}).get("compiled"),
            )
        )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    axes = np.atleast_1d(axes)
    x = np.arange(len(drafters))
    w = 0.8 / max(len(groups), 1)
    for ax, (title, value) in zip(axes, panels):
        for i, (d, t) in enumerate(groups):
            got = {
                r["drafter"]: value(r) for r in rows if (r["dataset"], r["temperature"]) == (d, t)
            }
            ys = [got.get(name) or 0.0 for name in drafters]
            ax.bar(x + i * w, ys, w, label=f"{d}, T={t:g}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(x + w * (len(groups) - 1) / 2, drafters, rotation=25, ha="right")
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    from dflash_jax.support import checks, outputs, provenance

    checks.int_param("--num_prompts", FLAGS.num_prompts, lo=1)
    checks.int_param("--max_new_tokens", FLAGS.max_new_tokens, lo=1)
    checks.int_param("--batch_size", FLAGS.batch_size, lo=1)
    temps = []
    for t in FLAGS.temperatures:
        try:
            temps.append(float(t))
        except ValueError:
            raise ValueError(f"--temperatures: {t!r} is not a number") from None
        if not np.isfinite(temps[-1]) or temps[-1] < 0:
            raise ValueError(f"--temperatures: {t!r} must be a finite number >= 0")
    checks.seed_param("--seed", FLAGS.seed)
    if not temps:
        raise ValueError("--temperatures: give one or more")
    datasets = drafter_grid.nonempty("--datasets", FLAGS.datasets)
    labels = [
        drafter_grid.drafter_label(d) for d in drafter_grid.nonempty("--drafter", FLAGS.drafter)
    ]
    sizes = dict(zip(labels, block_sizes(FLAGS.block_sizes, len(labels))))
    records, sources = read_dry_runs(FLAGS.dry_runs) if FLAGS.dry_runs else ([], [])
    models = sorted({str(r.get("model")) for r in records})
    ratios = step_ratios(records)
    files = drafter_grid.output_files(FLAGS.json_out, sorted(set(sources)))
    rows_in = {d: eval_tau.load_prompts(d, None, "auto", FLAGS.num_prompts) for d in datasets}
    for d, (turns, source) in rows_in.items():
        if not turns:
            raise ValueError(f"dataset {d} ({source}): no rows, no prompts to decode")
    target_dir, specs, labels, dirs = drafter_grid.resolve_pair(FLAGS.target, FLAGS.drafter)
    target, loaded, tok, render, how, stop = drafter_grid.load_pair(target_dir, labels, dirs)
    kinds = {label: drafter_kind(d) for label, d in loaded.items()}
    table_rows = []
    for t in temps:
        for d, (turns, source) in rows_in.items():
            prompts = drafter_grid.chat_prompts(tok, render, turns)
            got = measure(
                target, {k: (loaded[k], sizes[k]) for k in labels}, prompts, t,
                FLAGS.max_new_tokens, FLAGS.batch_size, stop, FLAGS.seed,
            )  # fmt: skip
            new = rows_of(got, kinds, sizes, ratios, d, t)
            for r in new:
                r.update(source=source, decode_s=got[r["drafter"]]["decode_s"])
                print(
                    f"T={t:g} {d} {r['drafter']}: tau {drafter_grid.fmt_tau(r['tau'])}, "
                    f"CPU {_x(r['cpu_speedup'])}",
                    flush=True,
                )
            table_rows += new
    topologies = sorted(ratios)
    table = markdown(table_rows, topologies)
    if models:
        table += f"\nProjections: dry runs of `{models[0]}` (PROJECTED, not measured).\n"
    print("\n" + table)
    if FLAGS.json_out:
        rec = dict(
            provenance.record(),
            target=FLAGS.target,
            drafters=dict(zip(labels, specs)),
            kinds=kinds,
            block_sizes=sizes,
            prompts=how,
            num_prompts=FLAGS.num_prompts,
            max_new_tokens=FLAGS.max_new_tokens,
            batch_size=FLAGS.batch_size,
            dry_run_model=models[0] if models else None,
            dry_runs=[
                {"file": p, "topology": r["topology"], "command": r.get("command")}
                for p, r in zip(sources, records)
            ],
            step_ratios={
                t: {f"{k}@{b}": v for (k, b), v in by.items()} for t, by in ratios.items()
            },
            rows=table_rows,
        )
        png = io.BytesIO()
        plot(table_rows, topologies, png)
        j, md, pic = files.values()
        outputs.write_all({j: json.dumps(rec, indent=1), md: table, pic: png.getvalue()})
        print(f"wrote {j}, {md}, {pic}")


if __name__ == "__main__":
    from dflash_jax.support import cli

    define_flags()
    cli.run(main)
