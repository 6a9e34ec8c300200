"""Dry runs: the real programs compiled for real TPUs on this machine, no TPU needed.

    python -m dflash_jax.dry_run --topology=v5e:2x4 --model=qwen3_8b --mode=infer \\
        [--mesh=tensor=8 --batch=1 --context=4096 --max_new_tokens=256 --block_size=16] \\
        [--attention=pallas,xla] [--tau=6.5,5.4] [--json_out=FILE]
    python -m dflash_jax.dry_run --topology=v5p:2x2x1 --model=qwen3_8b --mode=train --mesh=fsdp=4

With the `libtpu` wheel installed (`pip install "jax[tpu]==<your jax version>"`),
`jax.experimental.topologies.get_topology_desc` gives abstract TPU devices on a CPU-only
machine and `jit(...).lower(...).compile()` on a mesh of them runs the real TPU compiler (Mosaic
for the Pallas kernels included); the CPU stays the runtime backend (JAX_PLATFORMS=cpu).
Parameters are abstract (`jax.eval_shape`): an 8B model costs no memory.

  infer: the programs of `decoding.generate` through `sharding.generate_programs`: the prefill,
         the DFlash decode loop and the autoregressive decode loop, sharded by the partition
         rules, for each attention implementation asked for ("pallas": the TPU kernels).
  train: the trainer's own step: `training.trainer.make_train_step` with the shardings of
         `train_shardings` and the loss of `drafter_loss_fn` (the paper recipe's settings).

Per program, from the TPU compiler: HBM per device (arguments, outputs, aliased, temporaries,
generated code, total) against the chip's capacity ("fits"), FLOPs and bytes accessed (the
compiled cost analysis), and the collectives of the compiled HLO with their bytes. A compile that
fails with RESOURCE_EXHAUSTED is reported as "does not fit" with the compiler's numbers.

What the cost analysis of the decode loop counts (measured, see `_loop_step_costs`): the
`while_loop` body ONCE (the FLOPs of the loop program equal those of one `spec_step` compiled on
its own), plus the work outside the loop that runs once per call, notably the weight relayout
copies the compiler hoists out of the loop (each weight read and written once). So its bytes are
not one step's. The roofline therefore takes one step's FLOPs, bytes and collectives as the
difference between the loop program with two `spec_step`s per iteration and the real one.

The roofline (`roofline`): time per step = max(FLOPs / peak, bytes / HBM bandwidth) +
collective bytes moved / ICI bandwidth, from published chip figures (`TPU_CHIPS`), and the
speedup tau * t_AR / t_DFlash. PROJECTIONS, not measurements: no collective latency, no
host overhead, perfect overlap inside each step.

`--topology=cpu:8` compiles for 8 fake CPU devices instead (XLA:CPU; no libtpu needed).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Union

# Published per-chip figures (bf16 peak, HBM capacity / bandwidth, bidirectional ICI bandwidth
# per chip). Sources: Google Cloud TPU system-architecture pages,
#   v4:  https://cloud.google.com/tpu/docs/v4      (275 TFLOP/s, 32 GiB, 1200 GB/s; ICI not
#        given there: 6 links x 90 GB/s bidirectional from "How to Scale Your Model",
#        https://jax-ml.github.io/scaling-book/tpus)
#   v5e: https://cloud.google.com/tpu/docs/v5e     (197 TFLOP/s, 16 GB, 819 GB/s, ICI 400 GB/s)
#   v5p: https://cloud.google.com/tpu/docs/v5p     (459 TFLOP/s, 95 GB, 2765 GB/s, ICI 1200 GB/s)
#   v6e: https://cloud.google.com/tpu/docs/v6e     (918 TFLOP/s, 32 GB, 1638 GB/s, ICI 800 GB/s)
# v4 and v5p have two TensorCores per chip run as one device (megacore): one JAX device = one
# chip. `host` is the chips-per-host shape of a full host (v5e/v6e: 8 chips, v4/v5p: 4).
TPU_CHIPS = {
    "v4": dict(hbm_bytes=32 * 2 ** 30, bf16_flops=275e12, hbm_bw=1200e9, ici_bw=540e9,
               host=(2, 2, 1), topology_kw=dict(chip_config_name="megacore")),
    "v5e": dict(hbm_bytes=16 * 2 ** 30, bf16_flops=197e12, hbm_bw=819e9, ici_bw=400e9,
                host=(2, 4, 1), topology_kw={}),
    "v5p": dict(hbm_bytes=95 * 2 ** 30, bf16_flops=459e12, hbm_bw=2765e9, ici_bw=1200e9,
                host=(2, 2, 1), topology_kw={}),
    "v6e": dict(hbm_bytes=32 * 2 ** 30, bf16_flops=918e12, hbm_bw=1638e9, ici_bw=800e9,
                host=(2, 4, 1), topology_kw={}),
}
# The published tau for the default --tau: the DFlash paper's Qwen3-8B (greedy, block 16) and
# the public JAX/TPU port's Qwen3-4B on v5p-8 (3.13x measured at tau 5.42).
DEFAULT_TAUS = (6.5, 5.4)
PROJECTED = ("PROJECTED from the compiled programs' cost analysis and published chip figures; "
             "not measured on a TPU")


class UsageError(ValueError):
    """Bad user input: the CLI prints the one line and exits with code 2."""


def ensure_cpu_devices(n: int = 8) -> None:
    """Asks for `n` fake CPU devices. Effective only before JAX initializes its backends."""
    import jax

    try:
        if jax.config.jax_num_cpu_devices in (-1, None) or \
                jax.config.jax_num_cpu_devices < n:
            jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # backends already up: the caller must have set XLA_FLAGS
        pass


# ----------------------------------------------------------------------------- topologies


def libtpu_missing() -> bool:
    return importlib.util.find_spec("libtpu") is None


def topology_devices(topology: str):
    """(devices, chip figures or None) of a topology name: "v5e:2x4", "v4:2x2x1", "v5p:4x4x4",
    "v6e:2x4", ... (abstract TPU devices, compile-only), or "cpu:N" (N fake CPU devices)."""
    import jax

    chip, _, shape = topology.partition(":")
    if chip == "cpu":
        n = int(shape or 8)
        devices = jax.devices("cpu")
        if len(devices) < n:
            raise UsageError(f"topology {topology!r} needs {n} CPU devices but JAX has "
                             f"{len(devices)}: start Python with XLA_FLAGS="
                             f"--xla_force_host_platform_device_count={n}")
        return devices[:n], None
    if chip not in TPU_CHIPS or not re.fullmatch(r"\d+(x\d+){1,2}", shape):
        raise UsageError(f"unknown topology {topology!r}: use <chip>:<shape> with chip one of "
                         f"{sorted(TPU_CHIPS)} (e.g. v5e:2x4, v6e:2x4, v4:2x2x1, v5p:2x2x1, "
                         "v5p:4x4x4), or cpu:8")
    if libtpu_missing():
        import jax as _jax

        raise UsageError(f"compiling for {topology} needs libtpu: pip install "
                         f"\"jax[tpu]=={_jax.__version__}\" (compile-only; no TPU needed)")
    # Compile-only clients in several processes at once (parallel tests, other users): libtpu's
    # lockfile is for processes that own a real TPU.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    dims = [int(d) for d in shape.split("x")] + [1]
    spec = TPU_CHIPS[chip]
    host = tuple(min(h, d) for h, d in zip(spec["host"], dims[:3]))
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                            chips_per_host_bounds=host,
                                            **spec["topology_kw"])
    except Exception as e:  # e.g. a shape the chip does not come in
        raise UsageError(f"topology {topology!r} rejected by libtpu: "
                         f"{str(e).splitlines()[0][:200]}") from None
    return list(topo.devices), dict(spec, chip=chip)


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
        # Smaller still, with the 8B head shapes (head_dim 128, 8 KV heads): compile tests.
        "tiny": (ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=512,
                             num_layers=2, num_heads=16, num_kv_heads=8, head_dim=128,
                             tie_word_embeddings=False, max_position_embeddings=40960,
                             **bf16),
                 dict(num_layers=1, num_taps=2, block_size=16, mask_token_id=2000,
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
        raise UsageError(f"unknown model {model!r}: use one of {sorted(presets)} or a Hugging "
                         "Face model directory (with config.json)")
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


def train_config(batch: int = 8, seq_len: int = 3072, num_anchors: int = 512,
                 loss_chunk_anchors: int = 0, attention_impl: str = "xla"):
    """The trainer's config (the paper recipe's defaults) with these data/recipe settings."""
    from configs.default import get_config as default_config

    c = default_config()
    c.data.batch_size, c.data.seq_len = batch, seq_len
    c.num_anchors, c.loss_chunk_anchors = num_anchors, loss_chunk_anchors
    c.attention_impl = attention_impl
    return c


# ------------------------------------------------------------------------------ analysis


def resolve_mesh(mesh: Union[str, dict, Any], devices=None):
    """A Mesh from "tensor=8" / {"tensor": 8} / a Mesh over `devices` (default: the first
    devices of `jax.devices()` it needs). A mesh the devices cannot hold is a UsageError."""
    import jax

    from dflash_jax import sharding

    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    try:
        spec = sharding.parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh)
    except ValueError as e:
        raise UsageError(str(e)) from None
    n = math.prod(v for v in spec.values() if v != -1)
    if devices is None:
        devices = jax.devices()
        if len(devices) < n:
            raise UsageError(
                f"mesh {mesh!r} needs {n} devices but JAX sees {len(devices)}. For a dry run "
                "on CPU start Python with XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                "(or call dflash_jax.dry_run.ensure_cpu_devices(8) before any other JAX call).")
        if -1 not in spec.values():
            devices = devices[:n]
    try:
        return sharding.make_mesh(**spec, devices=devices)
    except ValueError as e:
        raise UsageError(f"mesh {mesh!r} does not match the {len(devices)} devices of the "
                         f"topology ({e}); e.g. --mesh=tensor={len(devices)}") from None


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_COLLECTIVE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute|collective-broadcast)(-start)?\(")


def _shapes(text: str) -> List[int]:
    out = []
    for dt, dims in _ARRAY.findall(text):
        out.append(math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dt])
    return out


def _group_size(line: str) -> Optional[int]:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)  # iota form [groups, size]
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)  # explicit groups
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)  # named mesh axes
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        axes = re.findall(r"'([^']+)'", m.group(2))
        return math.prod(int(sizes.get(a, 1)) for a in axes)
    return None


def collectives(hlo_text: str) -> List[Dict[str, Any]]:
    """The collectives of a compiled HLO module, grouped by (op, bytes, group size), with
    `bytes` = the per-device size of the collective's result (an all-gather's gathered array,
    an all-reduce's reduced one) and `moved_bytes` = what one device sends in a ring algorithm:
    all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n, permute 1x."""
    groups: Dict[tuple, Dict[str, Any]] = {}
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        result, op, start = m.groups()
        sizes = _shapes(result)
        if not sizes:
            continue
        if start and op in ("all-gather", "collective-permute") and len(sizes) >= 2:
            nbytes = sizes[1] if op == "collective-permute" else sum(sizes[len(sizes) // 2:])
        elif start and op in ("all-gather", "reduce-scatter", "all-to-all"):
            nbytes = max(sizes)
        else:
            nbytes = sum(sizes)
        n = _group_size(line)
        factor = {"all-reduce": 2.0}.get(op, 1.0)
        if n and op != "collective-permute":
            factor *= (n - 1) / n
        key = (op, nbytes, n)
        g = groups.setdefault(key, dict(op=op, bytes=nbytes, group_size=n, count=0,
                                        moved_bytes=0.0))
        g["count"] += 1
        g["moved_bytes"] += factor * nbytes
    return sorted(groups.values(), key=lambda g: -g["moved_bytes"])


def _hbm_numbers(message: str) -> Dict[str, float]:
    """Byte figures the TPU compiler's RESOURCE_EXHAUSTED message gives (used / available)."""
    unit = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
    num = lambda v, u: float(v) * unit[u.upper()[:1] if u else ""]
    out = {}
    m = re.search(r"Used ([\d.]+)([KMGT]?)\S* of ([\d.]+)([KMGT]?)\S* hbm", message)
    if m:
        out["required"], out["available"] = num(*m.group(1, 2)), num(*m.group(3, 4))
    m = re.search(r"\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)", message)
    if m:
        out.setdefault("required", num(*m.group(1, 2)))
        out.setdefault("available", num(*m.group(3, 4)))
    return out


