"""What DFlash 2 and a sliding window cost in the compiled decode loop (PROJECTED: dry runs
compiled for a topology on this CPU, never measured on the chip).

For one model and topology: the DFlash step of a DFlash drafter against a DFlash 2 drafter
(the published sizes: 2-tap convolutions in groups of 16, selector rank 256, top-16) at one
context, from the dry run's roofline and HBM model; and the drafter's context-cache bytes per
device at growing contexts, full attention against every layer sliding with a window.

    python benchmarks/experiments/dflash2/dflash2_cost.py --topology=v5e:2x4 --model=qwen3_8b \\
        --out=benchmarks/results/dflash2/v5e_8.json
    CUDA_VISIBLE_DEVICES=-1 JAX_PLATFORMS=cpu .venv312/bin/python \\
        benchmarks/experiments/dflash2/dflash2_cost.py --topology=h200 --model=qwen3_8b \\
        --out=benchmarks/results/dflash2/h200.json

Writes the JSON (the dry runs' figures) and a Markdown table beside it (.md).
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

FLAGS = flags.FLAGS
flags.DEFINE_string("topology", "v5e:2x4", "a TPU topology, h100 / h200, or cpu:N")
flags.DEFINE_string("model", "qwen3_8b", "a dry-run model preset")
flags.DEFINE_integer("context", 4096, "prompt tokens of the step comparison")
flags.DEFINE_string("window_contexts", "4096,32768", "contexts of the context-cache bytes")
flags.DEFINE_integer("window", 2048, "the sliding window")
flags.DEFINE_string("out", "", "JSON output (a .md table beside it)")


def _run(model, topology, context, drafter="dflash", window=None, programs=None):
    from dflash_jax.dry_run import cli
    from dflash_jax.dry_run.topology import topology_devices
    from dflash_jax.dry_run.programs import dry_run_infer

    devices, chip = topology_devices(topology)
    return dry_run_infer(
        model=model,
        mesh=f"tensor={len(devices)}",
        context=context,
        devices=devices,
        chip=chip,
        topology=topology,
        attention=(cli.default_attention(topology),),
        drafter=drafter,
        drafter_window=window,
        only=programs,
        step_costs=programs is None,
    )


def _step(r):
    """The projected DFlash and AR steps of the first attention impl: the HBM model's time
    (`time_s`) and the roofline's (`step_s`), DFlash's over AR's, and the HBM bytes a step
    reads."""
    proj = r["roofline"]["projection"]
    p = proj[next(iter(proj))]
    return {
        "dflash_hbm_model_ms": 1e3 * p["dflash"]["time_s"],
        # the cost-analysis roofline (TPU topologies; the GPU dry run gives the HBM model)
        "dflash_roofline_ms": 1e3 * p["dflash"].get("step_s", float("nan")),
        "ar_hbm_model_ms": 1e3 * p["ar"]["time_s"],
        "hbm_step_ratio": p["hbm_step_ratio"],
        "dflash_hbm_bytes": r["roofline"]["steps"]["dflash_step"]["hbm_bytes"],
        "dflash_collective_bytes": r["roofline"]["steps"]["dflash_step"]["collective_moved_bytes"],
    }


def main(argv):
    del argv
    if not FLAGS.out:
        raise app.UsageError("--out is required")
    from dflash_jax.support import provenance

    out = {
        **provenance.record(),
        "topology": FLAGS.topology,
        "model": FLAGS.model,
        "steps": {},
        "context_bytes": {},
    }
    for drafter in ("dflash", "dflash2"):
        r = _run(FLAGS.model, FLAGS.topology, FLAGS.context, drafter)
        out["steps"][drafter] = {"roofline": _step(r), "sizes": r["sizes"]}
        print(f"{drafter}: done", flush=True)
    for ctx in (int(c) for c in FLAGS.window_contexts.split(",")):
        for window in (None, FLAGS.window):
            r = _run(FLAGS.model, FLAGS.topology, ctx, "dflash", window, ("dflash_decode",))
            key = f"{ctx}/{'full' if window is None else window}"
            out["context_bytes"][key] = r["sizes"]["dflash_context_cache_bytes"]
            print(f"context {key}: {out['context_bytes'][key]} bytes", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.splitext(FLAGS.out)[0] + ".md", "w") as f:
        f.write(_table(out))
    print(_table(out))


def _table(out):
    lines = [
        f"{out['model']} on {out['topology']} (PROJECTED from compiled programs, not measured)",
        "",
        "| drafter | DFlash step, HBM model (ms) | roofline (ms) | HBM bytes | collective bytes "
        "| DFlash/AR step |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in out["steps"].items():
        x = s["roofline"]
        lines.append(
            f"| {name} | {x['dflash_hbm_model_ms']:.4f} | {x['dflash_roofline_ms']:.4f} | "
            f"{x['dflash_hbm_bytes']:,} | {x['dflash_collective_bytes']:,.0f} | "
            f"{x['hbm_step_ratio']:.3f} |"
        )
    a, b = (out["steps"][k]["roofline"]["dflash_hbm_model_ms"] for k in ("dflash", "dflash2"))
    lines += ["", f"DFlash 2 step / DFlash step (HBM model): {b / a:.3f}", ""]
    lines += ["| context / window | drafter context cache (bytes per device) |", "|---|---|"]
    lines += [f"| {k} | {v:,} |" for k, v in out["context_bytes"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
