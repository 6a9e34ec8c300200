"""Seconds of XLA backend compile for the bundled pair's first `generate` calls (autoregressive,
then DFlash at block 8), under the compiler settings the test suite could use; and, with
--layers, how those seconds grow with the target's depth.

    python benchmarks/compile_flags.py                      # every setting, one process each
    python benchmarks/compile_flags.py --layers=4,8,16,30   # compile vs target depth
    python benchmarks/compile_flags.py --layers=4,32 --layouts=looped,scanned \
        --compile_settings=default                          # the scanned stack's figure

Each setting runs in a fresh process (XLA reads its flags once, and aborts on one it does not
know: such a setting is reported as unknown). Compile seconds are jax's own backend-compile
events (`jax.monitoring`); `run` is a third, compiled call. tests/conftest.py picks its cheap
compiles from these figures.

--layers: a random target shaped like the bundled one (hidden 256, 4 query / 2 KV heads, vocab
4096) at each depth, with a 2-layer drafter, under the suite's settings (jax's
`jax_disable_most_optimizations`, and XLA:CPU's fusion emitters off where this jaxlib knows the
flag): trace, lowering and backend-compile seconds of one DFlash `generate` (its prefill and
decode programs), and the backend seconds per target layer fitted over the depths; --layouts
compares the looped stack with the scanned one (one traced and compiled layer body).

Committed results: no file; the figures in `docs/performance.md` are from `python
benchmarks/compile_flags.py --layers=4,32 --layouts=looped,scanned --compile_settings=default`,
those in `tests/README.md` from `python benchmarks/compile_flags.py` and `--layers=4,8,16,30`.
"""

import os
import subprocess
import sys

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("layers", [], "Target depths to compile at (e.g. 4,8,16,30); empty: settings.")
flags.DEFINE_list(
    "layouts",
    ["looped"],
    "With --layers: the layer stacks to compare, side by side at each depth: looped (one "
    "program piece per layer) and/or scanned (`ModelConfig.scan_layers`: one layer body).",
)
flags.DEFINE_enum(
    "compile_settings",
    "suite",
    ["suite", "default"],
    "With --layers: the test suite's cheap compiles, or jax's defaults (what users wait for).",
)

