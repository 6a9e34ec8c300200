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

Modules: chips (published chip figures, the roofline), topology (devices, meshes, UsageError),
presets (models, the trainer config), compiled (memory plan, cost analysis, collectives),
programs (`dry_run_infer`, `dry_run_train`), cli (report lines, `main`, `infer_main` for
`infer.py --dry_run`).

  infer: the programs of `generate` through `decoding.programs.generate_programs`: the prefill,
         the DFlash decode loop and the autoregressive decode loop, sharded by the partition
         rules, for each attention implementation asked for ("pallas": the TPU kernels).
  train: the trainer's own step: `training.step.make_train_step` with the shardings of
         `train_shardings` and the loss of `drafter_loss_fn` (the paper recipe's settings).

Per program, from the TPU compiler: HBM per device (arguments, outputs, aliased, temporaries,
generated code, total) against the chip's capacity ("fits"), FLOPs and bytes accessed (the
compiled cost analysis), and the collectives of the compiled HLO with their bytes. A compile that
fails with RESOURCE_EXHAUSTED is reported as "does not fit" with the compiler's numbers.

What the cost analysis of the decode loop counts (measured, see `_loop_step_costs`): the
`while_loop` body ONCE (the FLOPs of the loop program equal those of one `Decoder.step` compiled on
its own), plus the work outside the loop that runs once per call, notably the weight relayout
copies the compiler hoists out of the loop (each weight read and written once). So its bytes are
not one step's. The roofline therefore takes one step's FLOPs, bytes and collectives as the
difference between the loop program with two `Decoder.step`s per iteration and the real one.

The roofline (`roofline`), two step models side by side. The cost analysis's: time per step =
max(FLOPs / peak, bytes accessed / HBM bandwidth) + collective bytes moved / ICI bandwidth
(`step_s`, `speedup_at_tau`); its bytes count VMEM traffic as HBM traffic, inflating 16-row
steps. The HBM model's (`hbm`: the HBM operands of the real loop's body counted once, which is
one step, no differencing; the analytic floor per chip; the loop's collectives at a cited ICI hop
latency): time = max(FLOPs / peak, HBM bytes / bandwidth) + bytes moved / ICI bandwidth +
collective latency (`time_s`, `hbm_speedup_at_tau`, the floor's `floor_speedup_at_tau`), and
`roofline.steps.{ar,dflash}`: floor_bytes, hbm_bytes (a MoE target's routed kernels at the
experts they fetch on average; hbm_bytes_bound: at the experts their grids can fetch),
collectives, collective_latency_s, time_s, top_ops. FLOPs still come from the two-step difference (a clean count: the loop's
FLOPs are one body's). PROJECTIONS, not measurements: no host overhead, perfect overlap inside
each step, published chip figures (`TPU_CHIPS`).

`--topology=h200` / `--topology=h100` compiles for one abstract NVIDIA GPU instead (the CUDA build
of jax, `pip install "jax[cuda12]==<your jax version>"`, no GPU needed; run with
CUDA_VISIBLE_DEVICES=-1 JAX_PLATFORMS=cpu): the target config is ours, from published figures
(`chips.GPU_CHIPS`, `chips.gpu_target_config`), and the kernels are those a real chip of that
kind runs (`pallas_kernels.backend`: cuDNN on Hopper with jax >= 0.11, else Triton;
DFLASH_PALLAS_GPU_BACKEND overrides). docs/gpu_dry_run.md.

`--topology=cpu:8` compiles for 8 fake CPU devices instead (XLA:CPU; no libtpu needed; XLA's
attention unless --attention says otherwise).
"""

from typing import TYPE_CHECKING

from dflash_jax.support import lazy as _lazy  # (stdlib only)

# Imported on first use (PEP 562): `python -m dflash_jax.dry_run` arms its Ctrl-C handling
# before JAX loads (dflash_jax/support/interrupts.py).
_EXPORTS = {
    "DEFAULT_TAUS": "chips",
    "GPU_CHIPS": "chips",
    "PROJECTED": "chips",
    "TPU_CHIPS": "chips",
    "roofline": "chips",
    "format_report": "cli",
    "infer_main": "cli",
    "main": "cli",
    "run": "cli",
    "collectives": "compiled",
    "compile_stats": "compiled",
    "abstract_params": "presets",
    "build_configs": "presets",
    "model_presets": "presets",
    "train_config": "presets",
    "dry_run_infer": "programs",
    "dry_run_train": "programs",
    "UsageError": "topology",
    "cuda_plugin_missing": "topology",
    "ensure_cpu_devices": "topology",
    "gpu_devices": "topology",
    "libtpu_missing": "topology",
    "resolve_mesh": "topology",
    "topology_devices": "topology",
}


def __getattr__(name):
    return _lazy.attribute(__name__, _EXPORTS, globals(), name)


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # the names as plain imports, for type checkers and IDEs
    from dflash_jax.dry_run.chips import DEFAULT_TAUS, GPU_CHIPS, PROJECTED, TPU_CHIPS, roofline
    from dflash_jax.dry_run.cli import format_report, infer_main, main, run
    from dflash_jax.dry_run.compiled import collectives, compile_stats
    from dflash_jax.dry_run.presets import (
        abstract_params,
        build_configs,
        model_presets,
        train_config,
    )
    from dflash_jax.dry_run.programs import dry_run_infer, dry_run_train
    from dflash_jax.dry_run.topology import (
        UsageError,
        cuda_plugin_missing,
        ensure_cpu_devices,
        gpu_devices,
        libtpu_missing,
        resolve_mesh,
        topology_devices,
    )

__all__ = [
    "DEFAULT_TAUS",
    "GPU_CHIPS",
    "PROJECTED",
    "TPU_CHIPS",
    "UsageError",
    "abstract_params",
    "build_configs",
    "collectives",
    "compile_stats",
    "cuda_plugin_missing",
    "dry_run_infer",
    "dry_run_train",
    "ensure_cpu_devices",
    "format_report",
    "gpu_devices",
    "infer_main",
    "libtpu_missing",
    "main",
    "model_presets",
    "resolve_mesh",
    "roofline",
    "run",
    "topology_devices",
    "train_config",
]
