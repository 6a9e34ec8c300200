"""Dry runs: will a target + DFlash drafter fit a device mesh, and which mesh to rent?

Everything is abstract: parameters are `jax.ShapeDtypeStruct`s (from `jax.eval_shape`) carrying
their `NamedSharding`s, so an 8B model costs no memory. The real programs are lowered and
compiled for a mesh of devices (by default fake CPU devices: `jax_num_cpu_devices`, or
`XLA_FLAGS=--xla_force_host_platform_device_count=8`, set before JAX starts):

  infer: `decoding._prefill` and `decoding._decode` (the whole speculative loop) through
         `sharding.generate_programs`, exactly what `sharding.generate_sharded` runs.
  train: one drafter update: frozen target forward with taps, drafter forward on random-anchor
         blocks, CE through the target's LM head, AdamW (`sharding.train_step_programs`).

From each compiled program it reads the per-device memory (`memory_analysis()`: arguments,
outputs, temporaries, generated code, donated aliases) and `cost_analysis()` FLOPs, and gives a
verdict against device memory sizes (TPU v5e 16 GiB, v4 32 GiB, H100 80 GiB).

Caveats, measured rather than guessed: the compiler is XLA:CPU, so temporaries are those of the
CPU schedule (it keeps bfloat16 dot operands in float32, which inflates temps; TPU/GPU fuse more
and keep bf16). Argument and output sizes (weights, caches, optimizer state) are exact for any
backend with the same shardings. FLOPs of `decode` are those of ONE loop iteration (XLA counts a
while body once): one drafter block pass + one target verify pass of `block_size` tokens.

Usage:  python -m dflash_jax.dry_run --model qwen3_8b --mode infer --meshes "tensor=8;data=2,tensor=4"
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Dict, Optional, Sequence, Union

DEVICE_MEMORY_GIB = {"v5e": 16.0, "v4": 32.0, "h100": 80.0}
# Fraction of device memory a program may use: runtimes reserve some (XLA's default on GPU
# preallocates 75%, but can be raised; TPU keeps a few hundred MiB).
USABLE_FRACTION = 0.92


def ensure_cpu_devices(n: int = 8) -> None:
    """Asks for `n` fake CPU devices. Effective only before JAX initializes its backends."""
    import jax

    try:
        if jax.config.jax_num_cpu_devices in (-1, None) or \
                jax.config.jax_num_cpu_devices < n:
            jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # backends already up: the caller must have set XLA_FLAGS
        pass


# ----------------------------------------------------------------------------- presets


def model_presets():
    """name -> (target ModelConfig, drafter kwargs for make_drafter_config), in bfloat16."""
    import jax.numpy as jnp

    from dflash_jax.config import ModelConfig

    bf16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    llama_scaling = tuple(sorted({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}.items()))
    return {
        "qwen3_8b": (ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                 num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                                 tie_word_embeddings=False, max_position_embeddings=40960,
                                 **bf16),
                     dict(num_layers=5, num_taps=5, block_size=16, mask_token_id=151669)),
        "qwen3_4b": (ModelConfig(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                                 num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                                 tie_word_embeddings=True, max_position_embeddings=40960,
                                 **bf16),
                     dict(num_layers=5, num_taps=5, block_size=16, mask_token_id=151669)),
        "llama31_8b": (ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096,
                                   intermediate_size=14336, num_layers=32, num_heads=32,
                                   num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                                   rope_theta=500000.0, rope_scaling=llama_scaling,
                                   qk_norm=False, tie_word_embeddings=False,
                                   max_position_embeddings=131072, **bf16),
                       dict(num_layers=5, num_taps=5, block_size=10, mask_token_id=128002)),
        # An 8B-shaped model scaled down (widths / 8, 2 layers) for tests.
        "small": (ModelConfig(vocab_size=19008, hidden_size=512, intermediate_size=1536,
                              num_layers=2, num_heads=16, num_kv_heads=8, head_dim=32,
                              tie_word_embeddings=False, max_position_embeddings=40960,
                              **bf16),
                  dict(num_layers=1, num_taps=2, block_size=16, mask_token_id=19000,
                       target_layer_ids=(0, 1))),
    }


def build_configs(model: str, dtype: Optional[str] = None):
    """(target ModelConfig, DrafterConfig) of a preset, or of a Hugging Face model directory
    (its config.json; drafter: 5 layers, 5 taps, block 16); `dtype` overrides bfloat16."""
    from dflash_jax.config import as_dtype
    from dflash_jax.drafter import make_drafter_config

    presets = model_presets()
    if model not in presets and os.path.isfile(os.path.join(str(model), "config.json")):
        import json

        from dflash_jax.config import ModelConfig

        with open(os.path.join(str(model), "config.json")) as f:  # a Hugging Face directory
            tcfg = ModelConfig.from_hf(json.load(f), dtype=dtype or "bfloat16")
        return tcfg, make_drafter_config(tcfg)
    if model not in presets:
        raise ValueError(f"unknown model {model!r}; presets: {sorted(presets)}")
    tcfg, dkw = presets[model]
    if dtype is not None:
        tcfg = tcfg.replace(dtype=as_dtype(dtype), param_dtype=as_dtype(dtype))
    return tcfg, make_drafter_config(tcfg, **dkw)


def abstract_params(tcfg, dcfg):
    """(target, drafter) parameter shapes: ShapeDtypeStruct pytrees, nothing allocated."""
    import jax

    from dflash_jax.drafter import init_drafter_params
    from dflash_jax.model import init_params

    return (jax.eval_shape(lambda: init_params(tcfg)),
            jax.eval_shape(lambda: init_drafter_params(dcfg)))


# ------------------------------------------------------------------------- training step


def loss_weight_gamma(block_size: int) -> float:
    """Decay of the per-position loss weight: 7 for bs 16, 5 for bs 10, 4 for bs 8."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2.3))


