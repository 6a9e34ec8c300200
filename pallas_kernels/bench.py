"""Benchmark the DFlash attention kernels against XLA baselines.

    python pallas_kernels/bench.py [--kernel verify|draft|training|gmm|all] [--quick]
        [--impl all|pallas|pallas_tpu|pallas_triton|cudnn[,...]] [--interpret]
        [--peak_hbm_gbps 4800] [--repeats 20] [--contexts 1024,8192]
        [--batches 1,8] [--json_out results.json]

For every kernel and shape it times (median over --repeats runs, compilation
and one warm-up run excluded):
  * every variant of this backend (--impl all, the default): TPU -> pallas_tpu;
    GPU -> pallas_triton (while jax ships it) and cudnn (backend.py's cuDNN
    variant; verify/draft only, its training path is the XLA reference);
    each checked against the reference first (max abs error printed),
  * the plain-XLA reference (pallas_kernels/reference.py),
  * jax.nn.dot_product_attention with an explicit boolean mask (XLA), and on
    GPU for training also implementation="cudnn" when cuDNN accepts it.
Columns: time, achieved HBM bandwidth = bytes of K/V that the attention
actually needs to read (valid context + block, not the cache capacity) / time,
as GB/s and % of --peak_hbm_gbps (default 4800 = H200), and useful TFLOP/s
(masked-out work not counted; training = forward + backward, 2.5x forward).

Shapes (default): Qwen3-8B attention -- 32 query heads, 8 kv heads, head_dim
128, bfloat16; contexts 1K/4K/8K/16K/32K; block 16; batch 1 and 8.
--quick: contexts 1K/8K, batch 1.  --interpret (CPU): tiny shapes, kernels
in Pallas interpret mode -- only proves the script runs.

--kernel gmm: the MoE grouped matmul of few rows (pallas_kernels/grouped_matmul.py) at
Qwen3-30B-A3B expert shapes (K 2048, N 768, 128 experts, bfloat16): rows 8/16/64/256 spread
over 1, 8 or as many experts as can have rows (min(E, rows), "all"); the baseline xla_ref is
jax.lax.ragged_dot, against the routed Pallas kernel (pallas_tpu / pallas) and the gather
dispatch (gather_dispatch, every backend), both checked against it. In its rows B is the
number of rows and ctx the number of experts with rows; the bytes are those the product
needs (the weights of the experts with rows, the rows, the output), the flops 2 x rows x K x
N. --quick: rows 16/64 over 1 or all experts; --batches overrides the rows.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import types
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from absl import app, flags, logging

import pallas_kernels as pk

from pallas_kernels import backend, reference


# ------------------------------------------------------------------ shapes --
def shape_grid(args):
    if args.interpret:
        return dict(
            hq=4,
            hkv=2,
            d=32,
            block=4,
            contexts=[64, 200],
            batches=[1, 2],
            n_blocks=4,
            dtype=jnp.float32,
            gmm=dict(k=32, n=256, experts=16, rows=[8, 16], active=[1, 4, "all"]),
        )
    if args.quick:
        return dict(
            hq=32,
            hkv=8,
            d=128,
            block=16,
            contexts=[1024, 8192],
            batches=[1],
            n_blocks=32,
            dtype=jnp.bfloat16,
            gmm=dict(GMM_SHAPE, rows=[16, 64], active=[1, "all"]),
        )
    return dict(
        hq=32,
        hkv=8,
        d=128,
        block=16,
        contexts=[1024, 4096, 8192, 16384, 32768],
        batches=[1, 8],
        n_blocks=32,
        dtype=jnp.bfloat16,
        gmm=dict(GMM_SHAPE, rows=[8, 16, 64, 256], active=[1, 8, "all"]),
    )


# Qwen3-30B-A3B's experts: hidden 2048, expert width 768, 128 experts (gate / up projections).
GMM_SHAPE = dict(k=2048, n=768, experts=128)


# ------------------------------------------------------------------ timing --
def time_fn(fn, args, repeats):
    """Median wall time (s) of fn(*args); compile + one warm-up excluded."""
    out = fn(*args)
    jax.block_until_ready(out)
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _dpa(q, k, v, mask, implementation=None):
    """jax.nn.dot_product_attention with a [B,T,S] boolean mask."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation=implementation)


