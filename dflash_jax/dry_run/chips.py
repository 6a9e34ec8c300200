"""TPU chip figures (published) and the roofline projection built on one decode step's
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
# The published tau for the default --tau: the DFlash paper's Qwen3-8B (greedy, block 16) and
# the public JAX/TPU port's Qwen3-4B on v5p-8 (3.13x measured at tau 5.42).
DEFAULT_TAUS = (6.5, 5.4)
PROJECTED = (
    "PROJECTED from the compiled programs' cost analysis and published chip figures; "
    "not measured on a TPU"
)


def chip_public(chip):
    if chip is None:
        return None
    return {k: chip[k] for k in ("chip", "hbm_bytes", "bf16_flops", "hbm_bw", "ici_bw")}


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
    out: Dict[str, Any] = {"note": PROJECTED, "steps": dict(steps)}
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
            t[kind] = {
                "compute_s": compute,
                "memory_s": memory,
                "collective_s": comm,
                "step_s": max(compute, memory) + comm,
                "weights_kv_bound_s": floor,
            }
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
        if len(t) == 2:
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
