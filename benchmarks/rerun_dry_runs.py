"""Recompile the TPU or GPU dry runs whose JSONs are in a directory, each with the command and
the DFLASH_* settings it records (`"command"`, `"env"`, written by `dflash_jax.support.provenance`),
so that the tables are regenerated with today's code. GPU JSONs need the CUDA build of jax
(`.venv312/bin/python benchmarks/rerun_dry_runs.py --dir=benchmarks/results/gpu_dry_run` with
CUDA_VISIBLE_DEVICES=-1).

    python benchmarks/rerun_dry_runs.py [--dir=benchmarks/results/tpu_dry_run]
        [--only=decode] [--match=SUBSTRING]
    python benchmarks/tpu_table.py --write      # then the tables

Each JSON is rewritten where it lies (its command's `--json_out` replaced by its own path).
Runs one compile at a time (each Qwen3-8B decode dry run takes minutes on a CPU), prints each
command and its time, stops at the first failure, and leaves a JSON untouched unless its run
succeeds (the dry run writes its --json_out only at the end). The `.txt` beside a JSON gets the
run's report.

Committed results: none of its own; it rewrites the dry-run JSONs it reruns
(`benchmarks/results/tpu_dry_run/`), then `python benchmarks/tpu_table.py --write` makes the
tables.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_string("dir", os.path.join(ROOT, "benchmarks", "results", "tpu_dry_run"), "JSONs")
flags.DEFINE_enum("only", "decode", ["decode", "all"], "decode: inference JSONs with decode loops")
flags.DEFINE_string("match", "", "only JSON file names containing this")
flags.DEFINE_bool("dry", False, "print the commands, run nothing")


def commands(directory: str, only: str, match: str):
    """(json path, argv, env) for each JSON to recompile, in file-name order; env: the DFLASH_*
    settings the JSON records (`"env"`: a Triton variant's DFLASH_PALLAS_GPU_BACKEND)."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        if match and match not in os.path.basename(path):
            continue
        with open(path) as f:
            r = json.load(f)
        if only == "decode" and not (
            r.get("mode") == "infer" and "dflash_decode" in r.get("programs", {})
        ):
            continue
        cmd = r.get("command")
        if not cmd:
            raise app.UsageError(f"{path} records no command")
        argv = shlex.split(cmd)
        if argv[:2] != ["python", "-m"] or argv[2] != "dflash_jax.dry_run":
            raise app.UsageError(f"{path}: not a dry-run command: {cmd}")
        # The JSON is rewritten where it lies (a run may have written it elsewhere first).
        out_arg = "--json_out=" + os.path.relpath(path, ROOT)
        argv = [out_arg if a.startswith("--json_out=") else a for a in argv]
        argv += [] if out_arg in argv else [out_arg]
        env = {k: v for k, v in r.get("env", {}).items() if k.startswith("DFLASH_")}
        out.append((path, [sys.executable] + argv[1:], env))
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    todo = commands(FLAGS.dir, FLAGS.only, FLAGS.match)
    if not todo:
        raise app.UsageError(f"no dry-run JSON to recompile in {FLAGS.dir}")
    for i, (path, cmd, settings) in enumerate(todo, 1):
        shown = "".join(f"{k}={v} " for k, v in settings.items())
        print(f"[{i}/{len(todo)}] {shown}{shlex.join(cmd[1:])}", flush=True)
        if FLAGS.dry:
            continue
        env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
        env.update(settings, JAX_PLATFORMS="cpu")
        t0 = time.time()
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
            raise SystemExit(f"failed ({r.returncode}) after {time.time() - t0:.0f} s: {path}")
        report = [ln for ln in r.stdout.splitlines() if not ln.startswith("wrote ")]
        with open(os.path.splitext(path)[0] + ".txt", "w") as f:
            f.write("\n".join(report) + "\n")
        print(f"    done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