def _cudnn_ok():
    return jax.default_backend() in ("gpu", "cuda")


def variants(args):
    """The kernel variants (public impl names) to time on this backend."""
    if args.impl != "all":
        return args.impl.split(",")
    if args.interpret:
        return ["pallas_tpu", "pallas_triton"]
    platform = jax.default_backend()
    if platform == "tpu":
        return ["pallas_tpu"]
    if platform in ("gpu", "cuda", "rocm"):
        return (["pallas_triton"] if backend.triton_available() else []) + ["cudnn"]
    return []  # CPU without --interpret: the XLA baselines only


# ---------------------------------------------------------------- kernels --
def cases_verify(g, rng, args):
    for b in g["batches"]:
        for ctx in g["contexts"]:
            t = g["block"]
            s = ctx + t
            q = rng((b, t, g["hq"], g["d"]))
            k, v = rng((b, s, g["hkv"], g["d"])), rng((b, s, g["hkv"], g["d"]))
            pos = jnp.broadcast_to(ctx + jnp.arange(t, dtype=jnp.int32), (b, t))
            kv_bytes = 2 * b * s * g["hkv"] * g["d"] * q.dtype.itemsize
            flops = 4 * b * g["hq"] * g["d"] * int(jnp.sum(pos + 1))
            impls = {
                v: jax.jit(
                    lambda q, k, v_, p, impl=v: pk.verify_attention(
                        q, k, v_, p, impl=impl, interpret=args.interpret
                    )
                )
                for v in args.variants
            }
            impls.update(
                {
                    "xla_ref": jax.jit(lambda q, k, v, p: reference.verify_attention(q, k, v, p)),
                    "dot_product_attention": jax.jit(
                        lambda q, k, v, p: _dpa(q, k, v, reference.verify_mask(p, k.shape[1]))
                    ),
                }
            )
            yield (
                dict(kernel="verify", batch=b, context=ctx, bytes=kv_bytes, flops=flops),
                impls,
                (q, k, v, pos),
            )


def cases_draft(g, rng, args):
    for b in g["batches"]:
        for ctx in g["contexts"]:
            t = g["block"]
            q = rng((b, t, g["hq"], g["d"]))
            ck, cv = rng((b, ctx, g["hkv"], g["d"])), rng((b, ctx, g["hkv"], g["d"]))
            bk, bv = rng((b, t, g["hkv"], g["d"])), rng((b, t, g["hkv"], g["d"]))
            clen = jnp.full((b,), ctx, jnp.int32)
            kv_bytes = 2 * b * (ctx + t) * g["hkv"] * g["d"] * q.dtype.itemsize
            flops = 4 * b * g["hq"] * g["d"] * t * (ctx + t)

            def dpa(q, ck, cv, cl, bk, bv, implementation=None):
                k = jnp.concatenate([ck, bk], axis=1)
                v = jnp.concatenate([cv, bv], axis=1)
                mask = jnp.broadcast_to(
                    reference.draft_mask(cl, ck.shape[1], bk.shape[1]),
                    (q.shape[0], q.shape[1], k.shape[1]),
                )
                return _dpa(q, k, v, mask, implementation)

            impls = {
                v: jax.jit(
                    lambda *a, impl=v: pk.draft_attention(*a, impl=impl, interpret=args.interpret)
                )
                for v in args.variants
            }
            impls.update(
                {
                    "xla_ref": jax.jit(lambda *a: reference.draft_attention(*a)),
                    "dot_product_attention": jax.jit(dpa),
                }
            )
            yield (
                dict(kernel="draft", batch=b, context=ctx, bytes=kv_bytes, flops=flops),
                impls,
                (q, ck, cv, clen, bk, bv),
            )