FUSION_OFF = "--xla_cpu_use_fusion_emitters=false"
SETTINGS = {
    "default": {},
    "jax_disable_most_optimizations": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"},
    "fusion emitters off": {"XLA_FLAGS": FUSION_OFF},
    "both (the suite's)": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "XLA_FLAGS": FUSION_OFF},
}
# Tried on top of the suite's settings (those of "both" that this jaxlib knows; 2026-12-05): none
# moved the compile seconds by more than the run-to-run spread on this machine.
ON_TOP = {
    "suite's + codegen split 1": {"XLA_FLAGS": "--xla_cpu_parallel_codegen_split_count=1"},
    "suite's + thunk runtime off": {"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=false"},
    "suite's + jax effort levels O0/-1": {
        "JAX_OPTIMIZATION_LEVEL": "O0",
        "JAX_MEMORY_FITTING_LEVEL": "O0",
        "JAX_EXEC_TIME_OPTIMIZATION_EFFORT": "-1",
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

DEPTH_CHILD = r"""
import collections
import jax.monitoring
seconds = collections.Counter()
def on_event(event, secs, **_):
    seconds[event.rsplit("/", 1)[-1]] += secs
jax.monitoring.register_event_duration_secs_listener(on_event)
import dflash_jax as dj
from dflash_jax.models.target import init_params
from dflash_jax.models import layer_stack
cfg = dj.ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers={depth},
                     num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=4096)
dcfg = dj.make_drafter_config(cfg, num_layers=2, num_taps=3, block_size=16, mask_token_id=1)
drafter = dj.Drafter(dcfg, dj.init_drafter_params(dcfg, 1))
cfg = cfg.replace(scan_layers={scan})
target = dj.Target(cfg, layer_stack.to_layout(init_params(cfg.replace(scan_layers=False), 0), cfg))
seconds.clear()
ar = dj.generate(target, None, [[5, 6, 7, 8] * 4] * 4, 40)
spec = dj.generate(target, drafter, [[5, 6, 7, 8] * 4] * 4, 40)
assert spec.tokens == ar.tokens
keys = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")
print("RESULT " + " ".join(f"{{seconds[k]:.2f}}" for k in keys))
"""


def _child(code, env):
    """(RESULT fields, None) or (None, why) for `code` run in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return None, "unknown flag" if "Unknown flag" in proc.stderr else "failed"
    return lines[-1].split()[1:], None


def _suite_env():
    """This environment with the test suite's compiler settings (tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1", XLA_FLAGS=FUSION_OFF)
    probe = "import jax.numpy as jnp; (jnp.zeros(2) + 1).block_until_ready()"
    if subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode:
        env.pop("XLA_FLAGS")  # a jaxlib whose XLA no longer knows the flag
    return env


def settings(root):
    print(f"{'setting':<34} {'compile s':>9} {'run s':>6}")
    runs = []
    for name, extra in SETTINGS.items():
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
        env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
        env.update(JAX_PLATFORMS="cpu", **extra)
        runs.append((name, env))
    suite = _suite_env()
    for name, extra in ON_TOP.items():
        env = dict(suite)
        flags_ = (env.get("XLA_FLAGS", "") + " " + extra.get("XLA_FLAGS", "")).strip()
        env.update({k: v for k, v in extra.items() if k != "XLA_FLAGS"}, XLA_FLAGS=flags_)
        runs.append((name, env))
    for name, env in runs:
        fields, why = _child(CHILD.format(root=root), env)
        if why:
            print(f"{name:<34} {why:>9}")
            continue
        print(f"{name:<34} {fields[0]:>9} {fields[1]:>6}")


def _default_env():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")
    }
    env.update(JAX_PLATFORMS="cpu")
    return env


def depths(layers, layouts, env):
    """One AR and one DFlash `generate` (its prefill and decode programs, tokens checked equal)
    per depth and layout, each in a fresh process: trace, lowering, backend-compile seconds,
    their total, and per layout the per-layer fit and the deepest / shallowest total."""
    print(
        f"{'layout':>7} {'target layers':>13} {'trace s':>8} {'lower s':>8} {'compile s':>9} "
        f"{'total s':>8}"
    )
    for layout in layouts:
        points = []
        for depth in layers:
            code = DEPTH_CHILD.format(depth=depth, scan=layout == "scanned")
            fields, why = _child(code, env)
            if why:
                print(f"{layout:>7} {depth:>13} {why:>8}")
                continue
            total = sum(float(f) for f in fields)
            print(
                f"{layout:>7} {depth:>13} {fields[0]:>8} {fields[1]:>8} {fields[2]:>9} "
                f"{total:>8.2f}"
            )
            points.append((depth, float(fields[2]), total))
        if len(points) >= 2:
            slope, intercept = np.polyfit([p[0] for p in points], [p[1] for p in points], 1)
            (d0, _, t0), (d1, _, t1) = min(points), max(points)
            print(
                f"{layout}: backend compile {slope:.3f} s per target layer + {intercept:.2f} s; "
                f"total at {d1} / at {d0} layers = {t1 / t0:.2f}"
            )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        layers = [int(x) for x in FLAGS.layers]
    except ValueError:
        raise app.UsageError(f"--layers takes whole numbers, got {','.join(FLAGS.layers)}")
    if any(d < 3 for d in layers):
        raise app.UsageError(f"--layers: at least 3 (the drafter taps 3 layers), got {layers}")
    bad = [x for x in FLAGS.layouts if x not in ("looped", "scanned")]
    if bad or not FLAGS.layouts:
        raise app.UsageError(
            f"--layouts takes looped and/or scanned, got {','.join(FLAGS.layouts)}"
        )
    if layers:
        env = _suite_env() if FLAGS.compile_settings == "suite" else _default_env()
        depths(layers, FLAGS.layouts, env)
    else:
        settings(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


if __name__ == "__main__":
    app.run(main)
