"""Report lines and the command line of the dry run (`python -m dflash_jax.dry_run`)."""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from absl import flags

from dflash_jax.dry_run.chips import DEFAULT_TAUS
from dflash_jax.dry_run.presets import build_configs
from dflash_jax.dry_run.programs import (
    DFLASH_DRAFTERS,
    dry_run_infer,
    dry_run_train,
    other_drafters,
)
from dflash_jax.dry_run.topology import (
    UsageError,
    cpu_device_count,
    ensure_cpu_devices,
    is_cpu,
    resolve_mesh,
    topology_devices,
)
from dflash_jax.support import checks


def _gb(n) -> str:
    return "      -" if n is None else f"{n / 2**30:7.2f}"


def format_report(r: Dict[str, Any]) -> str:
    """Human lines for one dry-run result."""
    s = r["settings"]
    chip = r["chip"]
    head = (
        f"{r['model']} {r['mode']} on {r['topology']} ({r['devices']} devices), mesh "
        f"[{r['mesh']}], "
        + (
            f"batch {s['batch']}, context {s['context']}, "
            f"{s['max_new_tokens']} new tokens, block {s['block_size']}"
            if r["mode"] == "infer"
            else f"batch {s['batch']}x{s['seq_len']}, {s['num_anchors']} "
            f"anchors x block {s['block_size']}"
            + (
                f", {s['grad_accum_steps']} micro-batches"
                if s.get("grad_accum_steps", 1) > 1
                else ""
            )
        )
    )
    cap = "" if chip is None else f" (HBM {chip['hbm_bytes'] / 2**30:.0f} GiB per chip)"
    compiled = s.get("compiled_attention") or {}
    if any(a != b for a, b in compiled.items()):
        cap += ", attention " + ", ".join(f"{a} -> {b}" for a, b in compiled.items())
    lines = [
        head + cap,
        "  program            args  out-alias  temps  code   TOTAL GiB/dev  fits   "
        "GFLOP/dev  GB accessed  collective MB (count)",
    ]
    for name, p in r["programs"].items():
        h = p["hbm_bytes"]
        fits = {True: "yes", False: "NO", None: "-"}[p["fits"]]
        if "error" in p:
            lines.append(
                f"  {name:17s} does not fit: needs {_gb(h['total']).strip()} GiB, "
                f"{_gb(p['hbm_capacity_bytes']).strip()} GiB available "
                f"(compiler: {p['error'][:160]})"
            )
            continue
        coll = sum(c["bytes"] * c["count"] for c in p["collectives"]) / 1e6
        ncoll = sum(c["count"] for c in p["collectives"])
        lines.append(
            f"  {name:17s}{_gb(h['arguments'])}  {_gb(h['outputs'] - h['aliased'])}"
            f"{_gb(h['temporaries'])} {h['generated_code'] / 2**20:5.1f}M "
            f"{_gb(h['total'])}       {fits:4s} {p['flops'] / 1e9:10.1f}  "
            f"{p['bytes_accessed'] / 1e9:11.2f}  {coll:9.2f} ({ncoll})"
        )
    scans = {
        n: p["cache_sized_copies"] for n, p in r["programs"].items() if "cache_sized_copies" in p
    }
    if scans:
        lines.append(
            "  cache-sized copies in the loop bodies: "
            + ", ".join(f"{n} {len(c)}" for n, c in scans.items())
            + "".join(f"\n    {c}" for cs in scans.values() for c in cs[:4])
        )
    lines += [f"  note: {n}" for n in r.get("notes", [])]
    roof = r.get("roofline") or {}
    if roof.get("projection"):
        lines.append("  roofline per step (" + roof["note"] + "):")
        for impl, t in roof["projection"].items():
            for kind in ("ar", "dflash") if "speedup_at_tau" in t else ():
                k = t[kind]
                lines.append(
                    f"    {impl:6s} {kind:6s} step {k['step_s'] * 1e3:7.3f} ms = max("
                    f"compute {k['compute_s'] * 1e3:.3f}, memory "
                    f"{k['memory_s'] * 1e3:.3f}) + ICI {k['collective_s'] * 1e3:.3f};"
                    f" weights+KV bound {k['weights_kv_bound_s'] * 1e3:.3f} ms"
                )
            if "speedup_at_tau" in t:  # absent on a GPU: no cost analysis there
                sp = ", ".join(f"tau {tau}: {v:.2f}x" for tau, v in t["speedup_at_tau"].items())
                bd = ", ".join(f"{v:.2f}x" for v in t["bound_speedup_at_tau"].values())
                lines.append(f"    {impl:6s} projected speedup {sp} (weights+KV bound: {bd})")
            if "hbm_speedup_at_tau" in t:
                for kind in ("ar", "dflash"):
                    k = t[kind]
                    lines.append(
                        f"    {impl:6s} {kind:6s} HBM model {k['time_s'] * 1e3:7.3f} ms = max("
                        f"compute {k['compute_s'] * 1e3:.3f}, HBM {k['hbm_s'] * 1e3:.3f}) + ICI "
                        f"{k['collective_s'] * 1e3:.3f} + latency {k['latency_s'] * 1e3:.3f};"
                        f" floor {k['floor_s'] * 1e3:.3f} ms"
                    )
                sp = ", ".join(f"tau {a}: {v:.2f}x" for a, v in t["hbm_speedup_at_tau"].items())
                bd = ", ".join(f"{v:.2f}x" for v in t["floor_speedup_at_tau"].values())
                lines.append(
                    f"    {impl:6s} HBM model: DFlash/AR step {t['hbm_step_ratio']:.2f}x, "
                    f"projected speedup {sp} (floor: {bd})"
                )
        if any("speedup_at_tau" in t for t in roof["projection"].values()):
            lines.append(
                "  (cost analysis of a decode loop counts its body once plus the "
                "once-per-call work outside it; the step figures are two-step-loop minus "
                "one-step-loop differences)"
            )
        else:
            lines.append(
                "  (GPU: the compiler's cost analysis gives no FLOPs or bytes; FLOPs are the "
                "loop body's matmuls, bytes the HBM model's count of the loop body)"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CLI


def run(
    topology: str = "v5e:2x4",
    models: Sequence[str] = ("qwen3_8b",),
    mode: str = "infer",
    meshes: Optional[Sequence[str]] = None,
    json_out: Optional[str] = None,
    **kw,
):
    """Dry-runs every (model, mesh) pair on `topology`, printing a report for each; returns
    the results (and writes them to `json_out`: one dict, or a list for several)."""
    devices, chip = topology_devices(topology)
    if mode == "infer" and "attention" not in kw:
        kw["attention"] = (default_attention(topology),)
    hlo_dir = kw.pop("hlo_dir", None)
    check_outputs(json_out, hlo_dir)  # before any compile: a bad path loses no result
    meshes = meshes or ([f"tensor={len(devices)}"] if mode == "infer" else [f"fsdp={len(devices)}"])
    meshes_ok = [resolve_mesh(mesh, devices) for mesh in meshes]
    for model in models:  # bad names and settings the model cannot take fail before any compile
        check_model_settings(model, mode, meshes_ok, kw)
    fn = dry_run_infer if mode == "infer" else dry_run_train
    results = []
    for model in models:
        for mesh, spec in zip(meshes_ok, meshes):
            if hlo_dir and mode == "infer":
                several = len(models) * len(meshes_ok) > 1
                sub = f"{model}_{spec}".replace("=", "").replace(",", "_")
                kw["hlo_dir"] = os.path.join(hlo_dir, sub) if several else hlo_dir
            r = fn(model=model, mesh=mesh, devices=devices, chip=chip, topology=topology, **kw)
            print(format_report(r), flush=True)
            results.append(r)
    if json_out:
        import json

        from dflash_jax.support import provenance

        # Each result names the command, commit, date and machine that made it.
        prov = provenance.record()
        results = [{**prov, **r} for r in results]
        with open(json_out, "w") as f:
            json.dump(results[0] if len(results) == 1 else results, f, indent=1)
        print(f"wrote {json_out}")
    return results


def check_outputs(json_out: Optional[str], hlo_dir: Optional[str]) -> None:
    """UsageError naming the flag unless --json_out can be written as a file and --hlo_dir as a
    directory (checked before anything is compiled)."""
    try:
        if json_out:
            checks.writable_file(json_out, "--json_out")
        if hlo_dir:
            checks.writable_dir(hlo_dir, "--hlo_dir")
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_model_settings(model: str, mode: str, meshes, kw) -> None:
    """UsageError where `model` cannot take the settings: a context plus new tokens past its
    max_position_embeddings (what `generate` refuses), a --tree_budget that its target or
    block cannot take (`request.check_tree`, as `generate` refuses it), a --draft_vocab_size
    past its vocabulary, an `expert` mesh axis that does not split its experts (what train.py
    refuses)."""
    from dflash_jax.decoding.request import check_tree
    from dflash_jax.parallel import sharding

    tcfg, dcfg = build_configs(model)
    if mode == "infer":
        need = kw.get("context", 0) + kw.get("max_new_tokens", 0)
        if need > tcfg.max_position_embeddings:
            raise UsageError(
                f"{model}: --context {kw['context']} + --max_new_tokens {kw['max_new_tokens']} "
                f"= {need} tokens exceeds the model's context length max_position_embeddings="
                f"{tcfg.max_position_embeddings}"
            )
        try:
            bs = kw.get("block_size") or dcfg.block_size
            check_tree(tcfg, True, bs, kw.get("tree_budget"))
        except ValueError as e:
            raise UsageError(f"{model}: --{e}") from None
        vocab = kw.get("draft_vocab_size")
        if vocab and vocab > tcfg.vocab_size:
            raise UsageError(
                f"{model}: --draft_vocab_size {vocab} exceeds the target's vocabulary of "
                f"{tcfg.vocab_size} tokens"
            )
    for mesh in meshes:
        try:
            sharding.check_expert_axis(mesh.shape.get("expert", 1), tcfg.num_experts)
        except ValueError as e:
            raise UsageError(f"{model}: {e}") from None


def _floats(s: str) -> List[float]:
    """--tau: comma-separated acceptance lengths (tokens per target pass: finite, >= 1)."""
    try:
        taus = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--tau wants comma-separated numbers, got {s!r}") from None
    bad = [t for t in taus if not math.isfinite(t) or t < 1]
    if bad or not taus:
        raise UsageError(
            "--tau wants acceptance lengths (tokens per target pass: finite numbers >= 1), "
            f"got {s!r}"
        )
    return taus


def default_attention(topology: str) -> str:
    """The attention a dry run compiles unless --attention says: the Pallas kernels on a TPU
    topology, XLA's attention on cpu:N (the kernels have no compiled CPU version)."""
    return "xla" if is_cpu(topology) else "pallas"


def _check_sizes(args) -> None:
    """The sizes of the flags `args` (UsageError naming the flag): nothing is replaced by a
    default or accepted out of range."""
    E = UsageError
    if args.batch is not None:
        checks.int_param("--batch", args.batch, lo=1, error=E)
    if args.mode == "infer":
        checks.int_param("--context", args.context, lo=1, error=E)
        checks.int_param("--max_new_tokens", args.max_new_tokens, lo=1, error=E)
        if args.block_size is not None:
            checks.int_param(
                "--block_size",
                args.block_size,
                lo=checks.BLOCK_SIZE_MIN,
                hi=checks.BLOCK_SIZE_MAX,
                error=E,
            )
        if args.prefill_chunk is not None:
            checks.int_param("--prefill_chunk", args.prefill_chunk, lo=0, error=E)
        if getattr(args, "tree_budget", None) is not None:
            checks.int_param(
                "--tree_budget", args.tree_budget, lo=1, hi=checks.MAX_TREE_BUDGET, error=E
            )
        checks.int_param("--drafter_window", getattr(args, "drafter_window", 0), lo=0, error=E)
        drafter = getattr(args, "drafter", "dflash")
        if drafter == "dflash2":
            if getattr(args, "tree_budget", None) is not None:
                raise E("--tree_budget is not implemented for --drafter=dflash2 yet")
            if getattr(args, "denoise_steps", 1) != 1:
                raise E("--denoise_steps is not implemented for --drafter=dflash2 yet")
        if drafter not in ("dflash", "dflash2"):
            for flag, default in (
                ("tree_budget", None),
                ("denoise_steps", 1),
                ("drafter_window", 0),
            ):
                if getattr(args, flag, default) not in (default, None):
                    raise E(f"--{flag} is for DFlash drafters; --drafter={drafter} drafts a chain")
        vocab = getattr(args, "draft_vocab_size", 0)
        checks.int_param("--draft_vocab_size", vocab, lo=0, error=E)
        if vocab:
            from dflash_jax.drafters import registry

            having = [k.name for k in registry.kinds() if k.draft_vocab_default is not None]
            if drafter not in having:
                raise E(f"--draft_vocab_size is for --drafter={' / '.join(having)}")
        denoise = getattr(args, "denoise_steps", 1)
        checks.int_param("--denoise_steps", denoise, lo=1, error=E)
        if denoise != 1:
            from dflash_jax.dry_run.presets import build_configs

            bs = args.block_size or build_configs(args.model)[1].block_size
        if denoise != 1 and denoise > bs - 1:
            raise E(f"--denoise_steps must be in [1, {bs - 1}] (block_size - 1), got {denoise}")
    else:
        checks.int_param("--seq_len", args.seq_len, lo=2, error=E)
        checks.int_param("--num_anchors", args.num_anchors, lo=1, error=E)
        checks.int_param("--loss_chunk_anchors", args.loss_chunk_anchors, lo=0, error=E)


def _programs(s: str) -> tuple:
    names = tuple(x.strip() for x in s.split(",") if x.strip())
    bad = set(names) - {"prefill", "dflash_decode", "ar_decode"}
    if bad or not names:
        raise UsageError(f"--programs: choose from prefill, dflash_decode, ar_decode; got {s!r}")
    return names


PROG = "python -m dflash_jax.dry_run"


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of `python -m dflash_jax.dry_run`, on `flag_values`. Defined only by the
    command line (`__main__`) or on `main`'s own FlagValues: infer.py and train.py have global
    flags of the same names (--topology, --mesh, --json_out, ...) and call this package."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string(
        "topology",
        "v5e:2x4",
        "v5e:2x4, v4:2x2x1, v5p:2x2x1, v6e:2x4, v5e:4x4, v5p:4x4x4, ... or cpu:8",
        **fv,
    )
    flags.DEFINE_string(
        "model",
        "qwen3_8b",
        "comma-separated: qwen3_8b, qwen3_4b, llama31_8b, qwen3_30b_a3b, qwen3_coder_30b_a3b, "
        "small, tiny, tiny_moe, or an HF dir",
        **fv,
    )
    flags.DEFINE_enum("mode", "infer", ["infer", "train"], None, **fv)
    flags.DEFINE_string(
        "mesh",
        "",
        "';'-separated meshes, e.g. 'tensor=8;data=2,"
        "tensor=4' (default: tensor=N for infer, fsdp=N for train)",
        **fv,
    )
    _define_infer_flags(fv)
    _define_train_flags(fv)
    flags.DEFINE_string("json_out", "", "write the result(s) as JSON here", **fv)
    flags.DEFINE_string(
        "hlo_dir",
        "",
        "infer: write each compiled program's optimized HLO text here as <program>.hlo "
        "(prefill.hlo, dflash_decode.hlo, ar_decode.hlo; one subdirectory per model and mesh "
        "when there are several)",
        **fv,
    )


