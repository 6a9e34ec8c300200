"""A MoE target's decode steps from the compiled programs: per batch and block size, the HBM
bytes per chip of one AR step and one DFlash step (the dry run's HBM model over the compiled
loop, the routed grouped matmul charged the experts it fetches on average under uniform
routing, the floor's statistic; beside it the bound, the experts its grid can fetch), their
analytic floors
(experts at the share the step's tokens route to, `hbm.routed_fraction`), and the break-even
acceptance length (DFlash step time / AR step time, the projected step times). PROJECTED from
compiles on this CPU machine; nothing is measured on a TPU.

    python benchmarks/experiments/moe/moe_compiled.py \\
        --runs='benchmarks/results/moe/compiled/*.json' --out=benchmarks/results/moe/compiled.md

Each JSON is a dry run (`python -m dflash_jax.dry_run --mode=infer ... --json_out=...`); a run
that compiled only the DFlash loop takes its AR step from the run of the same batch, chip and
mesh that has one.
"""

from __future__ import annotations

import glob
import json
import os
import sys

from absl import flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, ROOT)

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_string("runs", "benchmarks/results/moe/compiled/*.json", "Dry-run JSONs (glob).")
    flags.DEFINE_float("tau", 6.1, "An acceptance length for the speedup column.")
    flags.DEFINE_string("out", None, "Write the table here (markdown; JSON beside it).")


def row_of(run: dict) -> dict:
    """The figures of one dry run: its key (chip, mesh, batch, block) and steps."""
    from dflash_jax.dry_run.chips import hbm_step_times

    s = run["settings"]
    steps = run["roofline"]["steps"]
    out = {
        "chip": run["topology"],
        "mesh": run["mesh"],
        "batch": s["batch"],
        "block": s["block_size"],
        "commit": run.get("commit", "")[:7],
    }
    for kind in ("ar", "dflash"):
        step = steps.get(f"{kind}_step")  # the compiled loop's figures (dry run's roofline)
        if step is not None:
            floor = run["sizes"][f"{kind}_floor_bytes"]
            out[kind] = {
                "hbm_bytes": step["hbm_bytes"],
                "bound_bytes": step.get("hbm_bytes_bound", step["hbm_bytes"]),
                "floor_bytes": floor,
                "time_s": hbm_step_times(step, floor, run["chip"])["time_s"],
            }
    return out


def table(rows, tau: float):
    """Rows with the AR step filled in from a run of the same chip, mesh and batch; the
    break-even tau and the speedup at `tau` (capped at block + 1)."""
    ars = {(r["chip"], str(r["mesh"]), r["batch"]): r["ar"] for r in rows if "ar" in r}
    out = []
    for r in sorted(rows, key=lambda r: (r["chip"], str(r["mesh"]), r["batch"], -r["block"])):
        ar = ars.get((r["chip"], str(r["mesh"]), r["batch"]))
        if ar is None or "dflash" not in r:
            continue
        d = r["dflash"]
        even = d["time_s"] / ar["time_s"]
        t = min(tau, r["block"] + 1)
        out.append(
            {
                **{k: r[k] for k in ("chip", "mesh", "batch", "block", "commit")},
                "ar_hbm_gb": ar["hbm_bytes"] / 1e9,
                "ar_over_floor": ar["hbm_bytes"] / ar["floor_bytes"],
                "ar_bound_gb": ar.get("bound_bytes", ar["hbm_bytes"]) / 1e9,
                "dflash_hbm_gb": d["hbm_bytes"] / 1e9,
                "dflash_bound_gb": d.get("bound_bytes", d["hbm_bytes"]) / 1e9,
                "dflash_over_floor": d["hbm_bytes"] / d["floor_bytes"],
                "floor_break_even_tau": d["floor_bytes"] / ar["floor_bytes"],
                "break_even_tau": even,
                "tau": t,
                "speedup": t / even,
            }
        )
    return out


def markdown(out, tau: float) -> str:
    lines = [
        "| chip (mesh) | batch | block | AR GB/step (x floor; bound) "
        "| DFlash GB/step (x floor; bound) "
        f"| break-even tau (floor bytes ratio) | PROJECTED speedup at tau {tau:g} | commit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in out:
        m = r["mesh"]
        mesh = ",".join(f"{k}={v}" for k, v in m.items()) if isinstance(m, dict) else m
        capped = "" if r["tau"] == tau else f" (tau {r['tau']:g})"
        lines.append(
            f"| {r['chip']} ({mesh}) | {r['batch']} | {r['block']} "
            f"| {r['ar_hbm_gb']:.2f} ({r['ar_over_floor']:.2f}x; {r['ar_bound_gb']:.2f}) "
            f"| {r['dflash_hbm_gb']:.2f} ({r['dflash_over_floor']:.2f}x; "
            f"{r['dflash_bound_gb']:.2f}) "
            f"| {r['break_even_tau']:.2f} ({r['floor_break_even_tau']:.2f}) "
            f"| {r['speedup']:.2f}x{capped} | {r['commit']} |"
        )
    return "\n".join(lines)


def main(argv):
    del argv
    paths = sorted(glob.glob(FLAGS.runs))
    if not paths:
        raise ValueError(f"--runs {FLAGS.runs!r} matches no file")
    rows = []
    for p in paths:
        with open(p) as f:
            rows.append(row_of(json.load(f)))
    out = table(rows, FLAGS.tau)
    text = markdown(out, FLAGS.tau)
    print(text)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(text + "\n")
        from dflash_jax.support import provenance

        with open(os.path.splitext(FLAGS.out)[0] + ".json", "w") as f:
            record = {"tau": FLAGS.tau, "runs": paths, "rows": out}
            json.dump({**provenance.record(), **record}, f, indent=1)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    define_flags()
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