def compile_stats(lower_fn, capacity: Optional[int]) -> Dict[str, Any]:
    """Compiles `lower_fn()` and reads the memory plan, cost analysis and collectives. A
    RESOURCE_EXHAUSTED compile gives fits=False with the compiler's numbers, not an error."""
    t0 = time.perf_counter()
    try:
        compiled = lower_fn().compile()
    except Exception as e:  # noqa: BLE001 - only out-of-memory is a result; others re-raise
        msg = str(e)
        if "RESOURCE_EXHAUSTED" not in msg and "Ran out of memory" not in msg:
            raise
        nums = _hbm_numbers(msg)
        return {"fits": False, "hbm_bytes": {"total": nums.get("required")},
                "hbm_capacity_bytes": nums.get("available", capacity), "flops": None,
                "bytes_accessed": None, "collectives": [],
                "compile_s": time.perf_counter() - t0,
                "error": " ".join(msg.split())[:600]}
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    hbm = {"arguments": int(mem.argument_size_in_bytes),
           "outputs": int(mem.output_size_in_bytes),
           "aliased": int(mem.alias_size_in_bytes),
           "temporaries": int(mem.temp_size_in_bytes),
           "generated_code": int(mem.generated_code_size_in_bytes)}
    # Live at the peak: inputs, outputs not aliased to (donated) inputs, scratch, code.
    hbm["total"] = (hbm["arguments"] + hbm["outputs"] - hbm["aliased"] + hbm["temporaries"]
                    + hbm["generated_code"])
    return {"fits": None if capacity is None else hbm["total"] <= capacity,
            "hbm_bytes": hbm, "hbm_capacity_bytes": capacity,
            "flops": float(cost.get("flops", 0.0)),
            "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "collectives": collectives(compiled.as_text()), "compile_s": compile_s}


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


def _moved(stats) -> float:
    return sum(c["moved_bytes"] for c in stats["collectives"])


# ---------------------------------------------------------------------------- inference


def _loop_program(tmod, dmod, plan, reps: int):
    """The decode while_loop with `reps` spec_steps per iteration (reps=1: `decoding._decode`,
    up to the jit wrapper); for isolating one step's cost (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    from dflash_jax import decoding

    def run(tp, dp, state):
        n_buf = state.tokens.shape[1]

        def body(s):
            for _ in range(reps):
                s = decoding.spec_step(tmod, tp, dmod, dp, plan, s)
            return s

        return jax.lax.while_loop(lambda s: (~jnp.all(s.done)) & (s.step < n_buf), body, state)

    return run


def dry_run_infer(model: str = "qwen3_8b", mesh: Union[str, dict, Any] = "tensor=8",
                  batch: int = 1, context: int = 4096, max_new_tokens: int = 256,
                  block_size: Optional[int] = None, dtype: Optional[str] = None,
                  devices=None, chip: Optional[dict] = None,
                  attention: Sequence[str] = ("pallas",), step_costs: bool = True,
                  prefill_chunk: Optional[int] = None, topology: str = "",
                  taus: Sequence[float] = DEFAULT_TAUS,
                  only: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Compiles the prefill, DFlash decode and autoregressive decode programs of `generate` for
    `model` on `mesh` (over `devices`: a topology's, default the first JAX devices) for each
    attention implementation in `attention`, and, with `step_costs`, one step of each decode
    loop (the roofline's input). context: prompt tokens (padded to a power of two as `generate`
    does); the caches hold context + max_new_tokens (rounded up) + block_size positions.
    only: a subset of ("prefill", "dflash_decode", "ar_decode") to compile (default: all).
    prefill_chunk: overrides `decoding.Plan.prefill_chunk` (0: one-pass prefill).
    Returns the dry-run JSON dict (module docstring)."""
    import jax

    from dflash_jax import attention as attn_lib
    from dflash_jax import decoding, sharding
    from dflash_jax.drafter import DFlashDrafter
    from dflash_jax.model import Transformer

    tcfg, dcfg = build_configs(model, dtype)
    m = resolve_mesh(mesh, devices)
    capacity_bytes = None if chip is None else chip["hbm_bytes"]
    bs = block_size or dcfg.block_size
    p_pad = decoding._bucket(context, 16)
    n_buf = decoding._bucket(max_new_tokens + 1, 32)
    tparams, dparams = abstract_params(tcfg, dcfg)
    programs: Dict[str, Any] = {}
    steps: Dict[str, Any] = {}
    sizes: Dict[str, int] = {}
    for impl_name in attention:
        impl = attn_lib.for_devices(impl_name, m)
        for kind in ("dflash", "ar"):
            want = {"prefill", "dflash_decode", "ar_decode"} if only is None else set(only)
            if not ({f"{kind}_decode"} | ({"prefill"} if kind == "dflash" else set())) & want:
                continue
            k_bs = bs if kind == "dflash" else 1
            plan_kw = {} if prefill_chunk is None else dict(prefill_chunk=prefill_chunk)
            plan = decoding.Plan(block_size=k_bs, attention_impl=impl, **plan_kw)
            capacity = p_pad + n_buf + k_bs
            tmod = Transformer(tcfg, impl)
            dmod = DFlashDrafter(dcfg) if kind == "dflash" else None
            dp = dparams if kind == "dflash" else None
            prefill_jit, decode_jit, sh = sharding.generate_programs(
                tmod, dmod, plan, capacity, n_buf, m, tparams, dp, batch, p_pad)
            tp_a = sharding.with_shardings(tparams, sh["tparams"])
            dp_a = None if dp is None else sharding.with_shardings(dp, sh["dparams"])
            ids, lens, max_new, key = sh["arg_shapes"]
            ids = jax.ShapeDtypeStruct(ids.shape, ids.dtype, sharding=sh["ids"])
            lens = jax.ShapeDtypeStruct(lens.shape, lens.dtype, sharding=sh["lens"])
            state = sharding.with_shardings(sh["state_shape"], sh["state"])
            suffix = "" if impl_name == attention[0] else f"@{impl_name}"
            with sharding.compiling_for(m):
                # The AR prefill is the DFlash one without the drafter context.
                if kind == "dflash" and "prefill" in want:
                    programs["prefill" + suffix] = compile_stats(
                        lambda: prefill_jit.lower(tp_a, dp_a, ids, lens, max_new, key),
                        capacity_bytes)
                if f"{kind}_decode" not in want:
                    continue
                loop = compile_stats(lambda: decode_jit.lower(tp_a, dp_a, state),
                                     capacity_bytes)
                programs[f"{kind}_decode" + suffix] = loop
                if step_costs and chip is not None and loop["flops"] is not None:
                    twice = jax.jit(_loop_program(tmod, dmod, plan, 2),
                                    in_shardings=(sh["tparams"], sh["dparams"], sh["state"]),
                                    out_shardings=sh["state"], donate_argnums=(2,))
                    two = compile_stats(lambda: twice.lower(tp_a, dp_a, state), None)
                    steps[f"{kind}_step" + suffix] = {
                        "flops": two["flops"] - loop["flops"],
                        "bytes_accessed": two["bytes_accessed"] - loop["bytes_accessed"],
                        "collective_moved_bytes": _moved(two) - _moved(loop),
                        "collectives_per_step": sum(c["count"] for c in two["collectives"])
                        - sum(c["count"] for c in loop["collectives"]),
                        "loop_flops": loop["flops"]}
            if impl_name == attention[0]:
                st = sh["state_shape"]
                caches = [st.cache] + ([st.ctx] if st.ctx is not None else [])
                sizes[f"{kind}_cache_bytes"] = sum(
                    _tree_bytes_per_device(c, sharding.cache_sharding(c, m)) for c in caches)
                sizes[f"{kind}_param_bytes"] = _tree_bytes_per_device(tparams, sh["tparams"]) \
                    + (0 if dp is None else _tree_bytes_per_device(dp, sh["dparams"]))
    result = {"topology": topology or _platform_name(m), "model": model, "mode": "infer",
              "mesh": sharding.mesh_str(m), "devices": int(m.size),
              "chip": _chip_public(chip),
              "settings": {"batch": batch, "context": context, "prompt_pad": p_pad,
                           "max_new_tokens": max_new_tokens, "block_size": bs,
                           "attention": list(attention)},
              "sizes": sizes, "programs": programs,
              "param_bytes_total": _tree_bytes(tparams) + _tree_bytes(dparams),
              "backend": jax.default_backend()}
    result["roofline"] = roofline(steps, chip, sizes, attention, taus) if steps else {}
    return result


def _platform_name(mesh) -> str:
    d = mesh.devices.flat[0]
    return f"{d.platform}:{mesh.size}"


def _chip_public(chip):
    if chip is None:
        return None
    return {k: chip[k] for k in ("chip", "hbm_bytes", "bf16_flops", "hbm_bw", "ici_bw")}


def roofline(steps: Dict[str, Any], chip: Optional[dict], sizes: Dict[str, int],
             attention: Sequence[str], taus: Sequence[float] = DEFAULT_TAUS) -> Dict[str, Any]:
    """Per-step time projections from one step's FLOPs / bytes / collective bytes (see the
    module docstring) and the chip figures; speedup = tau * t_AR / t_DFlash."""
    out: Dict[str, Any] = {"note": PROJECTED, "steps": steps}
    if chip is None:
        return out
    proj = {}
    for impl_name in attention:
        suffix = "" if impl_name == attention[0] else f"@{impl_name}"
        t = {}
        for kind in ("ar", "dflash"):
            s = steps.get(f"{kind}_step" + suffix)
            if s is None:
                break
            compute = s["flops"] / chip["bf16_flops"]
            memory = s["bytes_accessed"] / chip["hbm_bw"]
            comm = s["collective_moved_bytes"] / chip["ici_bw"]
            # The bound: every weight and the whole (capacity-sized) KV cache read once a step.
            floor = (sizes[f"{kind}_param_bytes"] + sizes[f"{kind}_cache_bytes"]) / chip["hbm_bw"]
            t[kind] = {"compute_s": compute, "memory_s": memory, "collective_s": comm,
                       "step_s": max(compute, memory) + comm, "weights_kv_bound_s": floor}
        if len(t) == 2:
            t["speedup_at_tau"] = {str(tau): tau * t["ar"]["step_s"] / t["dflash"]["step_s"]
                                   for tau in taus}
            t["bound_speedup_at_tau"] = {
                str(tau): tau * t["ar"]["weights_kv_bound_s"] / t["dflash"]["weights_kv_bound_s"]
                for tau in taus}
            proj[impl_name] = t
    out["projection"] = proj
    return out


# ------------------------------------------------------------------------------ training


def dry_run_train(model: str = "qwen3_8b", mesh: Union[str, dict, Any] = "fsdp=8",
                  batch: int = 8, seq_len: int = 3072, num_anchors: int = 512,
                  dtype: Optional[str] = None, devices=None, chip: Optional[dict] = None,
                  loss_chunk_anchors: int = 0, attention_impl: str = "xla", config=None,
                  topology: str = "") -> Dict[str, Any]:
    """Compiles the trainer's own step (`make_train_step` with `train_shardings` and
    `drafter_loss_fn`) for `model` on `mesh`: global `batch` sequences of `seq_len`, the
    recipe of `config` (default: the trainer's defaults with these settings). Drafter weights
    and AdamW moments in float32, the frozen target in its dtype."""
    import jax
    import jax.numpy as jnp

    from dflash_jax import sharding
    from dflash_jax.drafter import DFlashDrafter
    from dflash_jax.model import Transformer
    from dflash_jax.training import trainer

    if config is None:
        config = train_config(batch, seq_len, num_anchors, loss_chunk_anchors, attention_impl)
    batch, seq_len = config.data.batch_size, config.data.seq_len
    tcfg, dcfg = build_configs(model, dtype)
    # Trainable drafter weights in float32 (bf16 compute), as mixed-precision training keeps.
    dcfg = dcfg.replace(body=dcfg.body.replace(param_dtype=jnp.float32))
    m = resolve_mesh(mesh, devices)
    capacity_bytes = None if chip is None else chip["hbm_bytes"]
    tparams, dparams = abstract_params(tcfg, dcfg)
    tmod, dmod = Transformer(tcfg, "xla"), DFlashDrafter(dcfg)
    optimizer = trainer.make_optimizer(config, 10000)[0]
    state = trainer.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=dparams,
                               opt_state=jax.eval_shape(optimizer.init, dparams),
                               rng=jax.eval_shape(lambda: jax.random.PRNGKey(0)))
    state_sh, frozen_sh, batch_sh = trainer.train_shardings(
        m, "drafter", state, tparams, tcfg.head_dim, dcfg.body.head_dim)
    step = trainer.make_train_step(trainer.drafter_loss_fn(config, tmod, dmod), optimizer, m,
                                   (state_sh, frozen_sh, batch_sh))
    batch_shapes = {"input_ids": jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
                    "loss_mask": jax.ShapeDtypeStruct((batch, seq_len), jnp.float32),
                    "segment_ids": jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)}
    args = (sharding.with_shardings(state, state_sh),
            sharding.with_shardings(tparams, frozen_sh),
            jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                  sharding=batch_sh),
                                   batch_shapes))
    with sharding.compiling_for(m):
        stats = compile_stats(lambda: step.lower(*args), capacity_bytes)
    return {"topology": topology or _platform_name(m), "model": model, "mode": "train",
            "mesh": sharding.mesh_str(m), "devices": int(m.size), "chip": _chip_public(chip),
            "settings": {"batch": batch, "seq_len": seq_len, "num_anchors": config.num_anchors,
                         "block_size": dcfg.block_size,
                         "loss_chunk_anchors": config.loss_chunk_anchors,
                         "attention": config.attention_impl},
            "sizes": {"param_bytes": _tree_bytes_per_device(tparams, frozen_sh)
                      + _tree_bytes_per_device(dparams, state_sh.params),
                      "opt_bytes": _tree_bytes_per_device(state.opt_state, state_sh.opt_state),
                      "param_bytes_total": _tree_bytes(tparams) + _tree_bytes(dparams),
                      "opt_bytes_total": _tree_bytes(state.opt_state)},
            "programs": {"train_step": stats}, "roofline": {},
            "backend": jax.default_backend()}