def make_optimizer(lr: float = 6e-4, total_steps: int = 10000):
    """The trainer's optimizer with the recipe's defaults (AdamW, warm-up cosine, clip 1.0, no
    weight decay) at learning rate `lr`."""
    from dflash_jax.training.trainer import default_config
    from dflash_jax.training.trainer import make_optimizer as trainer_optimizer

    config = default_config()
    config.learning_rate = lr
    return trainer_optimizer(config, total_steps)[0]


# ------------------------------------------------------------------------------ analysis


def resolve_mesh(mesh: Union[str, dict, Any], devices=None):
    """A Mesh from "tensor=8" / {"tensor": 8} / a Mesh, on the first devices it needs."""
    import jax

    from dflash_jax import sharding

    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    spec = sharding.parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh)
    if devices is None:
        devices = jax.devices()
        n = math.prod(v for v in spec.values() if v != -1)
        if len(devices) < n:
            raise RuntimeError(
                f"mesh {mesh!r} needs {n} devices but JAX sees {len(devices)}. For a dry run "
                "on CPU start Python with XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                "(or call dflash_jax.dry_run.ensure_cpu_devices(8) before any other JAX call).")
        if -1 not in spec.values():
            devices = devices[:n]
    return sharding.make_mesh(**spec, devices=devices)


def _program_stats(compiled, compile_s: float) -> Dict[str, Any]:
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    out = {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "code_bytes": int(mem.generated_code_size_in_bytes),
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "compile_s": compile_s,
    }
    # Live at the peak: inputs, outputs not aliased to (donated) inputs, scratch, code.
    out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                         + out["temp_bytes"] + out["code_bytes"])
    return out


def _verdict(peak_bytes: int) -> Dict[str, bool]:
    return {name: peak_bytes <= gib * USABLE_FRACTION * 2 ** 30
            for name, gib in DEVICE_MEMORY_GIB.items()}


def _tree_bytes_per_device(tree, shardings) -> int:
    import jax
    import numpy as np

    total = 0
    for x, s in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings)):
        shard = s.shard_shape(np.shape(x))
        total += math.prod(shard) * np.dtype(x.dtype).itemsize
    return total


def _tree_bytes(tree) -> int:
    import jax
    import numpy as np

    return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))


def _compile(lower_fn):
    t0 = time.perf_counter()
    compiled = lower_fn().compile()
    return compiled, time.perf_counter() - t0