def cases_training(g, rng, args):
    bs, n = g["block"], g["n_blocks"]
    for b in g["batches"]:
        for ctx in g["contexts"]:
            l = n * bs
            q = rng((b, l, g["hq"], g["d"]))
            kc, vc = rng((b, ctx, g["hkv"], g["d"])), rng((b, ctx, g["hkv"], g["d"]))
            kb, vb = rng((b, l, g["hkv"], g["d"])), rng((b, l, g["hkv"], g["d"]))
            # Anchors spread over the context (sorted, like sampled DFlash anchors).
            anchors = jnp.broadcast_to(jnp.linspace(1, ctx, n).astype(jnp.int32), (b, n))
            valid = jnp.ones((b, n), bool)
            visible = int(jnp.sum(anchors)) * bs + b * n * bs * bs
            flops = int(4 * g["hq"] * g["d"] * visible * 3.5)  # fwd (1x) + bwd (2.5x)
            item = q.dtype.itemsize
            bytes_ = (
                item
                * g["d"]
                * (2 * b * ctx * g["hkv"] + 2 * b * l * g["hkv"] + 2 * b * l * g["hq"])
            )

            def grad_of(f):
                def loss(q, kc, vc, kb, vb, a, vld):
                    return jnp.sum(f(q, kc, vc, kb, vb, a, vld).astype(jnp.float32))

                return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))

            def dpa(q, kc, vc, kb, vb, a, vld, implementation=None):
                k = jnp.concatenate([kc, kb], axis=1)
                v = jnp.concatenate([vc, vb], axis=1)
                mask = reference.training_mask(a, vld, bs, kc.shape[1])
                return _dpa(q, k, v, mask, implementation)

            # The cudnn variant trains through the XLA reference: nothing of its own to time.
            impls = {
                v: grad_of(
                    lambda *a, impl=v: pk.training_attention(
                        *a, block_size=bs, impl=impl, interpret=args.interpret
                    )
                )
                for v in args.variants
                if v != "cudnn"
            }
            impls.update(
                {
                    "xla_ref": grad_of(lambda *a: reference.training_attention(*a, block_size=bs)),
                    "dot_product_attention": grad_of(dpa),
                }
            )
            if _cudnn_ok():
                impls["dpa_cudnn"] = grad_of(lambda *a: dpa(*a, implementation="cudnn"))
            yield (
                dict(kernel="training(fwd+bwd)", batch=b, context=ctx, bytes=bytes_, flops=flops),
                impls,
                (q, kc, vc, kb, vb, anchors, valid),
            )


def _gmm_sizes(rows, active, experts, key):
    """Group sizes [experts] int32: `rows` rows spread as evenly as possible over `active`
    experts drawn at random (the others empty)."""
    chosen = jax.random.choice(key, experts, (active,), replace=False)
    per = jnp.full((active,), rows // active, jnp.int32).at[: rows % active].add(1)
    return jnp.zeros((experts,), jnp.int32).at[chosen].set(per)


def _gmm_kernel_runs(variant, args):
    """Whether the routed Pallas kernel stands for `variant` (the TPU kernel; no GPU one)."""
    if variant == "pallas_tpu":
        return True
    return variant == "pallas" and (args.interpret or jax.default_backend() == "tpu")


def cases_gmm(g, rng, args):
    from pallas_kernels import grouped_matmul as gm

    s = g["gmm"]
    k, n, e = s["k"], s["n"], s["experts"]
    w = rng((e, k, n))
    item = jnp.dtype(g["dtype"]).itemsize
    key = jax.random.PRNGKey(1)
    for m in s["rows"]:
        x = rng((m, k))
        counts = sorted({min(e, m) if a == "all" else min(a, e, m) for a in s["active"]})
        for a in counts:
            key, sub = jax.random.split(key)
            sizes = _gmm_sizes(m, a, e, sub)
            impls = {
                v: jax.jit(lambda x, w, gs: gm.routed_gmm(x, w, gs, interpret=args.interpret))
                for v in args.variants
                if _gmm_kernel_runs(v, args)
            }
            impls.update(
                {
                    "xla_ref": jax.jit(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)),
                    "gather_dispatch": jax.jit(gm.gather_gmm),
                }
            )
            yield (
                dict(
                    kernel="gmm",
                    batch=m,
                    context=a,
                    experts=e,
                    k=k,
                    n=n,
                    bytes=item * (a * k * n + m * k + m * n),
                    flops=2 * m * k * n,
                ),
                impls,
                (x, w, sizes),
            )


