"""Compiled decode-step times on a GPU: a random-weight Qwen3-8B-shaped target and a 5-layer
block-16 drafter in bfloat16, autoregressive (AR) and DFlash, per attention implementation.

    python benchmarks/gpu_steps.py --json_out=benchmarks/results/gpu_steps_h200.json

Nothing is downloaded: the configs are the dry run's presets (`dflash_jax/dry_run/presets.py`,
default `qwen3_8b`), the parameters are drawn on the device by a jitted init (16 GB of
weights never pass through the host). For each attention implementation the device has (on
GPU: Pallas Triton, cuDNN, XLA; `--impls` to choose), batch (`--batches`, default 1, 8) and
context (`--contexts`, default 1K / 8K / 32K) it compiles the two decode loops `generate`
runs (`generate_programs`: the same `while_loop` programs, cache capacity from
`buffer_sizes`) and times them as benchmarks/step_costs.py times the loop: seconds
per iteration of the compiled loop (`--loop_tokens` new tokens per run, divided by the
iterations it ran), median of `--repeats` runs after one warm-up run; compile time apart.

No prefill is run: each run starts from a decode state whose caches (target and drafter
context) hold random values over the first `context` slots, as a prefill of a random prompt
would leave them, so a step reads the same bytes. A DFlash step costs the same whatever it
accepts (fixed shapes), so random weights time it faithfully; their acceptance is not tau.
Reported per row: t_AR and t_DFlash (ms per step), their ratio and the projected speedup
tau * t_AR / t_DFlash at `--tau` (default 6.5).

Budget: programs are compiled `--compile_threads` at a time per implementation, then timed
(nothing compiles while a step is timed); no new setting starts after `--max_minutes`
(listed as skipped). Each (batch, context) has its own cache shapes and so its own programs;
the parameters and the state builder are shared. `--preset=tiny` (a small random model,
contexts 64 / 128) runs on CPU in seconds: the test suite's configuration.

Committed results: none yet (not run on a GPU); for one H200: `python benchmarks/gpu_steps.py
--json_out=benchmarks/results/gpu_steps_h200.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import flags

from dflash_jax.support import cli

FLAGS = flags.FLAGS

# Contexts and batches per preset when --contexts / --batches are not given.
DEFAULTS = {"tiny": ([64, 128], [1, 2]), "small": ([256, 1024], [1, 8])}
DEFAULT_CONTEXTS, DEFAULT_BATCHES = [1024, 8192, 32768], [1, 8]


def define_flags():
    flags.DEFINE_string("preset", "qwen3_8b", "Dry-run model preset (qwen3_8b, tiny, small...).")
    flags.DEFINE_list("contexts", [], "Committed tokens in the cache (default: by preset).")
    flags.DEFINE_list("batches", [], "Batch sizes (default 1,8).")
    flags.DEFINE_list(
        "impls",
        [],
        "Attention implementations: triton, cudnn, xla (GPU), tpu, xla (TPU), xla (CPU). "
        "Default: every one the device has.",
    )
    flags.DEFINE_integer("loop_tokens", 32, "New tokens per timed run of a decode loop.")
    flags.DEFINE_integer("repeats", 3, "Timed runs per program (median), after one warm-up.")
    flags.DEFINE_float("tau", 6.5, "Acceptance length for the projected speedup.")
    flags.DEFINE_integer("compile_threads", 4, "Programs compiled at once (1: serially).")
    flags.DEFINE_float("max_minutes", 7.5, "Start no new setting after this many minutes.")
    flags.DEFINE_integer("seed", 0, "Seed of the random parameters and caches.")
    flags.DEFINE_string("json_out", None, "Write the figures here.")


def available_impls(platform: str):
    """The implementations this platform compiles, as (name, env value of
    DFLASH_PALLAS_GPU_BACKEND or None): the GPU variants are chosen as a user gets them, by
    `attention_impl="pallas"` under that variable (pallas_kernels/backend.py)."""
    from pallas_kernels import backend

    if platform in ("gpu", "cuda", "rocm"):
        out = []
        if backend.triton_available():
            out.append("triton")
        if platform != "rocm":
            out.append("cudnn")
        return out + ["xla"]
    if platform == "tpu":
        return ["tpu", "xla"]
    return ["xla"]


def attention_impl_for(name: str) -> str:
    """The concrete `attention_impl` of an implementation name, as `for_devices` makes it."""
    from dflash_jax.models import attention as attn_lib

    if name == "xla":
        return "xla"
    if name == "tpu":
        return attn_lib.for_devices("pallas_tpu")
    old = os.environ.get("DFLASH_PALLAS_GPU_BACKEND")
    os.environ["DFLASH_PALLAS_GPU_BACKEND"] = name
    try:
        return attn_lib.for_devices("pallas")
    finally:
        if old is None:
            del os.environ["DFLASH_PALLAS_GPU_BACKEND"]
        else:
            os.environ["DFLASH_PALLAS_GPU_BACKEND"] = old


def _ints(values, default):
    return [int(v) for v in values] if values else list(default)


def _commit() -> str:
    r = subprocess.run(
        ["git", "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
    return r.stdout.strip() or "unknown"


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments (flags only): {' '.join(argv[1:])}")
    import concurrent.futures
    import functools

    import jax
    import jax.numpy as jnp

    from dflash_jax.decoding.programs import buffer_sizes, generate_programs
    from dflash_jax.decoding.step import Plan
    from dflash_jax.drafters.dflash import DFlashDrafter, init_drafter_params
    from dflash_jax.dry_run.presets import build_configs
    from dflash_jax.models.transformer import Transformer
    from dflash_jax.models.target import init_params
    from dflash_jax.support import console

    t_start = time.perf_counter()
    console.cli_startup()
    tcfg, dcfg = build_configs(FLAGS.preset)
    ctx_default, batch_default = DEFAULTS.get(FLAGS.preset, (DEFAULT_CONTEXTS, DEFAULT_BATCHES))
    contexts = _ints(FLAGS.contexts, ctx_default)
    batches = _ints(FLAGS.batches, batch_default)
    platform = jax.default_backend()
    impls = list(FLAGS.impls) or available_impls(platform)
    unknown = [i for i in impls if i not in ("triton", "cudnn", "xla", "tpu")]
    if unknown:
        raise ValueError(f"--impls: unknown {unknown}; use triton, cudnn, xla or tpu")
    if FLAGS.loop_tokens < 2 or FLAGS.repeats < 1:
        raise ValueError("--loop_tokens must be >= 2 and --repeats >= 1")
    bs = dcfg.block_size
    device = jax.devices()[0]
    print(
        f"gpu_steps: preset {FLAGS.preset} ({tcfg.num_layers} target layers, drafter "
        f"{dcfg.body.num_layers} layers, block {bs}), {platform} {device.device_kind}, "
        f"jax {jax.__version__}; impls {impls}, batches {batches}, contexts {contexts}",
        flush=True,
    )

    # Parameters drawn on the device (jitted inits), once for every setting.
    t0 = time.perf_counter()
    tparams = jax.jit(functools.partial(init_params, tcfg, FLAGS.seed))()
    dparams = jax.jit(functools.partial(init_drafter_params, dcfg, FLAGS.seed + 1))()
    jax.block_until_ready((tparams, dparams))
    init_s = time.perf_counter() - t0
    n_target = sum(x.size for x in jax.tree_util.tree_leaves(tparams))
    n_drafter = sum(x.size for x in jax.tree_util.tree_leaves(dparams))
    print(
        f"random parameters on {platform}: target {n_target / 1e9:.3f}B, drafter "
        f"{n_drafter / 1e9:.3f}B ({init_s:.1f} s)",
        flush=True,
    )

    def state_builder(prefill_jit, batch, p_pad, ctx, with_drafter):
        """A jitted fn(key) -> the decode state a prefill of `ctx` random tokens leaves (caches
        random over every slot, `ctx` committed), and the state's shape for lowering."""
        args = (
            jax.ShapeDtypeStruct((batch, p_pad), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32),
            jax.eval_shape(lambda: jax.random.PRNGKey(0)),
        )
        shape = jax.eval_shape(prefill_jit, tparams, dparams if with_drafter else None, *args)

        def build(key):
            k_fill, k_state = jax.random.split(key)

            def fill(tree):
                leaves, treedef = jax.tree_util.tree_flatten(tree)
                keys = jax.random.split(k_fill, len(leaves))
                return jax.tree_util.tree_unflatten(
                    treedef,
                    [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)],
                )

            lengths = jnp.full((batch,), ctx, jnp.int32)
            cache = shape.cache.replace(
                k=fill(shape.cache.k), v=fill(shape.cache.v), lengths=lengths
            )
            cctx = None
            if shape.ctx is not None:
                cctx = shape.ctx.replace(k=fill(shape.ctx.k), v=fill(shape.ctx.v), lengths=lengths)
            zeros = lambda s: jnp.zeros(s.shape, s.dtype)
            return shape.replace(
                cache=cache,
                ctx=cctx,
                tokens=zeros(shape.tokens),
                num_out=jnp.ones((batch,), jnp.int32),
                done=jnp.zeros((batch,), bool),
                step=jnp.zeros((), jnp.int32),
                accepted=zeros(shape.accepted),
                drafts=zeros(shape.drafts),
                key=k_state,
                max_new=jnp.asarray(FLAGS.loop_tokens, jnp.int32),
            )

        return jax.jit(build), shape

    def lower(impl, batch, ctx, mode):
        """(lowered decode program, state builder, capacity) of one setting."""
        block = bs if mode == "dflash" else 1
        p_pad, n_buf, capacity = buffer_sizes(ctx, FLAGS.loop_tokens, block)
        plan = Plan(block_size=block, attention_impl=impl)
        tmod = Transformer(tcfg, impl)
        dmod = DFlashDrafter(dcfg) if mode == "dflash" else None
        dp = dparams if mode == "dflash" else None
        prefill_jit, decode_jit, _ = generate_programs(
            tmod, dmod, plan, capacity, n_buf, None, tparams, dp, batch, p_pad
        )
        build, shape = state_builder(prefill_jit, batch, p_pad, ctx, mode == "dflash")
        return decode_jit.lower(tparams, dp, shape), build, capacity, dp

    def compile_one(lowered):
        t0 = time.perf_counter()
        exe = lowered.compile()
        return exe, time.perf_counter() - t0

    def time_one(exe, build, dp, key):
        """Median ms per loop iteration over FLAGS.repeats runs after one warm-up, and the
        iterations and tokens of the last run."""
        per_step, steps, tokens = [], 0, 0
        for r in range(FLAGS.repeats + 1):
            state = build(jax.random.fold_in(key, r))
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            out = exe(tparams, dp, state)
            jax.block_until_ready(out.tokens)
            dt = time.perf_counter() - t0
            steps, tokens = int(out.step), int(np.asarray(out.num_out).sum())
            del out, state
            if r:  # run 0 warms up
                per_step.append(dt / max(steps, 1))
        return 1e3 * float(np.median(per_step)), steps, tokens

    rows, skipped = [], []
    key = jax.random.PRNGKey(FLAGS.seed + 2)
    settings = [(b, c) for b in batches for c in contexts]
    for name in impls:
        over = (time.perf_counter() - t_start) / 60 > FLAGS.max_minutes
        if over:
            skipped += [dict(impl=name, batch=b, context=c) for b, c in settings]
            continue
        try:
            impl = attention_impl_for(name)
        except Exception as e:  # an implementation this jax or device lacks
            rows += [
                dict(impl=name, batch=b, context=c, error=cli.one_line(e)) for b, c in settings
            ]
            print(f"{name}: unavailable ({cli.one_line(e)})", flush=True)
            continue
        # Lower every setting of this implementation, compile them together, then time them.
        t_group = time.perf_counter()
        jobs = {}
        for b, c in settings:
            for mode in ("ar", "dflash"):
                try:
                    jobs[(b, c, mode)] = lower(impl, b, c, mode)
                except Exception as e:
                    jobs[(b, c, mode)] = e
        with concurrent.futures.ThreadPoolExecutor(max(1, FLAGS.compile_threads)) as pool:
            futures = {
                k: pool.submit(compile_one, v[0])
                for k, v in jobs.items()
                if not isinstance(v, Exception)
            }
            compiled = {}
            for k, v in jobs.items():
                if isinstance(v, Exception):
                    compiled[k] = v
                    continue
                try:
                    compiled[k] = futures[k].result()
                except Exception as e:
                    compiled[k] = e
        group_compile_s = time.perf_counter() - t_group
        print(
            f"{name} ({impl}): {len(jobs)} programs lowered and compiled in "
            f"{group_compile_s:.1f} s",
            flush=True,
        )
        for b, c in settings:
            if (time.perf_counter() - t_start) / 60 > FLAGS.max_minutes:
                skipped.append(dict(impl=name, batch=b, context=c))
                continue
            row = dict(impl=name, attention_impl=impl, batch=b, context=c)
            try:
                for mode in ("ar", "dflash"):
                    got = compiled[(b, c, mode)]
                    if isinstance(got, Exception):
                        raise got
                    exe, comp_s = got
                    _, build, capacity, dp = jobs[(b, c, mode)]
                    ms, steps, tokens = time_one(exe, build, dp, key)
                    row[f"{mode}_step_ms"] = ms
                    row[f"{mode}_compile_s"] = comp_s
                    row[f"{mode}_capacity"] = capacity
                    row[f"{mode}_steps"] = steps
                    row[f"{mode}_tokens_per_step"] = tokens / b / max(steps, 1)
                row["ratio"] = row["dflash_step_ms"] / row["ar_step_ms"]
                row["projected_speedup"] = FLAGS.tau / row["ratio"]
            except Exception as e:
                row["error"] = cli.one_line(e)
            rows.append(row)
            print("  " + _row_text(row), flush=True)
        del jobs, compiled

    total_s = time.perf_counter() - t_start
    print(_table(rows, FLAGS.tau))
    if skipped:
        print(f"skipped after --max_minutes={FLAGS.max_minutes}: {skipped}")
    print(f"total {total_s:.1f} s (parameters {init_s:.1f} s)")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(
                {
                    "command": "python benchmarks/gpu_steps.py " + " ".join(sys.argv[1:]),
                    "commit": _commit(),
                    "jax_version": jax.__version__,
                    "backend": platform,
                    "device_kind": device.device_kind,
                    "devices": jax.device_count(),
                    "preset": FLAGS.preset,
                    "model": dict(
                        target_params=int(n_target),
                        drafter_params=int(n_drafter),
                        target_layers=tcfg.num_layers,
                        drafter_layers=dcfg.body.num_layers,
                        block_size=bs,
                        dtype=str(jnp.dtype(tcfg.dtype)),
                    ),
                    "settings": dict(
                        impls=impls,
                        batches=batches,
                        contexts=contexts,
                        loop_tokens=FLAGS.loop_tokens,
                        repeats=FLAGS.repeats,
                        tau=FLAGS.tau,
                        compile_threads=FLAGS.compile_threads,
                    ),
                    "rows": rows,
                    "skipped": skipped,
                    "init_s": init_s,
                    "total_s": total_s,
                },
                f,
                indent=1,
            )
        print(f"wrote {FLAGS.json_out}")
    if any("error" in r for r in rows):
        print("some settings failed (see 'error')", file=sys.stderr)


def _row_text(r) -> str:
    head = f"{r['impl']:>6} batch {r['batch']:2d} context {r['context']:6d}: "
    if "error" in r:
        return head + "error: " + r["error"]
    return (
        head + f"AR {r['ar_step_ms']:.3f} ms, DFlash {r['dflash_step_ms']:.3f} ms per step, "
        f"ratio {r['ratio']:.2f}, projected {r['projected_speedup']:.2f}x"
    )


def _table(rows, tau) -> str:
    lines = [
        f"| impl | batch | context | AR step ms | DFlash step ms | DFlash/AR | speedup at tau "
        f"{tau:g} | compile s (AR / DFlash) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['batch']} | {r['context']} | error: {r['error']} |")
            continue
        lines.append(
            f"| {r['impl']} | {r['batch']} | {r['context']} | {r['ar_step_ms']:.3f} | "
            f"{r['dflash_step_ms']:.3f} | {r['ratio']:.2f} | {r['projected_speedup']:.2f}x | "
            f"{r['ar_compile_s']:.1f} / {r['dflash_compile_s']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