def dry_run_infer(model: str = "qwen3_8b", mesh: Union[str, dict, Any] = "tensor=8",
                  batch: int = 1, context: int = 4096, max_new_tokens: int = 256,
                  block_size: Optional[int] = None, dtype: Optional[str] = None,
                  autoregressive: bool = False, devices=None) -> Dict[str, Any]:
    """Compiles the real prefill and decode programs for `model` on `mesh` and measures them.

    mesh: "tensor=8", "data=2,tensor=4", a dict of axis sizes, or a `jax.sharding.Mesh`.
    context: prompt tokens (padded to a power of two as `generate` does); the caches hold
    context + max_new_tokens (rounded up) + block_size positions.
    Returns a dict: model, mesh, batch, context, capacity, param_bytes / cache_bytes (per
    device), programs {prefill, decode: memory and FLOPs}, peak_bytes, fits {v5e, v4, h100}.
    """
    import jax

    from dflash_jax import decoding, sharding
    from dflash_jax.drafter import DFlashDrafter
    from dflash_jax.model import Transformer

    tcfg, dcfg = build_configs(model, dtype)
    if autoregressive:
        dcfg = None
    m = resolve_mesh(mesh, devices)
    bs = 1 if dcfg is None else (block_size or dcfg.block_size)
    plan = decoding.Plan(block_size=bs, attention_impl="xla")
    p_pad = decoding._bucket(context, 16)
    n_buf = decoding._bucket(max_new_tokens + 1, 32)
    capacity = p_pad + n_buf + bs
    tparams, dparams = abstract_params(tcfg, build_configs(model, dtype)[1])
    if dcfg is None:
        dparams = None
    tmod = Transformer(tcfg, "xla")
    dmod = None if dcfg is None else DFlashDrafter(dcfg)

    prefill_jit, decode_jit, sh = sharding.generate_programs(
        tmod, dmod, plan, capacity, n_buf, m, tparams, dparams, batch, p_pad)
    tp = sharding.with_shardings(tparams, sh["tparams"])
    dp = None if dparams is None else sharding.with_shardings(dparams, sh["dparams"])
    ids, lens, max_new, key = sh["arg_shapes"]
    ids = jax.ShapeDtypeStruct(ids.shape, ids.dtype, sharding=sh["ids"])
    lens = jax.ShapeDtypeStruct(lens.shape, lens.dtype, sharding=sh["lens"])
    state = sharding.with_shardings(sh["state_shape"], sh["state"])

    prefill_x, prefill_s = _compile(lambda: prefill_jit.lower(tp, dp, ids, lens, max_new, key))
    decode_x, decode_s = _compile(lambda: decode_jit.lower(tp, dp, state))
    programs = {"prefill": _program_stats(prefill_x, prefill_s),
                "decode": _program_stats(decode_x, decode_s)}
    peak = max(p["peak_bytes"] for p in programs.values())
    param_bytes = _tree_bytes_per_device(tparams, sh["tparams"])
    if dparams is not None:
        param_bytes += _tree_bytes_per_device(dparams, sh["dparams"])
    st = sh["state_shape"]
    caches = [st.cache] + ([st.ctx] if st.ctx is not None else [])
    cache_bytes = sum(_tree_bytes_per_device(c, sharding.cache_sharding(c, m)) for c in caches)
    return {"mode": "infer", "model": model, "mesh": sharding.mesh_str(m),
            "devices": int(m.size), "batch": batch, "context": context, "prompt_pad": p_pad,
            "capacity": capacity, "block_size": bs, "param_bytes": param_bytes,
            "cache_bytes": cache_bytes, "param_bytes_total": _tree_bytes(tparams)
            + (0 if dparams is None else _tree_bytes(dparams)),
            "programs": programs, "peak_bytes": peak,
            "fits": _verdict(peak), "backend": jax.default_backend()}