# Timed beside the variants and checked against the reference like them.
ALSO_CHECKED = ("gather_dispatch",)


# ------------------------------------------------------------------- main --
PROG = "pallas_kernels/bench.py"
VARIANTS = ("pallas", "pallas_tpu", "pallas_triton", "cudnn")
FLAG_NAMES = (
    "kernel",
    "quick",
    "interpret",
    "impl",
    "peak_hbm_gbps",
    "repeats",
    "no_check",
    "contexts",
    "batches",
    "json_out",
)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags (FLAG_NAMES), on `flag_values`: on the global FLAGS only when run as a script,
    else on `main`'s own FlagValues (no clash with other modules' flags in one process)."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_enum("kernel", "all", ["verify", "draft", "training", "gmm", "all"], None, **fv)
    flags.DEFINE_bool("quick", False, None, **fv)
    flags.DEFINE_bool(
        "interpret", False, "run the Pallas kernels in interpret mode (CPU smoke test)", **fv
    )
    flags.DEFINE_string(
        "impl",
        "all",
        "'all' (every variant of this backend) or a comma-separated list of "
        "pallas, pallas_tpu, pallas_triton, cudnn",
        **fv,
    )
    flags.DEFINE_float("peak_hbm_gbps", 4800.0, None, **fv)
    flags.DEFINE_integer("repeats", None, None, **fv)
    flags.DEFINE_bool("no_check", False, "skip the pallas-vs-reference output check", **fv)
    flags.DEFINE_string(
        "contexts", None, "comma-separated context lengths overriding the default grid", **fv
    )
    flags.DEFINE_string(
        "batches", None, "comma-separated batch sizes overriding the default grid", **fv
    )
    flags.DEFINE_string("json_out", None, None, **fv)


def _fail(message: str):
    """Bad input: one line on stderr, exit status 2 (as the dflash_jax tools)."""
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()
    sys.exit(2)


def _args(flag_values: flags.FlagValues, argv) -> types.SimpleNamespace:
    """The parsed flags as a namespace, with `variants` and --contexts / --batches as lists of
    ints; every value checked (else `_fail`)."""
    if len(argv) > 1:
        _fail(f"unexpected arguments (flags only): {' '.join(argv[1:])}")
    args = types.SimpleNamespace(**{n: flag_values[n].value for n in FLAG_NAMES})
    args.variants = variants(args)
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        _fail(f"--impl: unknown variant(s) {bad}")
    for name in ("contexts", "batches"):
        value = getattr(args, name)
        try:
            setattr(args, name, value and [int(x) for x in value.split(",")])
        except ValueError:
            _fail(f"--{name} wants comma-separated integers, got {value!r}")
    return args


