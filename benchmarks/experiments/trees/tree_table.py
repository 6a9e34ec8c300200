"""Draft trees on TPU, PROJECTED: the DFlash/AR step ratio of the compiled tree-verify loops
(`python -m dflash_jax.dry_run ... --tree_budget=B`, JSONs in benchmarks/results/tree_budget/)
beside the chain's (benchmarks/results/tpu_dry_run/), under the HBM model, and what a tree must
add to tau to beat the chain: a tree of step ratio r_B beats the chain (r_chain) when
tau_tree / tau_chain > r_B / r_chain.

    python benchmarks/experiments/trees/tree_table.py [--write]   # --write: into the results README

It also renders the CPU measurement (`benchmarks/experiments/trees/tree_budget.py`'s cpu.json)
as a table.

DDTree's published acceptance (z-lab drafters, Qwen3-8B, 8x H200, HF transformers), chain ->
tree: MATH-500 7.79 -> 10.73, HumanEval 6.61 -> 9.67, MT-Bench 4.28 -> 6.58 (tau ratios 1.38,
1.46, 1.54), at the budgets that were fastest there (256-512 nodes). The speedup columns are
tau / step ratio at those published taus, for the chain and for trees of >= 256 nodes only:
projections from compiled programs and published figures, nothing measured on a TPU.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TREES = os.path.join(ROOT, "benchmarks", "results", "tree_budget")
CHAIN = os.path.join(ROOT, "benchmarks", "results", "tpu_dry_run", "qwen3_8b_v5e-2x4_ctx32768.json")
# (dataset, chain tau, tree tau): DDTree (arXiv 2604.12989), Qwen3-8B, temperature 0.
PUBLISHED = (("MATH-500", 7.79, 10.73), ("HumanEval", 6.61, 9.67), ("MT-Bench", 4.28, 6.58))
MARK = "<!-- tree_table -->", "<!-- /tree_table -->"
CPU_MARK = "<!-- cpu_table -->", "<!-- /cpu_table -->"


def cpu_table(path: str = os.path.join(TREES, "cpu.json")) -> str:
    r = json.load(open(path))
    lines = [
        "| batch | verify | tokens verified / step | tau | decode tok/s | AR tok/s | vs AR |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        name = f"tree, {row['budget']} nodes" if row["budget"] else "chain"
        if row.get("confidence_threshold") is not None:
            name += f", confidence >= {row['confidence_threshold']}"
            verified = "4 / 8 / 16"
        else:
            verified = str(row["verify_tokens"])
        lines.append(
            f"| {row['batch']} | {name} | {verified} | {row['tau']:.2f} | "
            f"{row['decode_tokens_per_s']:.0f} | {row['ar_decode_tokens_per_s']:.0f} | "
            f"{row['speedup_vs_ar']:.2f}x |"
        )
    lines.append(f"\n(commit {(r.get('commit') or '')[:7]}{', dirty' if r.get('dirty') else ''})")
    return "\n".join(lines)


def _write(doc: str, mark, text: str) -> str:
    a, b = doc.index(mark[0]) + len(mark[0]), doc.index(mark[1])
    return doc[:a] + "\n" + text + "\n" + doc[b:]


def _step(path: str):
    r = json.load(open(path))
    steps = r["roofline"]["steps"]
    ar, df = steps["ar"], steps["dflash"]
    return {
        "budget": r["settings"].get("tree_budget"),
        "ratio": df["time_s"] / ar["time_s"],
        "ar_ms": ar["time_s"] * 1e3,
        "dflash_ms": df["time_s"] * 1e3,
        "hbm_over_floor": df["hbm_over_floor"],
        "collectives": df["collectives"],
        "commit": (r.get("commit") or "")[:7],
        "dirty": r.get("dirty"),
    }


def rows():
    out = [dict(_step(CHAIN), name="chain (block 16)", verify=16)]
    paths = glob.glob(os.path.join(TREES, "qwen3_8b_v5e-2x4_ctx32768_tree*.json"))
    for p in sorted(paths, key=lambda p: int(re.search(r"tree(\d+)", p).group(1))):
        s = _step(p)
        out.append(dict(s, name=f"tree, {s['budget']} nodes", verify=s["budget"] + 1))
    return out


def table(rs) -> str:
    chain = rs[0]["ratio"]
    head = (
        "| verify | tokens / step | AR ms | DFlash ms | DFlash / AR step | HBM / floor | "
        "collectives | tau gain to beat the chain | "
        + " | ".join(f"speedup at {d} tau {c} / {t}" for d, c, t in PUBLISHED)
        + " | commit |"
    )
    lines = [head, "|" + "---|" * (9 + len(PUBLISHED))]
    for r in rs:
        gain = r["ratio"] / chain
        tau_cols = []
        for _, c, t in PUBLISHED:  # the published tree taus are those of 256-512 nodes
            if r["budget"] is None:
                tau_cols.append(f"{c / r['ratio']:.2f}x")
            elif r["budget"] >= 256:
                tau_cols.append(f"{t / r['ratio']:.2f}x")
            else:
                tau_cols.append("-")
        lines.append(
            f"| {r['name']} | {r['verify']} | {r['ar_ms']:.2f} | {r['dflash_ms']:.2f} | "
            f"{r['ratio']:.3f}x | {r['hbm_over_floor']:.2f} | {r['collectives']} | "
            f"{'-' if r['budget'] is None else f'x{gain:.3f}'} | "
            + " | ".join(tau_cols)
            + f" | {r['commit']}{' (dirty)' if r['dirty'] else ''} |"
        )
    return "\n".join(lines)


def main(argv):
    text = table(rows())
    print(text)
    cpu = cpu_table()
    print(cpu)
    if "--write" in argv:
        path = os.path.join(TREES, "README.md")
        doc = _write(_write(open(path).read(), MARK, text), CPU_MARK, cpu)
        open(path, "w").write(doc)
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