def dry_run_train(model: str = "qwen3_8b", mesh: Union[str, dict, Any] = "fsdp=8",
                  batch: int = 8, seq_len: int = 3072, num_anchors: int = 64,
                  dtype: Optional[str] = None, loss_fn=None, devices=None,
                  loss_chunk_anchors: int = 0) -> Dict[str, Any]:
    """Compiles one drafter training step (frozen target forward with taps, drafter on
    `num_anchors` random-anchor blocks per sequence, CE through the target LM head, AdamW) for
    `model` on `mesh` (global `batch` sequences of `seq_len`; `loss_chunk_anchors` as in the
    trainer's recipe). Drafter params and AdamW moments
    are float32 master copies (the target stays in its dtype). `loss_fn(dparams, tparams,
    batch)` (a batch of `batch_shapes`) defaults to the trainer's drafter loss.
    Returns a dict like `dry_run_infer` with programs {train_step}.
    """
    import jax
    import jax.numpy as jnp

    from dflash_jax import sharding
    from dflash_jax.drafter import DFlashDrafter
    from dflash_jax.model import Transformer

    tcfg, dcfg = build_configs(model, dtype)
    # Trainable drafter weights in float32 (bf16 compute), as mixed-precision training keeps.
    dcfg = dcfg.replace(body=dcfg.body.replace(param_dtype=jnp.float32))
    m = resolve_mesh(mesh, devices)
    tparams, dparams = abstract_params(tcfg, dcfg)
    tmod, dmod = Transformer(tcfg, "xla"), DFlashDrafter(dcfg)
    loss_name = "custom"
    if loss_fn is None:
        loss_fn, batch_shape, loss_name = _default_loss(tmod, dmod, batch, seq_len, num_anchors,
                                                        loss_chunk_anchors)
    else:
        batch_shape = batch_shapes(batch, seq_len)
    opt = make_optimizer()
    step_jit, sh = sharding.train_step_programs(
        loss_fn, opt, m, dparams, tparams, batch_shape,
        target_head_dim=tcfg.head_dim, drafter_head_dim=dcfg.body.head_dim)
    args = (sharding.with_shardings(dparams, sh["dparams"]),
            sharding.with_shardings(sh["opt_shape"], sh["opt_state"]),
            sharding.with_shardings(tparams, sh["tparams"]),
            sharding.with_shardings(batch_shape, sh["batch"]))
    step_x, step_s = _compile(lambda: step_jit.lower(*args))
    programs = {"train_step": _program_stats(step_x, step_s)}
    peak = programs["train_step"]["peak_bytes"]
    return {"mode": "train", "model": model, "mesh": sharding.mesh_str(m),
            "devices": int(m.size), "batch": batch, "seq_len": seq_len,
            "num_anchors": num_anchors, "loss_chunk_anchors": loss_chunk_anchors,
            "block_size": dcfg.block_size,
            "param_bytes": _tree_bytes_per_device(tparams, sh["tparams"])
            + _tree_bytes_per_device(dparams, sh["dparams"]),
            "opt_bytes": _tree_bytes_per_device(sh["opt_shape"], sh["opt_state"]),
            "param_bytes_total": _tree_bytes(tparams) + _tree_bytes(dparams),
            "opt_bytes_total": _tree_bytes(sh["opt_shape"]),
            "programs": programs, "peak_bytes": peak, "fits": _verdict(peak),
            "loss": loss_name, "backend": jax.default_backend()}


def _default_loss(tmod, dmod, batch: int, seq_len: int, num_anchors: int,
                  loss_chunk_anchors: int = 0):
    """(loss_fn, batch shapes, name): the trainer's `training.losses.drafter_loss`."""
    import jax

    from dflash_jax.training import losses

    cfg = dmod.cfg
    recipe = losses.DrafterRecipe(block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                                  tap_layers=tuple(cfg.target_layer_ids),
                                  num_anchors=num_anchors,
                                  gamma=loss_weight_gamma(cfg.block_size),
                                  loss_chunk_anchors=loss_chunk_anchors)

    def loss_fn(dparams, tparams, b):
        # A fixed key: anchors are data-dependent only in value, not in cost.
        return losses.drafter_loss(tmod, dmod, recipe, dparams, tparams, b,
                                   jax.random.PRNGKey(0))[0]

    return loss_fn, batch_shapes(batch, seq_len), "training.losses.drafter_loss"


def batch_shapes(batch: int, seq_len: int):
    """Abstract training batch: the packed-row layout of `dflash_jax.data`."""
    import jax
    import jax.numpy as jnp

    return {"input_ids": jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
            "loss_mask": jax.ShapeDtypeStruct((batch, seq_len), jnp.float32),
            "segment_ids": jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)}