# ------------------------------------------------------------------------------ printing


def _gb(n) -> str:
    return "      -" if n is None else f"{n / 2 ** 30:7.2f}"


def format_report(r: Dict[str, Any]) -> str:
    """Human lines for one dry-run result."""
    s = r["settings"]
    chip = r["chip"]
    head = (f"{r['model']} {r['mode']} on {r['topology']} ({r['devices']} devices), mesh "
            f"[{r['mesh']}], " + (f"batch {s['batch']}, context {s['context']}, "
                                  f"{s['max_new_tokens']} new tokens, block {s['block_size']}"
                                  if r["mode"] == "infer" else
                                  f"batch {s['batch']}x{s['seq_len']}, {s['num_anchors']} "
                                  f"anchors x block {s['block_size']}"))
    cap = "" if chip is None else f" (HBM {chip['hbm_bytes'] / 2 ** 30:.0f} GiB per chip)"
    lines = [head + cap,
             "  program            args  out-alias  temps  code   TOTAL GiB/dev  fits   "
             "GFLOP/dev  GB accessed  collective MB (count)"]
    for name, p in r["programs"].items():
        h = p["hbm_bytes"]
        fits = {True: "yes", False: "NO", None: "-"}[p["fits"]]
        if "error" in p:
            lines.append(f"  {name:17s} does not fit: needs {_gb(h['total']).strip()} GiB, "
                         f"{_gb(p['hbm_capacity_bytes']).strip()} GiB available "
                         f"(compiler: {p['error'][:160]})")
            continue
        coll = sum(c["bytes"] * c["count"] for c in p["collectives"]) / 1e6
        ncoll = sum(c["count"] for c in p["collectives"])
        lines.append(f"  {name:17s}{_gb(h['arguments'])}  {_gb(h['outputs'] - h['aliased'])}"
                     f"{_gb(h['temporaries'])} {h['generated_code'] / 2 ** 20:5.1f}M "
                     f"{_gb(h['total'])}       {fits:4s} {p['flops'] / 1e9:10.1f}  "
                     f"{p['bytes_accessed'] / 1e9:11.2f}  {coll:9.2f} ({ncoll})")
    roof = r.get("roofline") or {}
    if roof.get("projection"):
        lines.append("  roofline per step (" + roof["note"] + "):")
        for impl, t in roof["projection"].items():
            for kind in ("ar", "dflash"):
                k = t[kind]
                lines.append(f"    {impl:6s} {kind:6s} step {k['step_s'] * 1e3:7.3f} ms = max("
                             f"compute {k['compute_s'] * 1e3:.3f}, memory "
                             f"{k['memory_s'] * 1e3:.3f}) + ICI {k['collective_s'] * 1e3:.3f};"
                             f" weights+KV bound {k['weights_kv_bound_s'] * 1e3:.3f} ms")
            sp = ", ".join(f"tau {tau}: {v:.2f}x" for tau, v in t["speedup_at_tau"].items())
            bd = ", ".join(f"{v:.2f}x" for v in t["bound_speedup_at_tau"].values())
            lines.append(f"    {impl:6s} projected speedup {sp} (weights+KV bound: {bd})")
        lines.append("  (cost analysis of a decode loop counts its body once plus the "
                     "once-per-call work outside it; the step figures are two-step-loop minus "
                     "one-step-loop differences)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CLI


def run(topology: str = "v5e:2x4", models: Sequence[str] = ("qwen3_8b",), mode: str = "infer",
        meshes: Optional[Sequence[str]] = None, json_out: Optional[str] = None, **kw):
    """Dry-runs every (model, mesh) pair on `topology`, printing a report for each; returns
    the results (and writes them to `json_out`: one dict, or a list for several)."""
    devices, chip = topology_devices(topology)
    for model in models:  # bad names fail before any compile
        build_configs(model)
    meshes = meshes or ([f"tensor={len(devices)}"] if mode == "infer"
                        else [f"fsdp={len(devices)}"])
    meshes_ok = [resolve_mesh(mesh, devices) for mesh in meshes]
    fn = dry_run_infer if mode == "infer" else dry_run_train
    results = []
    for model in models:
        for mesh in meshes_ok:
            r = fn(model=model, mesh=mesh, devices=devices, chip=chip, topology=topology, **kw)
            print(format_report(r), flush=True)
            results.append(r)
    if json_out:
        import json

        with open(json_out, "w") as f:
            json.dump(results[0] if len(results) == 1 else results, f, indent=1)
        print(f"wrote {json_out}")
    return results


def _floats(s: str) -> List[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--tau wants comma-separated numbers, got {s!r}") from None


def _programs(s: str) -> tuple:
    names = tuple(x.strip() for x in s.split(",") if x.strip())
    bad = set(names) - {"prefill", "dflash_decode", "ar_decode"}
    if bad or not names:
        raise UsageError(f"--programs: choose from prefill, dflash_decode, ar_decode; got {s!r}")
    return names


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topology", default="v5e:2x4",
                    help="v5e:2x4, v4:2x2x1, v5p:2x2x1, v6e:2x4, v5e:4x4, v5p:4x4x4, ... or cpu:8")
    ap.add_argument("--model", default="qwen3_8b",
                    help="comma-separated: qwen3_8b, qwen3_4b, llama31_8b, small, or an HF dir")
    ap.add_argument("--mode", default="infer", choices=("infer", "train"))
    ap.add_argument("--mesh", default="", help="';'-separated meshes, e.g. 'tensor=8;data=2,"
                    "tensor=4' (default: tensor=N for infer, fsdp=N for train)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--context", type=int, default=4096, help="infer: prompt tokens")
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--block_size", type=int, default=None)
    ap.add_argument("--attention", default="pallas",
                    help="infer: comma-separated attention impls to compile (pallas, xla)")
    ap.add_argument("--programs", default="prefill,dflash_decode,ar_decode",
                    help="infer: which of prefill, dflash_decode, ar_decode to compile")
    ap.add_argument("--prefill_chunk", type=int, default=None,
                    help="infer: prefill chunk (default decoding.Plan's; 0: one pass)")
    ap.add_argument("--tau", default=",".join(map(str, DEFAULT_TAUS)),
                    help="roofline: acceptance lengths for the projected speedup")
    ap.add_argument("--seq_len", type=int, default=3072, help="train: sequence length")
    ap.add_argument("--num_anchors", type=int, default=512)
    ap.add_argument("--loss_chunk_anchors", type=int, default=0)
    ap.add_argument("--json_out", default="", help="write the result(s) as JSON here")
    args = ap.parse_args(argv)
    try:
        if args.topology.startswith("cpu"):
            ensure_cpu_devices(int(args.topology.partition(":")[2] or 8))
        meshes = [m for m in args.mesh.split(";") if m.strip()] or None
        if args.mode == "infer":
            kw = dict(batch=args.batch or 1, context=args.context,
                      max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                      attention=tuple(a.strip() for a in args.attention.split(",")),
                      taus=tuple(_floats(args.tau)), prefill_chunk=args.prefill_chunk,
                      only=_programs(args.programs))
        else:
            kw = dict(batch=args.batch or 8, seq_len=args.seq_len, num_anchors=args.num_anchors,
                      loss_chunk_anchors=args.loss_chunk_anchors)
        return run(args.topology, args.model.split(","), args.mode, meshes,
                   args.json_out or None, **kw)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