def main(argv: Optional[Sequence[str]] = None):
    """The benchmark with the flags `argv` (no program name; default sys.argv[1:]), in this
    process, on a FlagValues of its own; returns the rows. Bad input: one line, exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    fv = flags.FlagValues()
    define_flags(fv)
    try:
        rest = fv([PROG, *argv])
    except flags.Error as e:
        _fail(str(e))
    return run(_args(fv, rest))


def _command_line(argv) -> None:
    if not flags.FLAGS["verbosity"].present:  # library INFO lines (JAX's) only when asked
        logging.set_verbosity(logging.WARNING)
    run(_args(flags.FLAGS, argv))


def _parse_flags(argv):
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _fail(str(e))


def run(args):
    """Times every kernel and shape `args` asks for (see `_args`); prints the table, writes
    --json_out, returns the rows."""
    if args.interpret and jax.default_backend() != "cpu":
        print("note: --interpret on an accelerator measures the interpreter, not the kernel")
    repeats = args.repeats or (2 if args.interpret else 5 if args.quick else 20)
    g = shape_grid(args)
    if args.contexts:
        g["contexts"] = args.contexts
    if args.batches:
        g["batches"] = args.batches
        g["gmm"] = dict(g["gmm"], rows=args.batches)
    key = [jax.random.PRNGKey(0)]

    def rng(shape):
        key[0], sub = jax.random.split(key[0])
        return jax.random.normal(sub, shape, jnp.float32).astype(g["dtype"])

    kernels = ["verify", "draft", "training", "gmm"] if args.kernel == "all" else [args.kernel]
    gens = {
        "verify": cases_verify,
        "draft": cases_draft,
        "training": cases_training,
        "gmm": cases_gmm,
    }
    print(
        f"backend={jax.default_backend()} devices={jax.devices()[0].device_kind} "
        f"jax={jax.__version__} variants={','.join(args.variants) or 'none'} interpret={args.interpret} repeats={repeats} "
        f"dtype={jnp.dtype(g['dtype']).name} Hq={g['hq']} Hkv={g['hkv']} D={g['d']}"
    )
    header = (
        f"{'kernel':<18} {'impl':<22} {'B':>2} {'ctx':>6} {'time_ms':>9} "
        f"{'GB/s':>8} {'%peak':>6} {'TFLOP/s':>8} {'vs_xla':>7}"
    )
    print(header)
    print("-" * len(header))
    if "gmm" in kernels:
        s = g["gmm"]
        print(
            f"gmm: B = rows, ctx = experts with rows (of E={s['experts']}, K={s['k']}, "
            f"N={s['n']}); xla_ref = jax.lax.ragged_dot"
        )
    rows = []
    for name in kernels:
        for meta, impls, inputs in gens[name](g, rng, args):
            base = None
            errs = {} if args.no_check else _check_variants(impls, inputs, args.variants)
            for impl_name in ["xla_ref"] + [k for k in impls if k != "xla_ref"]:
                row = dict(meta, impl=impl_name)
                if impl_name in errs:
                    row["max_abs_err_vs_ref"] = errs[impl_name]
                try:
                    t = time_fn(impls[impl_name], inputs, repeats)
                    row.update(
                        time_ms=t * 1e3,
                        gbps=meta["bytes"] / t / 1e9,
                        pct_peak=100 * meta["bytes"] / t / 1e9 / args.peak_hbm_gbps,
                        tflops=meta["flops"] / t / 1e12,
                    )
                    if impl_name == "xla_ref":
                        base = t
                    row["speedup_vs_xla"] = (base / t) if base else None
                except Exception as e:  # noqa: BLE001 -- e.g. OOM or cuDNN unsupported
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                print(_row_line(meta, impl_name, row))
                rows.append(row)
            for v, err in errs.items():
                print(f"{'':<18} check: max|{v} - xla_ref| = {err}")
    if args.json_out:
        _write_json(args, repeats, rows)
    return rows


def _check_variants(impls, inputs, variants):
    """Per implementation asked for (and those always checked), its largest absolute
    difference from the XLA reference's outputs, or the error it raised."""
    want = impls["xla_ref"](*inputs)
    errs = {}
    for v in list(variants) + list(ALSO_CHECKED):
        if v not in impls or v in errs:
            continue
        try:
            got = impls[v](*inputs)
            errs[v] = max(
                float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
            )
        except Exception as e:  # noqa: BLE001 -- reported, benchmark goes on
            errs[v] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    return errs


def _row_line(meta, impl_name, row) -> str:
    """One printed row of the table: the timing, or "n/a" and the error."""
    head = f"{meta['kernel']:<18} {impl_name:<22} {meta['batch']:>2} {meta['context']:>6}"
    if "error" in row:
        return f"{head} {'n/a':>9}  ({row['error'][:60]})"
    return (
        f"{head} {row['time_ms']:>9.3f} {row['gbps']:>8.1f} {row['pct_peak']:>6.1f} "
        f"{row['tflops']:>8.2f} {(row['speedup_vs_xla'] or 0):>6.2f}x"
    )


def _write_json(args, repeats, rows) -> None:
    with open(args.json_out, "w") as f:
        json.dump(
            dict(
                backend=jax.default_backend(),
                device=jax.devices()[0].device_kind,
                peak_hbm_gbps=args.peak_hbm_gbps,
                repeats=repeats,
                interpret=args.interpret,
                jax=jax.__version__,
                variants=args.variants,
                rows=rows,
            ),
            f,
            indent=1,
        )
    print(f"wrote {args.json_out}")


if __name__ == "__main__":
    define_flags()
    app.run(_command_line, flags_parser=_parse_flags)