def _define_infer_flags(fv: dict) -> None:
    """`define_flags`: the batch and the inference run's flags."""
    flags.DEFINE_integer("batch", None, None, **fv)
    flags.DEFINE_integer("context", 4096, "infer: prompt tokens", **fv)
    flags.DEFINE_integer("max_new_tokens", 256, None, **fv)
    flags.DEFINE_integer("block_size", None, None, **fv)
    flags.DEFINE_integer(
        "tree_budget",
        None,
        "infer: the DFlash loop verifies a draft tree of this many nodes (default: the chain)",
        **fv,
    )
    flags.DEFINE_integer(
        "denoise_steps",
        1,
        "infer: drafter passes per DFlash step (masked-diffusion denoising; 1: DFlash's one pass)",
        **fv,
    )
    flags.DEFINE_enum(
        "drafter",
        "dflash",
        list(DFLASH_DRAFTERS) + sorted(other_drafters()),  # the registry's kinds
        "infer: the drafter (dflash2: DFlash 2's convolutions and candidate selector at the "
        "published sizes, conv 2 taps / groups of 16, selector rank 256, top-16; eagle3: one "
        "layer at the target's width drafting block_size - 1 tokens one step at a time; "
        "prompt_lookup: n-gram lookup, no parameters), compiled in the DFlash loop's place",
        **fv,
    )
    flags.DEFINE_integer(
        "draft_vocab_size",
        0,
        "infer, --drafter=eagle3: its draft vocabulary (0: 32000 as the published ones, at most "
        "the target's vocabulary)",
        **fv,
    )
    flags.DEFINE_integer(
        "drafter_window",
        0,
        "infer: every drafter layer slides with this window (its context cache a ring of this "
        "many slots); 0: full attention",
        **fv,
    )
    flags.DEFINE_string(
        "quantize",
        "",
        "infer: int8 (the target's decoder linears int8 per output channel, weight-only, as "
        "load_target(quantize='int8')); default: the model's dtype",
        **fv,
    )
    flags.DEFINE_bool(
        "scan_layers",
        False,
        "infer: the target's layers stacked and run as one lax.scan (one compiled layer body)",
        **fv,
    )
    flags.DEFINE_bool(
        "quantize_lm_head", False, "infer: with --quantize=int8, the LM head int8 too", **fv
    )
    flags.DEFINE_string(
        "attention",
        "",
        "infer: comma-separated attention impls to compile (pallas, xla); "
        "train: the one the step uses (pallas: the fused kernel, per shard). Default: "
        "pallas on a TPU topology, xla on cpu:N",
        **fv,
    )
    flags.DEFINE_string(
        "programs",
        "prefill,dflash_decode,ar_decode",
        "infer: which of prefill, dflash_decode, ar_decode to compile",
        **fv,
    )
    flags.DEFINE_integer(
        "prefill_chunk",
        None,
        "infer: prefill chunk (default decoding.Plan's; 0: one pass)",
        **fv,
    )
    flags.DEFINE_string(
        "tau",
        ",".join(map(str, DEFAULT_TAUS)),
        "roofline: acceptance lengths for the projected speedup",
        **fv,
    )


