"""TPU and GPU chip figures (published) and the roofline projection built on one decode step's
compiled cost (see `dflash_jax.dry_run`). Projections, not measurements."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

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
    "v4": dict(
        hbm_bytes=32 * 2**30,
        bf16_flops=275e12,
        hbm_bw=1200e9,
        ici_bw=540e9,
        host=(2, 2, 1),
        topology_kw=dict(chip_config_name="megacore"),
    ),
    "v5e": dict(
        hbm_bytes=16 * 2**30,
        bf16_flops=197e12,
        hbm_bw=819e9,
        ici_bw=400e9,
        host=(2, 4, 1),
        topology_kw={},
    ),
    "v5p": dict(
        hbm_bytes=95 * 2**30,
        bf16_flops=459e12,
        hbm_bw=2765e9,
        ici_bw=1200e9,
        host=(2, 2, 1),
        topology_kw={},
    ),
    "v6e": dict(
        hbm_bytes=32 * 2**30,
        bf16_flops=918e12,
        hbm_bw=1638e9,
        ici_bw=800e9,
        host=(2, 4, 1),
        topology_kw={},
    ),
}
# NVIDIA Hopper GPUs (one GPU of an SXM board: topology "h200" / "h100", 1x1x1), compiled for
# by the CUDA build of jax (`pip install "jax[cuda12]==<jax version>"`) without a GPU:
# abstract devices from `jax.experimental.topologies.get_topology_desc(platform="cuda",
# target_config=...)` (`gpu_target_config` below). Published figures:
#   H100 SXM: https://www.nvidia.com/en-us/data-center/h100/ (datasheet: 80 GB HBM3, 3.35 TB/s,
#             bf16 989 TFLOP/s dense (1979 with sparsity), NVLink 900 GB/s);
#   H200 SXM: https://www.nvidia.com/en-us/data-center/h200/ (141 GB HBM3e, 4.8 TB/s, bf16 989
#             TFLOP/s dense, NVLink 900 GB/s; the same GH100 chip as the H100 SXM);
#   the GH100 SM (both): NVIDIA H100 Tensor Core GPU Architecture whitepaper and the CUDA C++
#             Programming Guide, compute capability 9.0: 132 SMs (SXM5), 128 FP32 cores per SM,
#             up to 228 KB shared memory per SM and 227 KB per block (opt-in; 48 KB without),
#             65536 32-bit registers per SM and per block, 2048 threads per SM, 1024 per block,
#             32 per warp, 50 MB L2, 1.98 GHz max boost clock.
# `ici_bw` is the NVLink figure: unused at 1x1x1 (one GPU, no collectives); multi-GPU topologies
# (NVLink/NVSwitch collectives) are not modelled. Memory sizes are the published decimal GB.
_GH100_SM = dict(
    sm_count=132,
    fpus_per_sm=128,
    shared_memory_per_sm=228 * 1024,
    shared_memory_per_block=48 * 1024,
    shared_memory_per_block_optin=227 * 1024,
    registers_per_sm=65536,
    registers_per_block=65536,
    threads_per_sm=2048,
    threads_per_block=1024,
    l2_bytes=50 * 2**20,
    clock_ghz=1.98,
    compute_capability=(9, 0),
)
GPU_CHIPS = {
    "h100": dict(
        hbm_bytes=80 * 10**9,
        bf16_flops=989e12,
        hbm_bw=3.35e12,
        ici_bw=900e9,
        device_kind="NVIDIA H100 80GB HBM3",
        **_GH100_SM,
    ),
    "h200": dict(
        hbm_bytes=141 * 10**9,
        bf16_flops=989e12,
        hbm_bw=4.8e12,
        ici_bw=900e9,
        device_kind="NVIDIA H200",
        **_GH100_SM,
    ),
}


def gpu_target_config(chip: dict, cudnn_version=(9, 8, 0)) -> str:
    """The GpuTargetConfigProto text (XLA's xla/stream_executor/device_description.proto and
    xla/service/gpu/gpu_target_config.proto field names: a `gpu_device_info`, the platform, the
    cuDNN version, the device description, as XLA's own specs in xla/tools/hlo_opt/gpu_specs/
    are laid out) of a `GPU_CHIPS` entry: the fields the GPU compiler reads for its cost models
    and launch limits, from the published figures above."""
    major, minor = chip["compute_capability"]
    info = {
        "threads_per_block_limit": chip["threads_per_block"],
        "threads_per_warp": 32,
        "shared_memory_per_block": chip["shared_memory_per_block"],
        "shared_memory_per_core": chip["shared_memory_per_sm"],
        "threads_per_core_limit": chip["threads_per_sm"],
        "core_count": chip["sm_count"],
        "fpus_per_core": chip["fpus_per_sm"],
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "memory_bandwidth": int(chip["hbm_bw"]),
        "l2_cache_size": chip["l2_bytes"],
        "clock_rate_ghz": chip["clock_ghz"],
        "device_memory_size": chip["hbm_bytes"],
        "shared_memory_per_block_optin": chip["shared_memory_per_block_optin"],
        "registers_per_core_limit": chip["registers_per_sm"],
        "registers_per_block_limit": chip["registers_per_block"],
    }
    lines = ["gpu_device_info {"]
    lines += [f"  {k}: {v}" for k, v in info.items()]
    lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}"]
    lines.append('platform_name: "CUDA"')
    lines.append(
        "dnn_version_info {{ major: {} minor: {} patch: {} }}".format(*tuple(cudnn_version)[:3])
    )
    lines.append(f'device_description_str: "{chip["device_kind"]}"')
    return "\n".join(lines) + "\n"


# The published tau for the default --tau: the DFlash paper's Qwen3-8B (greedy, block 16) and
# the public JAX/TPU port's Qwen3-4B on v5p-8 (3.13x measured at tau 5.42).
DEFAULT_TAUS = (6.5, 5.4)
PROJECTED = (
    "PROJECTED from the compiled programs' cost analysis and published chip figures; "
    "not measured on a TPU"
)
PROJECTED_GPU = (
    "PROJECTED from programs compiled for an abstract GPU (no GPU present) and published chip "
    "figures; not measured on a GPU"
)


def chip_public(chip):
    if chip is None:
        return None
    keys = ("chip", "hbm_bytes", "bf16_flops", "hbm_bw", "ici_bw")
    gpu = ("device_kind", "sm_count", "shared_memory_per_sm", "clock_ghz", "compute_capability")
    return {k: chip[k] for k in keys + gpu if k in chip}


def hbm_step_times(step: Dict[str, Any], floor_bytes: int, chip: dict) -> Dict[str, float]:
    """The HBM model's times of one step (`roofline`'s docstring): compute_s, hbm_s, floor_s,
    collective_s, latency_s, time_s = max(compute, hbm) + collective bytes / ICI bandwidth +
    latency, floor_time_s = max(compute, floor), and compute_bound (compute above HBM)."""
    compute = step["flops"] / chip["bf16_flops"]
    hbm_s = step["hbm_bytes"] / chip["hbm_bw"]
    comm = step["collective_moved_bytes"] / chip["ici_bw"]
    latency = step["collective_latency_s"]
    return {
        "compute_s": compute,
        "hbm_s": hbm_s,
        "floor_s": floor_bytes / chip["hbm_bw"],
        "collective_s": comm,
        "latency_s": latency,
        "time_s": max(compute, hbm_s) + comm + latency,
        "floor_time_s": max(compute, floor_bytes / chip["hbm_bw"]),
        "compute_bound": compute > hbm_s,
    }


def roofline(
    steps: Dict[str, Any],
    chip: Optional[dict],
    sizes: Dict[str, int],
    attention: Sequence[str],
    taus: Sequence[float] = DEFAULT_TAUS,
) -> Dict[str, Any]:
    """Per-step time projections from one step's FLOPs / bytes / collective bytes (see the
    `dflash_jax.dry_run` docstring) and the chip figures; speedup = tau * t_AR / t_DFlash.

    Two models side by side, per step: the cost analysis's (`memory_s` from `bytes_accessed`,
    `step_s`, `speedup_at_tau`: VMEM traffic counted as HBM traffic, kept for comparison with
    older results) and the HBM model's (`dry_run.hbm`: `hbm_s` from the HBM bytes counted in
    the compiled loop body, `floor_s` from the analytic floor, `latency_s` from the loop's
    collectives at a published ICI hop latency; `time_s` = max(compute, hbm) + collective
    bytes / ICI bandwidth + latency; `hbm_speedup_at_tau`, and `floor_speedup_at_tau`, the
    bound). `steps["ar"]` / `steps["dflash"]` (the first attention implementation) hold the
    HBM model's figures per chip: floor_bytes, hbm_bytes, collectives, collective_latency_s,
    time_s, top_ops."""
    note = PROJECTED_GPU if chip is not None and chip.get("chip") in GPU_CHIPS else PROJECTED
    out: Dict[str, Any] = {"note": note, "steps": dict(steps)}
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
            comm = s["collective_moved_bytes"] / chip["ici_bw"]
            # The bound: every weight and the whole (capacity-sized) KV cache read once a step.
            floor = (sizes[f"{kind}_param_bytes"] + sizes[f"{kind}_cache_bytes"]) / chip["hbm_bw"]
            t[kind] = {"compute_s": compute, "collective_s": comm, "weights_kv_bound_s": floor}
            if s["bytes_accessed"] is not None:  # None: no cost analysis (XLA:GPU)
                memory = s["bytes_accessed"] / chip["hbm_bw"]
                t[kind].update(memory_s=memory, step_s=max(compute, memory) + comm)
            if "hbm_bytes" in s:
                t[kind].update(hbm_step_times(s, sizes[f"{kind}_floor_bytes"], chip))
                latency = t[kind]["latency_s"]
                if impl_name == attention[0]:
                    out["steps"][kind] = {
                        "floor_bytes": sizes[f"{kind}_floor_bytes"],
                        "hbm_bytes": s["hbm_bytes"],
                        "hbm_over_floor": s["hbm_bytes"] / sizes[f"{kind}_floor_bytes"],
                        "collectives": s["loop_collectives"],
                        "collective_latency_s": latency,
                        "time_s": t[kind]["time_s"],
                        "top_ops": s["top_ops"],
                    }
                    if "hbm_bytes_bound" in s:  # MoE: the routed kernels' bound beside
                        out["steps"][kind]["hbm_bytes_bound"] = s["hbm_bytes_bound"]
        if len(t) == 2:
            if "step_s" in t["ar"] and "step_s" in t["dflash"]:
                t["speedup_at_tau"] = {
                    str(tau): tau * t["ar"]["step_s"] / t["dflash"]["step_s"] for tau in taus
                }
            t["bound_speedup_at_tau"] = {
                str(tau): tau * t["ar"]["weights_kv_bound_s"] / t["dflash"]["weights_kv_bound_s"]
                for tau in taus
            }
            if "time_s" in t["ar"] and "time_s" in t["dflash"]:
                ratio = t["dflash"]["time_s"] / t["ar"]["time_s"]
                t["hbm_step_ratio"] = ratio
                t["hbm_speedup_at_tau"] = {str(tau): tau / ratio for tau in taus}
                t["floor_speedup_at_tau"] = {
                    str(tau): tau * t["ar"]["floor_time_s"] / t["dflash"]["floor_time_s"]
                    for tau in taus
                }
            proj[impl_name] = t
    out["projection"] = proj
    return out
