"""Multi-step denoising (issue 31): tau at K = 1, 2, 4 drafter passes for drafters trained with
the fully masked objective and with the masked-diffusion mixture (`mask_schedule="mdlm"`), on
held-out code prompts, with the decode time per step on this CPU and every output checked
against autoregressive decoding.

    python benchmarks/experiments/ddpm/ddpm_tau.py \\
        --drafters=bundled=assets/tiny-code/drafter,control=/work/exp31/control/export/drafter,\\
mdlm=/work/exp31/ddpm/export/drafter \\
        --steps=1,2,4 --json_out=benchmarks/results/ddpm/cpu.json

tau: one batch of all `--num_prompts` held-out prompts (`benchmark_prompts`: functions of the
stdlib validation files, never training files), greedy, block 16. Cost: the same settings on
`--timing_prompts` prompts (of the longest length: one program) at batch 1, fastest of `--repeats` decode runs after a warm-up, with
autoregressive decoding timed in the same run: `step_ms` (decode seconds per target pass) and
`speedup_vs_ar` (tau per unit of step cost, in AR's units). `memory_bound_speedup` is a
first-order projection for a memory-bound accelerator step, tau / (1 + K r) with r the
drafter's weight bytes over the target's (`--draft_cost_ratio`, default 0.26 / 2.05: Qwen3-8B
and its drafter per chip on a v5e-8, the figures issue 31 quotes), i.e. a verify costing one
AR step and each drafter pass r of one; the TPU dry runs are the measurement.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List

from absl import app, flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_list(
        "drafters",
        ["bundled=assets/tiny-code/drafter", "mdlm=assets/tiny-code/drafter_ddpm"],
        "name=directory pairs (exported drafters of the bundled target).",
    )
    flags.DEFINE_list("steps", ["1", "2", "4"], "Denoising passes K.")
    flags.DEFINE_list(
        "variants",
        ["fixed", "remask"],
        "Also, at the largest K, the 'fixed' (left-to-right) schedule and remasking.",
    )
    flags.DEFINE_integer("num_prompts", 40, "Held-out prompts for tau (one batch).")
    flags.DEFINE_integer("timing_prompts", 4, "Prompts timed at batch 1.")
    flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
    flags.DEFINE_integer("block_size", 16, "Block size.")
    flags.DEFINE_integer("repeats", 2, "Timed runs per setting (the fastest is kept).")
    flags.DEFINE_float("draft_cost_ratio", 0.26 / 2.05, "Drafter pass / verify cost (projection).")
    flags.DEFINE_string("data_dir", "/tmp/dflash_tfds", "TFDS data dir of the stdlib corpus.")
    flags.DEFINE_string("json_out", None, "Write the rows (and provenance) here.")
    flags.DEFINE_bool(
        "append",
        False,
        "Keep the rows of an existing --json_out for other drafters (each row has its own AR "
        "timing of the same run), and plot them all.",
    )


def _timed(fn, repeats: int):
    """(first result after a warm-up, fastest decode seconds, its steps)."""
    fn()  # compiles
    best, res = float("inf"), None
    for _ in range(repeats):
        r = fn()
        if r.stats["decode_s"] < best:
            best, res = r.stats["decode_s"], r
    return res, best


def _steps(res) -> int:
    return sum(len(a) for a in res.acceptance_lengths)


def rows_for(drafters: Dict[str, str], steps: List[int], variants: List[str]):
    import dflash_jax as dj
    from dflash_jax.data.prompts import benchmark_prompts
    from dflash_jax.data.tokenizer import load_tokenizer

    pair = os.path.join(ROOT, "assets", "tiny-code")
    target = dj.load_target(os.path.join(pair, "target"), dtype="float32")
    tok = load_tokenizer(os.path.join(pair, "target"))
    prompts = benchmark_prompts(tok, None, FLAGS.data_dir, FLAGS.num_prompts)
    # Timed at batch 1: prompts of the longest length only (one program per setting).
    longest = max(len(p) for p in prompts)
    timing = [[p] for p in prompts if len(p) == longest][: FLAGS.timing_prompts]
    new, bs = FLAGS.max_new_tokens, FLAGS.block_size
    ar = dj.generate(target, None, prompts, new)
    ar_t = []
    for p in timing:
        r, s = _timed(lambda: dj.generate(target, None, p, new), FLAGS.repeats)
        ar_t.append((r, s))
    ar_step_ms = 1e3 * sum(s for _, s in ar_t) / sum(_steps(r) for r, _ in ar_t)
    print(f"{len(prompts)} prompts; AR {ar_step_ms:.2f} ms/step at batch 1", flush=True)
    settings = [(k, "confidence", False) for k in steps]
    kmax = max(steps)
    if "fixed" in variants:
        settings.append((kmax, "fixed", False))
    if "remask" in variants and kmax >= 3:
        settings.append((kmax, "confidence", True))
    rows = []
    for name, path in drafters.items():
        drafter = dj.load_drafter(path if os.path.isabs(path) else os.path.join(ROOT, path), target)
        for k, schedule, remask in settings:
            kw = dict(block_size=bs, denoise_steps=k, denoise_schedule=schedule, remask=remask)
            res = dj.generate(target, drafter, prompts, new, **kw)
            if res.tokens != ar.tokens:
                raise SystemExit(f"{name} K={k} {schedule} remask={remask}: output differs from AR")
            secs, nsteps = 0.0, 0
            for p, (ar_r, _) in zip(timing, ar_t):
                r, s = _timed(lambda: dj.generate(target, drafter, p, new, **kw), FLAGS.repeats)
                if r.tokens != ar_r.tokens:
                    raise SystemExit(f"{name} K={k}: batch-1 output differs from AR")
                secs, nsteps = secs + s, nsteps + _steps(r)
            step_ms = 1e3 * secs / nsteps
            row = {
                "drafter": name,
                "denoise_steps": k,
                "denoise_schedule": schedule,
                "remask": remask,
                "tau": round(res.tau, 3),
                "step_ms": round(step_ms, 3),
                "ar_step_ms": round(ar_step_ms, 3),
                "speedup_vs_ar": round(res.tau * ar_step_ms / step_ms, 3),
                "memory_bound_speedup": round(res.tau / (1 + k * FLAGS.draft_cost_ratio), 3),
                "identical_to_ar": True,
            }
            rows.append(row)
            print(
                f"{name:>8} K={k} {schedule:>10}{' remask' if remask else '':7} "
                f"tau {res.tau:5.3f}  {step_ms:6.2f} ms/step  {row['speedup_vs_ar']:.2f}x AR  "
                f"(memory-bound {row['memory_bound_speedup']:.2f}x)",
                flush=True,
            )
    return rows, len(prompts)


def table(rows) -> str:
    """The README's Markdown table of the rows."""
    out = [
        "| drafter | K | schedule | tau | ms / step (batch 1) | vs AR (CPU) | memory-bound projection |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        sched = r["denoise_schedule"] + (" + remask" if r["remask"] else "")
        out.append(
            f"| {r['drafter']} | {r['denoise_steps']} | {sched} | {r['tau']:.3f} | "
            f"{r['step_ms']:.2f} (AR {r['ar_step_ms']:.2f}) | {r['speedup_vs_ar']:.2f}x | "
            f"{r['memory_bound_speedup']:.2f}x |"
        )
    return "\n".join(out)


def plot(rows, path: str, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["drafter"] for r in rows):
        rs = [
            r
            for r in rows
            if r["drafter"] == name and r["denoise_schedule"] == "confidence" and not r["remask"]
        ]
        ks = [r["denoise_steps"] for r in rs]
        ax1.plot(ks, [r["tau"] for r in rs], "o-", label=name)
        ax2.plot(ks, [r["speedup_vs_ar"] for r in rs], "o-", label=f"{name} (CPU)")
        ax2.plot(ks, [r["memory_bound_speedup"] for r in rs], "x--", label=f"{name} (projection)")
    for ax, label in ((ax1, "tau (tokens per target pass)"), (ax2, "speedup over AR")):
        ax.set_xlabel("drafter passes K")
        ax.set_xticks(sorted({r["denoise_steps"] for r in rows}))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv):
    del argv
    try:
        steps = [int(s) for s in FLAGS.steps]
        drafters = dict(d.split("=", 1) for d in FLAGS.drafters)
    except ValueError:
        raise app.UsageError("--steps: integers; --drafters: name=directory pairs") from None
    rows, n = rows_for(drafters, steps, FLAGS.variants)
    if FLAGS.json_out:
        from dflash_jax.support import provenance

        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
        runs = []
        if FLAGS.append and os.path.exists(FLAGS.json_out):
            with open(FLAGS.json_out) as f:
                old = json.load(f)
            runs = [r for r in old["runs"] if not set(r["drafters"]) & set(drafters)]
            keep = {d for r in runs for d in r["drafters"]}
            rows = [r for r in old["rows"] if r["drafter"] in keep] + rows
        runs.append({**provenance.record(), "drafters": drafters})
        with open(FLAGS.json_out, "w") as f:
            json.dump(
                {
                    **runs[-1],  # the run that wrote the file (command, commit)
                    "runs": runs,  # the commands (provenance) and the drafters each measured
                    "target": "assets/tiny-code/target (float32)",
                    "num_prompts": n,
                    "timing_prompts": FLAGS.timing_prompts,
                    "block_size": FLAGS.block_size,
                    "max_new_tokens": FLAGS.max_new_tokens,
                    "draft_cost_ratio": FLAGS.draft_cost_ratio,
                    "note": "tau over one batch of all prompts; step times at batch 1 on this CPU",
                    "rows": rows,
                },
                f,
                indent=1,
            )
        print(f"wrote {FLAGS.json_out}")
        path = os.path.splitext(FLAGS.json_out)[0] + ".png"
        plot(rows, path, f"tau against drafter passes, bundled target, block {FLAGS.block_size}")
        print(f"wrote {path}")
        print(table(rows))


if __name__ == "__main__":
    define_flags()
    from dflash_jax.support import cli

    cli.run(main)
