"""The demo's figures as a result file: `python infer.py` (what `make demo` runs: the bundled
pair, the default code prompt, 128 new tokens, checked against autoregressive decoding) run
--repeats times, each in its own process, what it printed and its totals.

    python benchmarks/demo.py --repeats=3 --json_out=benchmarks/results/tiny-code/demo.json
    python benchmarks/demo.py -- --max_new_tokens=64     # arguments after -- go to infer.py

JSON: the command, commit, date and machine (`dflash_jax.support.provenance`), the infer.py command,
per run the totals of `batch_runner.summarize` (tau, DFlash and autoregressive decode tokens/s,
speedup, outputs identical) and infer.py's stdout, and the median of each rate over the runs.
Rates from a shared machine are noisy: the runs say how much.

Committed results: `python benchmarks/demo.py --repeats=3
--json_out=benchmarks/results/tiny-code/demo.json`.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_integer("repeats", 1, "infer.py runs (one process each).")
    flags.DEFINE_string("json_out", None, "Write the result here.")


def run_once(extra, timeout=600):
    """One `python infer.py EXTRA --json_out=TMP`: (its totals, its stdout)."""
    from dflash_jax.frontend import batch_runner

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "demo.jsonl")
        r = subprocess.run(
            [sys.executable, os.path.join(ROOT, "infer.py"), *extra, f"--json_out={out}"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=timeout,
            check=False,
        )
        if r.returncode != 0:
            raise SystemExit(f"error: infer.py exited {r.returncode}: {r.stderr.strip()[-2000:]}")
        with open(out) as f:
            records = [json.loads(line) for line in f if line.strip()]
    stdout = r.stdout.replace(ROOT + os.sep, "").replace(ROOT, ".")
    # The per-run file's path is temporary: not part of the result.
    lines = [ln for ln in stdout.splitlines() if ln.strip() and not ln.startswith("wrote ")]
    return batch_runner.summarize(records), lines


def main(argv):
    extra = [a for a in argv[1:] if a != "--"]
    if FLAGS.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {FLAGS.repeats}")
    runs = []
    for i in range(FLAGS.repeats):
        totals, lines = run_once(extra)
        runs.append({"totals": totals, "stdout": lines})
        t = totals
        print(
            f"run {i + 1}: tau {t['tau']:.2f}, {t['decode_tokens_per_s']:.0f} vs "
            f"{t.get('ar_decode_tokens_per_s', 0):.0f} tok/s, {t.get('speedup') or 0:.2f}x, "
            f"identical {t.get('identical_to_ar')}",
            flush=True,
        )
    keys = ("decode_tokens_per_s", "ar_decode_tokens_per_s", "speedup")
    median = {
        k: statistics.median(r["totals"][k] for r in runs)
        for k in keys
        if all(r["totals"].get(k) is not None for r in runs)
    }
    print("median: " + ", ".join(f"{k} {v:.2f}" for k, v in median.items()))
    if FLAGS.json_out:
        from dflash_jax.support import provenance

        result = {
            **provenance.record(),
            "infer_command": " ".join(["python infer.py", *extra]),
            "repeats": FLAGS.repeats,
            "tau": [r["totals"]["tau"] for r in runs],
            "identical_to_ar": all(r["totals"].get("identical_to_ar") for r in runs),
            "median": median,
            "runs": runs,
        }
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    from dflash_jax.support import cli

    define_flags()
    cli.run(main)
