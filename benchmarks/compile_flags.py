"""Seconds of XLA backend compile for the bundled pair's first `generate` calls (autoregressive,
then DFlash at block 8), under the compiler settings the test suite could use.

    python benchmarks/compile_flags.py                      # every setting, one process each

Each setting runs in a fresh process (XLA reads its flags once, and aborts on one it does not
know: such a setting is reported as unknown). Compile seconds are jax's own backend-compile
events (`jax.monitoring`); `run` is a third, compiled call. tests/conftest.py picks its cheap
compiles from these figures.
"""

import os
import subprocess
import sys

SETTINGS = {
    "default": {},
    "jax_disable_most_optimizations": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"},
    "fusion emitters off": {"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false"},
    "both": {
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
        "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false",
    },
}

CHILD = r"""
import os, time
import jax.monitoring
total = [0.0]
def on_event(event, secs, **_):
    if event.endswith("backend_compile_duration"):
        total[0] += secs
jax.monitoring.register_event_duration_secs_listener(on_event)
import dflash_jax as dj
from dflash_jax.data.tokenizer import load_tokenizer
pair = os.path.join({root!r}, "assets", "tiny-code")
target = dj.load_target(os.path.join(pair, "target"), dtype="float32")
drafter = dj.load_drafter(os.path.join(pair, "drafter"), target=target)
prompts = [load_tokenizer(os.path.join(pair, "target")).encode("def add(a, b):")] * 4
total[0] = 0.0
ar = dj.generate(target, None, prompts, 40)
spec = dj.generate(target, drafter, prompts, 40, block_size=8)
t = time.perf_counter()
dj.generate(target, drafter, prompts, 40, block_size=8)
run = time.perf_counter() - t
assert spec.tokens == ar.tokens
print(f"RESULT {{total[0]:.1f}} {{run:.2f}}")
"""


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"{'setting':<32} {'compile s':>9} {'run s':>6}")
    for name, extra in SETTINGS.items():
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
        env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
        env.update(JAX_PLATFORMS="cpu", **extra)
        proc = subprocess.run(
            [sys.executable, "-c", CHILD.format(root=root)],
            env=env,
            capture_output=True,
            text=True,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            unknown = "Unknown flag" in proc.stderr
            print(f"{name:<32} {'unknown flag' if unknown else 'failed':>9}")
            continue
        compile_s, run_s = lines[-1].split()[1:]
        print(f"{name:<32} {compile_s:>9} {run_s:>6}")


if __name__ == "__main__":
    main()