def _define_train_flags(fv: dict) -> None:
    """`define_flags`: the training step's flags."""
    flags.DEFINE_integer("seq_len", 3072, "train: sequence length", **fv)
    flags.DEFINE_integer("num_anchors", 512, None, **fv)
    flags.DEFINE_integer("loss_chunk_anchors", 0, None, **fv)
    flags.DEFINE_integer(
        "grad_accum",
        1,
        "train: micro-batches per step (the config's grad_accum_steps; divides --batch)",
        **fv,
    )


def run_flags(args):
    """The dry run the flags `args` ask for (anything with the flags as attributes: a
    FlagValues of `define_flags`, a namespace); raises UsageError on bad input."""
    n_cpu = cpu_device_count(args.topology)
    _check_sizes(args)
    if n_cpu is not None:
        ensure_cpu_devices(n_cpu)
    meshes = [m for m in args.mesh.split(";") if m.strip()] or None
    attention = args.attention.strip() or default_attention(args.topology)
    if args.mode == "infer":
        kw = dict(
            batch=args.batch or 1,
            context=args.context,
            max_new_tokens=args.max_new_tokens,
            block_size=args.block_size,
            tree_budget=getattr(args, "tree_budget", None),
            denoise_steps=getattr(args, "denoise_steps", 1),
            drafter=getattr(args, "drafter", "dflash"),
            drafter_window=getattr(args, "drafter_window", 0) or None,
            draft_vocab_size=getattr(args, "draft_vocab_size", 0) or None,
            attention=tuple(a.strip() for a in attention.split(",")),
            taus=tuple(_floats(args.tau)),
            prefill_chunk=args.prefill_chunk,
            only=_programs(args.programs),
            hlo_dir=args.hlo_dir or None,
            scan_layers=bool(getattr(args, "scan_layers", False)),
        )
        quantize = getattr(args, "quantize", "") or None
        if quantize is not None or getattr(args, "quantize_lm_head", False):
            from dflash_jax.models.quantization import check_quantize

            try:
                check_quantize(quantize)
            except ValueError:
                raise UsageError(f"--quantize must be int8, got {quantize!r}") from None
            if quantize is None:
                raise UsageError("--quantize_lm_head needs --quantize=int8")
            kw.update(quantize=quantize, quantize_lm_head=bool(args.quantize_lm_head))
    else:
        if getattr(args, "quantize", ""):
            raise UsageError("--quantize is for --mode=infer")
        if getattr(args, "scan_layers", False):
            raise UsageError("--scan_layers is for --mode=infer")
        if (
            getattr(args, "drafter", "dflash") != "dflash"
            or getattr(args, "drafter_window", 0)
            or getattr(args, "draft_vocab_size", 0)
        ):
            raise UsageError(
                "--drafter, --drafter_window and --draft_vocab_size are for --mode=infer"
            )
        if args.hlo_dir:
            raise UsageError("--hlo_dir is for --mode=infer (the decode and prefill programs)")
        impl = attention.split(",")[0].strip()
        if impl not in ("pallas", "xla"):
            raise UsageError(f"--attention for --mode=train: pallas or xla, got {impl!r}")
        kw = dict(
            batch=args.batch or 8,
            seq_len=args.seq_len,
            num_anchors=args.num_anchors,
            loss_chunk_anchors=args.loss_chunk_anchors,
            attention_impl=impl,
            grad_accum_steps=args.grad_accum,
        )
        batch = kw["batch"]
        if args.grad_accum < 1 or batch % args.grad_accum:
            raise UsageError(
                f"--grad_accum {args.grad_accum} must be >= 1 and divide --batch {batch}"
            )
    return run(args.topology, args.model.split(","), args.mode, meshes, args.json_out or None, **kw)