# ------------------------------------------------------------------------------ printing


def _gib(n) -> str:
    return f"{n / 2 ** 30:7.2f}"


def format_report(result: Dict[str, Any]) -> str:
    """A few human lines for one dry-run result."""
    head = (f"{result['model']} {result['mode']} mesh[{result['mesh']}] on "
            f"{result['devices']} {result['backend']} devices, batch {result['batch']}, "
            + (f"context {result['context']} (cache {result['capacity']})"
               if result["mode"] == "infer" else
               f"seq {result['seq_len']}, {result['num_anchors']} anchors x "
               f"bs {result['block_size']}, loss {result['loss']}"))
    lines = [head, "  program       args GiB  out GiB  temp GiB  code MiB  peak GiB   "
                   "TFLOP/dev  compile s"]
    for name, p in result["programs"].items():
        lines.append(f"  {name:12s} {_gib(p['argument_bytes'])}  {_gib(p['output_bytes'])}  "
                     f"{_gib(p['temp_bytes'])}  {p['code_bytes'] / 2 ** 20:8.1f}  "
                     f"{_gib(p['peak_bytes'])}  {p['flops'] / 1e12:10.3f}  "
                     f"{p['compile_s']:9.1f}")
    fits = ", ".join(f"{k} ({DEVICE_MEMORY_GIB[k]:.0f} GiB): {'FITS' if v else 'no'}"
                     for k, v in result["fits"].items())
    extra = (f"params {_gib(result['param_bytes']).strip()} GiB/dev, caches "
             f"{_gib(result['cache_bytes']).strip()} GiB/dev" if result["mode"] == "infer" else
             f"params {_gib(result['param_bytes']).strip()} GiB/dev, AdamW "
             f"{_gib(result['opt_bytes']).strip()} GiB/dev")
    lines.append(f"  {extra}; verdict: {fits}")
    return "\n".join(lines)


DEFAULT_INFER_MESHES = ("tensor=8", "data=2,tensor=4", "data=4,tensor=2")
DEFAULT_TRAIN_MESHES = ("fsdp=8", "fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2")


def run(models: Sequence[str] = ("qwen3_8b",), mode: str = "infer",
        meshes: Optional[Sequence[str]] = None, **kw):
    """Dry-runs every (model, mesh) pair, printing a report for each; returns the results."""
    results = []
    fn = dry_run_infer if mode == "infer" else dry_run_train
    meshes = meshes or (DEFAULT_INFER_MESHES if mode == "infer" else DEFAULT_TRAIN_MESHES)
    for model in models:
        for mesh in meshes:
            r = fn(model=model, mesh=mesh, **kw)
            print(format_report(r), flush=True)
            results.append(r)
    return results


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3_8b",
                    help="comma-separated presets: qwen3_8b, qwen3_4b, llama31_8b, small")
    ap.add_argument("--mode", default="infer", choices=("infer", "train"))
    ap.add_argument("--meshes", default="", help="';'-separated, e.g. 'tensor=8;data=2,tensor=4'")
    ap.add_argument("--devices", type=int, default=8, help="fake CPU devices")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--context", type=int, default=4096, help="infer: prompt tokens")
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--seq_len", type=int, default=3072, help="train: sequence length")
    ap.add_argument("--num_anchors", type=int, default=64)
    ap.add_argument("--loss_chunk_anchors", type=int, default=0,
                    help="train: drafter logits for this many anchors at a time (0: all)")
    ap.add_argument("--json", default="", help="write the results to this JSON file")
    args = ap.parse_args(argv)
    ensure_cpu_devices(args.devices)
    meshes = [m for m in args.meshes.split(";") if m.strip()] or None
    if args.mode == "infer":
        kw = dict(batch=args.batch or 1, context=args.context,
                  max_new_tokens=args.max_new_tokens)
    else:
        kw = dict(batch=args.batch or 8, seq_len=args.seq_len, num_anchors=args.num_anchors,
                  loss_chunk_anchors=args.loss_chunk_anchors)
    results = run(args.model.split(","), args.mode, meshes, **kw)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
