"""Decoding under load, PROJECTED from compiled TPU programs (libtpu on this CPU machine, no
TPU): per batch size, the HBM model's step time (`dflash_jax/dry_run/hbm.py`) of the
autoregressive loop and of the DFlash loop at each block size, whether the step is compute- or
HBM-bound, the DFlash / AR step ratio (the tau a block must reach to break even) and the
projected tokens/s per chip at the taus given.

    python benchmarks/experiments/under_load/under_load.py --model=qwen3_8b --topology=v5e:2x4 \\
        --mesh=tensor=8 --context=4096 --max_new_tokens=256 --batches=1,4,16,64 --blocks=16,8,4 \\
        --tau=16:6.5 --json_out=benchmarks/results/under_load/qwen3_8b_v5e-8_ctx4096.json

`--tau` maps block sizes to acceptance lengths for the tokens/s columns (the DFlash paper's
Qwen3-8B figure is 6.5 at block 16; none is published for smaller blocks, so they get the
break-even column only unless a tau is given). tokens/s per chip = batch x tokens per step /
step time / chips. The plot (`--plot`, next to the JSON by default) shows the step ratio per
block against batch, and the tokens/s per chip where a tau is known.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List

from absl import app, flags

from dflash_jax.support import cli

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_string("model", "qwen3_8b", "Dry-run preset (qwen3_8b, tiny, ...).")
    flags.DEFINE_string("topology", "v5e:2x4", "TPU topology (abstract devices).")
    flags.DEFINE_string("mesh", "tensor=8", "Device mesh.")
    flags.DEFINE_integer("context", 4096, "Prompt tokens.", lower_bound=1)
    flags.DEFINE_integer("max_new_tokens", 256, "New tokens.", lower_bound=1)
    flags.DEFINE_list("batches", ["1", "4", "16", "64"], "Batch sizes.")
    flags.DEFINE_list("blocks", ["16", "8", "4"], "DFlash block sizes.")
    flags.DEFINE_list("tau", ["16:6.5"], "block:tau pairs for the tokens/s columns.")
    flags.DEFINE_string("json_out", None, "Write the rows (and provenance) here.")
    flags.DEFINE_string("plot", None, "PNG path (default: beside --json_out).")


def _ints(name: str, values: List[str]) -> List[int]:
    try:
        out = [int(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{name} wants comma-separated integers, got {values}") from None
    if not out or min(out) < 1:
        raise app.UsageError(f"--{name} wants integers >= 1, got {values}")
    return out


def _taus(values: List[str]) -> Dict[int, float]:
    out = {}
    for v in values:
        block, _, tau = v.partition(":")
        try:
            out[int(block)] = float(tau)
        except ValueError:
            raise app.UsageError(f"--tau wants block:tau pairs (16:6.5), got {v!r}") from None
        if not 1.0 <= out[int(block)] <= int(block):
            raise app.UsageError(f"--tau {v}: tau must lie in [1, block]")
    return out


def _step(r: dict, kind: str, chip: dict) -> dict:
    from dflash_jax.dry_run.chips import hbm_step_times

    s = r["roofline"]["steps"][f"{kind}_step"]
    return hbm_step_times(s, r["sizes"][f"{kind}_floor_bytes"], chip)


def rows_for(model, topology, mesh, context, max_new_tokens, batches, blocks, taus):
    """One row per (batch, block): AR and DFlash step times and the figures derived."""
    from dflash_jax import dry_run

    devices, chip = dry_run.topology_devices(topology)
    kw = dict(context=context, max_new_tokens=max_new_tokens, devices=devices, chip=chip)
    kw.update(attention=("pallas",))
    rows = []
    for b in batches:
        ar_r = dry_run.dry_run_infer(model, mesh, batch=b, only=("ar_decode",), **kw)
        ar = _step(ar_r, "ar", chip)
        chips = ar_r["devices"]
        print(f"batch {b}: AR step {ar['time_s'] * 1e3:.3f} ms", flush=True)
        for bs in blocks:
            d_r = dry_run.dry_run_infer(
                model, mesh, batch=b, block_size=bs, only=("dflash_decode",), **kw
            )
            d = _step(d_r, "dflash", chip)
            ratio = d["time_s"] / ar["time_s"]
            row = {
                "batch": b,
                "block": bs,
                "ar_step_ms": ar["time_s"] * 1e3,
                "dflash_step_ms": d["time_s"] * 1e3,
                "ratio": ratio,
                "break_even_tau": ratio,
                "ar_compute_bound": ar["compute_bound"],
                "dflash_compute_bound": d["compute_bound"],
                "dflash_compute_ms": d["compute_s"] * 1e3,
                "dflash_hbm_ms": d["hbm_s"] * 1e3,
                "ar_tokens_per_s_per_chip": b / ar["time_s"] / chips,
            }
            if bs in taus:
                row["tau"] = taus[bs]
                row["dflash_tokens_per_s_per_chip"] = b * taus[bs] / d["time_s"] / chips
                row["speedup"] = taus[bs] / ratio
            rows.append(row)
            print(
                f"  block {bs}: DFlash step {row['dflash_step_ms']:.3f} ms "
                f"({'compute' if d['compute_bound'] else 'HBM'}-bound), "
                f"{ratio:.2f}x AR" + (f", {row['speedup']:.2f}x at tau {taus[bs]}" if bs in taus else ""),
                flush=True,
            )  # fmt: skip
    return rows, chip


def table(rows) -> List[str]:
    lines = [
        "| batch | block | AR step ms | DFlash step ms | bound (DFlash) | DFlash / AR step "
        "(break-even tau) | AR tok/s/chip | DFlash tok/s/chip (tau) | speedup |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        tps = (
            f"{r['dflash_tokens_per_s_per_chip']:.0f} ({r['tau']:g})"
            if "tau" in r
            else "- (no published tau)"
        )
        lines.append(
            f"| {r['batch']} | {r['block']} | {r['ar_step_ms']:.3f} | {r['dflash_step_ms']:.3f} "
            f"| {'compute' if r['dflash_compute_bound'] else 'HBM'} | {r['ratio']:.2f} | "
            f"{r['ar_tokens_per_s_per_chip']:.0f} | {tps} | "
            f"{(format(r['speedup'], '.2f') + 'x') if 'speedup' in r else '-'} |"
        )
    return lines


def plot(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for bs in sorted({r["block"] for r in rows}, reverse=True):
        pts = [r for r in rows if r["block"] == bs]
        a1.plot([r["batch"] for r in pts], [r["ratio"] for r in pts], "o-", label=f"block {bs}")
        if all("tau" in r for r in pts):
            a2.plot(
                [r["batch"] for r in pts],
                [r["dflash_tokens_per_s_per_chip"] for r in pts],
                "o-",
                label=f"DFlash block {bs}, tau {pts[0]['tau']:g}",
            )
    ar = {r["batch"]: r["ar_tokens_per_s_per_chip"] for r in rows}
    a2.plot(list(ar), list(ar.values()), "s--", color="k", label="autoregressive")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    a1.set_ylabel("DFlash / AR step time (= break-even tau)")
    a2.set_ylabel("tokens/s per chip")
    a2.set_yscale("log")
    fig.suptitle(title + " (PROJECTED, HBM model)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    batches, blocks = _ints("batches", FLAGS.batches), _ints("blocks", FLAGS.blocks)
    taus = _taus(FLAGS.tau)
    if min(blocks) < 2:
        raise app.UsageError("--blocks: a DFlash block has at least 2 positions")
    rows, chip = rows_for(
        FLAGS.model,
        FLAGS.topology,
        FLAGS.mesh,
        FLAGS.context,
        FLAGS.max_new_tokens,
        batches,
        blocks,
        taus,
    )
    print("\n".join(table(rows)))
    if FLAGS.json_out:
        from dflash_jax.support import provenance

        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(
                {
                    **provenance.record(),
                    "model": FLAGS.model,
                    "topology": FLAGS.topology,
                    "mesh": FLAGS.mesh,
                    "context": FLAGS.context,
                    "max_new_tokens": FLAGS.max_new_tokens,
                    "chip": {k: chip[k] for k in ("chip", "hbm_bw", "bf16_flops", "ici_bw")},
                    "note": "PROJECTED (HBM model of the compiled loops), not measured",
                    "rows": rows,
                },
                f,
                indent=1,
            )
        print(f"wrote {FLAGS.json_out}")
    path = FLAGS.plot or (os.path.splitext(FLAGS.json_out)[0] + ".png" if FLAGS.json_out else None)
    if path:
        plot(rows, path, f"{FLAGS.model} on {FLAGS.topology} ({FLAGS.mesh}), {FLAGS.context} ctx")
        print(f"wrote {path}")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