def _no_positional(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments (flags only): {' '.join(argv[1:])}")


def command_line(argv) -> None:
    """absl main of `python -m dflash_jax.dry_run` (flags from `define_flags` on the global
    FLAGS; `dflash_jax.support.cli.run` prints the error line). Library log lines (JAX's) only with
    --verbose or --verbosity, as before absl."""
    from dflash_jax.support import console

    _no_positional(argv)
    console.configure_logging(flags.FLAGS["verbose"].value)
    run_flags(flags.FLAGS)


def main(argv: Optional[Sequence[str]] = None):
    """`python -m dflash_jax.dry_run` with the flags `argv` (no program name; default
    sys.argv[1:]), in this process, on a FlagValues of its own (so a tool with global flags of
    the same names, infer.py, can call it). Bad input: one line `error: ...` on stderr and
    exit status 2, before anything is compiled or written. Returns the results."""
    from dflash_jax.support import cli

    argv = sys.argv[1:] if argv is None else list(argv)
    fv = flags.FlagValues()
    define_flags(fv)
    try:
        rest = fv([PROG, *argv])
    except flags.Error as e:
        cli.fail(cli.one_line(e))
    try:
        _no_positional(rest)
        return run_flags(fv)
    except UsageError as e:
        cli.fail(cli.one_line(e))


def infer_main(
    *,
    topology: str,
    model: str,
    mesh: Optional[str] = None,
    batch: Optional[int] = None,
    context: int = 4096,
    max_new_tokens: int = 256,
    attention: Optional[str] = None,
    tau: str = ",".join(map(str, DEFAULT_TAUS)),
    json_out: Optional[str] = None,
    block_size: Optional[int] = None,
    tree_budget: Optional[int] = None,
    scan_layers: bool = False,
):
    """`infer.py --dry_run`: `main` for --mode=infer with infer.py's flag values (mesh: ';'-
    separated meshes; attention None or "auto": the dry run's default, the TPU kernels on a TPU
    topology). Bad input (a --batch_size or --block_size out of range included: never replaced
    by a default): one line on stderr, exit 2."""
    from dflash_jax.support import cli

    try:
        if batch is not None:
            checks.int_param("--batch_size", batch, lo=1)
        if block_size is not None:
            checks.int_param(
                "--block_size", block_size, lo=checks.BLOCK_SIZE_MIN, hi=checks.BLOCK_SIZE_MAX
            )
    except ValueError as e:
        cli.fail(cli.one_line(e))
    attention = "" if attention in (None, "auto") else attention
    argv = [
        f"--topology={topology}",
        f"--model={model}",
        "--mode=infer",
        f"--mesh={mesh or ''}",
        f"--batch={batch or 1}",
        f"--context={context}",
        f"--max_new_tokens={max_new_tokens}",
        f"--attention={attention}",
        f"--tau={tau}",
        f"--json_out={json_out or ''}",
    ]
    if block_size is not None:
        argv.append(f"--block_size={block_size}")
    if tree_budget is not None:
        argv.append(f"--tree_budget={tree_budget}")
    if scan_layers:
        argv.append("--scan_layers")
    return main(argv)


if __name__ == "__main__":
    from dflash_jax.support import cli

    define_flags()
    cli.run(command_line)
