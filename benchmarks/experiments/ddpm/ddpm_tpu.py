"""Multi-pass drafting on a TPU, PROJECTED: what a DFlash step with K drafter passes costs
against an autoregressive step, from the compiled Qwen3-8B decode loops on v5e-8 at 32K
(`python -m dflash_jax.dry_run ... --denoise_steps=K`), and what tau gain over one pass each K
needs to pay for itself; beside it the gains the tiny pair's drafters measured on this CPU
(`benchmarks/experiments/ddpm/ddpm_tau.py`'s JSON).

    python benchmarks/experiments/ddpm/ddpm_tpu.py [--write]   # --write: results/ddpm/tpu/README.md

The dry runs (each ~4 minutes on 2 CPU cores; K = 1 is the inference table's row):

    python -m dflash_jax.dry_run --topology=v5e:2x4 --model=qwen3_8b --mode=infer \\
        --context=32768 --max_new_tokens=1024 --denoise_steps=K \\
        --json_out=benchmarks/results/ddpm/tpu/qwen3_8b_v5e-2x4_ctx32768_denoiseK.json

The step times are the dry run's HBM model (bytes of the compiled step over the chip's
bandwidth, plus the collectives and a fixed latency per kernel), the figure of the README's
TPU table. A K-pass step pays for itself when tau_K / tau_1 exceeds the ratio of its step
time to the one-pass step's.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DRY = {
    1: os.path.join(RESULTS, "tpu_dry_run", "qwen3_8b_v5e-2x4_ctx32768.json"),
    **{
        k: os.path.join(RESULTS, "ddpm", "tpu", f"qwen3_8b_v5e-2x4_ctx32768_denoise{k}.json")
        for k in (2, 4)
    },
}
CPU_JSON = os.path.join(RESULTS, "ddpm", "cpu.json")
OUT = os.path.join(RESULTS, "ddpm", "tpu", "README.md")
TAU_1 = 6.5  # the paper's Qwen3-8B tau at one pass (../shared/docs/dflash.md)

FLAGS = flags.FLAGS
flags.DEFINE_bool("write", False, f"write the page to {os.path.relpath(OUT, ROOT)}")


def steps():
    """{K: (dflash ms, ar ms, dflash floor ms, commit)} from the dry-run JSONs."""
    out = {}
    for k, path in sorted(DRY.items()):
        with open(path) as f:
            r = json.load(f)
        got = (r.get("settings") or {}).get("denoise_steps") or 1
        if got != k:
            raise SystemExit(f"{path}: compiled with denoise_steps={got}, expected {k}")
        p = r["roofline"]["projection"]["pallas"]
        out[k] = (
            1e3 * p["dflash"]["time_s"],
            1e3 * p["ar"]["time_s"],
            1e3 * p["dflash"]["floor_time_s"],
            r["commit"][:7] + ("+dirty" if r.get("dirty") else ""),
        )
    return out


def measured_gains():
    """{drafter: {K: tau_K / tau_1}} of the confidence schedule without remasking."""
    if not os.path.exists(CPU_JSON):
        return {}
    with open(CPU_JSON) as f:
        rows = json.load(f)["rows"]
    taus = {}
    for r in rows:
        if r["denoise_schedule"] == "confidence" and not r["remask"]:
            taus.setdefault(r["drafter"], {})[r["denoise_steps"]] = r["tau"]
    return {d: {k: t / ts[1] for k, t in ts.items()} for d, ts in taus.items() if 1 in ts}


def page() -> str:
    st, gains = steps(), measured_gains()
    one = st[1][0]
    lines = [
        "# Multi-pass drafting on a TPU (PROJECTED)",
        "",
        "Qwen3-8B with its 5-layer drafter on v5e-8 (tensor=8), batch 1, 32K context, block 16:",
        "the compiled decode loops' HBM model (not measured on a TPU). Made by "
        "`python benchmarks/experiments/ddpm/ddpm_tpu.py --write` from the dry-run JSONs beside "
        "it (commands in the script's docstring and in each JSON).",
        "",
        "| K passes | DFlash step ms | AR step ms | DFlash / AR | step / one-pass step "
        "(tau gain that pays) | speedup at tau "
        f"{TAU_1} x gain | commit |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for k, (d, a, _, commit) in st.items():
        lines.append(
            f"| {k} | {d:.3f} | {a:.3f} | {d / a:.3f} | {d / one:.3f} "
            f"(+{100 * (d / one - 1):.1f}%) | {TAU_1 * a / d:.2f}x x gain | {commit} |"
        )
    if gains:
        lines += [
            "",
            "tau_K / tau_1 measured on the bundled tiny pair (`benchmarks/results/ddpm/cpu.json`), "
            "and the speedup over AR that gain would give the Qwen3-8B step above (tau "
            f"{TAU_1} x gain at one pass), where it pays (gain above the step ratio):",
            "",
            "| drafter | " + " | ".join(f"K={k}" for k in st) + " |",
            "|---|" + "---:|" * len(st),
        ]
        for name, g in gains.items():
            cells = []
            for k, (d, a, _, _) in st.items():
                if k not in g:
                    cells.append("-")
                    continue
                pays = "one pass" if k == 1 else "pays" if g[k] > d / one else "does not pay"
                cells.append(f"{g[k]:.3f}: {TAU_1 * g[k] * a / d:.2f}x ({pays})")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    text = page()
    print(text)
    if FLAGS.write:
        with open(OUT, "w") as f:
            f.write(text)
        print(f"wrote {os.path.relpath(OUT, ROOT)}")


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
