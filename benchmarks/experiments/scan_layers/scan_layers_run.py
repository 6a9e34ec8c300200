"""What the scanned layer stack (`ModelConfig.scan_layers`) costs and saves on this machine: for
the looped and the scanned target, each in a fresh process, the first autoregressive and DFlash
`generate` (compile + run) and a second, warm one (run only), the tokens checked equal.

    python benchmarks/experiments/scan_layers/scan_layers_run.py   # SmolLM2-135M and its drafter
    python benchmarks/experiments/scan_layers/scan_layers_run.py --target=assets/tiny-code/target \\
        --drafter=assets/tiny-code/drafter

Run time is the CPU's (XLA:CPU copies each layer's weight slice out of the stack before its
dots); compile time is what the stack saves (docs/performance.md).
"""

import json
import os
import subprocess
import sys

from absl import app, flags

from dflash_jax.support import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "smollm2-135m-instruct", "Target directory, GGUF or known name.")
flags.DEFINE_string(
    "drafter", "assets/smollm2-135m-instruct/drafter", "DFlash drafter directory for the target."
)
flags.DEFINE_integer("batch", 4, "Prompts per generate call.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens per prompt.")

CHILD = r"""
import json, sys, time
import dflash_jax as dj
target = dj.load_target({target!r}, scan_layers={scan})
drafter = dj.load_drafter({drafter!r}, target=target)
prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 4] * {batch}
out = {{}}
for name, d in (("ar", None), ("dflash", drafter)):
    t = time.perf_counter()
    first = dj.generate(target, d, prompts, {new})
    out[name + "_first_s"] = time.perf_counter() - t
    t = time.perf_counter()
    dj.generate(target, d, prompts, {new})
    out[name + "_warm_s"] = time.perf_counter() - t
    out[name + "_tokens"] = first.tokens
print("RESULT " + json.dumps(out))
"""


def _run(scan: bool) -> dict:
    code = CHILD.format(
        target=FLAGS.target,
        drafter=FLAGS.drafter,
        scan=scan,
        batch=FLAGS.batch,
        new=FLAGS.max_new_tokens,
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise app.UsageError(f"the {'scanned' if scan else 'looped'} run failed: {tail}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.batch < 1 or FLAGS.max_new_tokens < 1:
        raise app.UsageError("--batch and --max_new_tokens must be >= 1")
    if not os.path.isdir(FLAGS.drafter):
        raise app.UsageError(f"--drafter: {FLAGS.drafter} is not a directory")
    looped, scanned = _run(False), _run(True)
    for kind in ("ar", "dflash"):
        if looped[kind + "_tokens"] != scanned[kind + "_tokens"]:
            raise SystemExit(f"error: the scanned target's {kind} tokens differ from the loop's")
    print(f"{'stack':<8} {'AR first s':>10} {'AR warm s':>9} {'DFlash first s':>14} "
          f"{'DFlash warm s':>13}")  # fmt: skip
    for name, r in (("looped", looped), ("scanned", scanned)):
        print(
            f"{name:<8} {r['ar_first_s']:>10.2f} {r['ar_warm_s']:>9.2f} "
            f"{r['dflash_first_s']:>14.2f} {r['dflash_warm_s']:>13.2f}"
        )
    print("tokens: scanned == looped (AR and DFlash)")


if __name__ == "__main__":
    cli.run(main)
