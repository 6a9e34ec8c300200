"""The dry run's roofline projection (`dflash_jax.dry_run.chips.roofline`) recomputed apart from
the code: on synthetic figures with hand-computed results, and on every committed dry-run JSON
from that JSON's own inputs (its chip figures, one step's FLOPs / bytes / collective bytes, the
weight and cache sizes), so no projected speedup in the docs (tests/test_tpu_table.py checks
the tables are the committed JSONs') lacks its formula. No compile: runs without libtpu."""

import glob
import json
import os

import pytest

from dflash_jax.dry_run import chips

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def projection_from_inputs(r: dict) -> dict:
    """{impl: {"ar"/"dflash": step_s and bound, "speedup_at_tau", "bound_speedup_at_tau"}} of a
    dry-run JSON, recomputed here from its inputs: step time = max(FLOPs / peak, bytes / HBM
    bandwidth) + collective bytes / ICI bandwidth; bound = (weights + KV cache) / HBM
    bandwidth; speedup = tau * t_AR / t_DFlash (docs: dflash_jax/dry_run/__init__.py)."""
    chip, sizes, steps = r["chip"], r["sizes"], r["roofline"]["steps"]
    attention = r["settings"]["attention"]
    taus = list(r["roofline"]["projection"][attention[0]]["speedup_at_tau"])
    out = {}
    for i, impl in enumerate(attention):
        suffix = "" if i == 0 else f"@{impl}"
        t = {}
        for kind in ("ar", "dflash"):
            s = steps[f"{kind}_step{suffix}"]
            t[kind] = {
                "step_s": max(s["flops"] / chip["bf16_flops"], s["bytes_accessed"] / chip["hbm_bw"])
                + s["collective_moved_bytes"] / chip["ici_bw"],
                "weights_kv_bound_s": (sizes[f"{kind}_param_bytes"] + sizes[f"{kind}_cache_bytes"])
                / chip["hbm_bw"],
            }
            if "hbm_bytes" in s:  # the HBM model (dflash_jax/dry_run/hbm.py)
                compute = s["flops"] / chip["bf16_flops"]
                t[kind]["time_s"] = (
                    max(compute, s["hbm_bytes"] / chip["hbm_bw"])
                    + s["collective_moved_bytes"] / chip["ici_bw"]
                    + s["collective_latency_s"]
                )
                t[kind]["floor_time_s"] = max(
                    compute, sizes[f"{kind}_floor_bytes"] / chip["hbm_bw"]
                )
        ratio = t["ar"]["step_s"] / t["dflash"]["step_s"]
        bound = t["ar"]["weights_kv_bound_s"] / t["dflash"]["weights_kv_bound_s"]
        t["speedup_at_tau"] = {tau: float(tau) * ratio for tau in taus}
        t["bound_speedup_at_tau"] = {tau: float(tau) * bound for tau in taus}
        if "time_s" in t["ar"]:
            hbm = t["ar"]["time_s"] / t["dflash"]["time_s"]
            floor = t["ar"]["floor_time_s"] / t["dflash"]["floor_time_s"]
            t["hbm_speedup_at_tau"] = {tau: float(tau) * hbm for tau in taus}
            t["floor_speedup_at_tau"] = {tau: float(tau) * floor for tau in taus}
        out[impl] = t
    return out


def assert_projection_matches_inputs(r: dict) -> None:
    want = projection_from_inputs(r)
    got = r["roofline"]["projection"]
    assert set(got) == set(want)
    for impl, t in want.items():
        for kind in ("ar", "dflash"):
            for key, v in t[kind].items():
                assert got[impl][kind][key] == pytest.approx(v, rel=1e-9), (impl, kind, key)
        for key in ("speedup_at_tau", "bound_speedup_at_tau"):
            assert got[impl][key] == pytest.approx(t[key], rel=1e-9), (impl, key)
        for key in ("hbm_speedup_at_tau", "floor_speedup_at_tau"):
            assert (key in got[impl]) == (key in t), (impl, key)
            if key in t:
                assert got[impl][key] == pytest.approx(t[key], rel=1e-9), (impl, key)


def test_roofline_on_synthetic_figures_matches_hand_computed_times():
    chip = {"bf16_flops": 100.0, "hbm_bw": 10.0, "ici_bw": 5.0}
    steps = {
        # AR: compute 2 s, memory 3 s (the max), collectives 1 s: 4 s a step.
        "ar_step": {"flops": 200, "bytes_accessed": 30, "collective_moved_bytes": 5},
        # DFlash: compute 10 s (the max), memory 4 s, collectives 2 s: 12 s a step.
        "dflash_step": {"flops": 1000, "bytes_accessed": 40, "collective_moved_bytes": 10},
        # a second attention implementation: AR 1 + 0 = 1 s, DFlash max(1, 2) + 0 = 2 s.
        "ar_step@xla": {"flops": 100, "bytes_accessed": 5, "collective_moved_bytes": 0},
        "dflash_step@xla": {"flops": 100, "bytes_accessed": 20, "collective_moved_bytes": 0},
    }
    # Bounds: AR (20 + 10) / 10 = 3 s, DFlash (25 + 15) / 10 = 4 s.
    sizes = {"ar_param_bytes": 20, "ar_cache_bytes": 10}
    sizes.update(dflash_param_bytes=25, dflash_cache_bytes=15)
    roof = chips.roofline(steps, chip, sizes, ("pallas", "xla"), taus=(6.0, 3.0))
    assert roof["note"] == chips.PROJECTED and roof["steps"] == steps
    p = roof["projection"]["pallas"]
    assert (p["ar"]["compute_s"], p["ar"]["memory_s"], p["ar"]["collective_s"]) == (2, 3, 1)
    assert p["ar"]["step_s"] == 4 and p["dflash"]["step_s"] == 12
    assert p["ar"]["weights_kv_bound_s"] == 3 and p["dflash"]["weights_kv_bound_s"] == 4
    assert p["speedup_at_tau"] == {"6.0": 2.0, "3.0": 1.0}  # tau * 4 / 12
    assert p["bound_speedup_at_tau"] == {"6.0": 4.5, "3.0": 2.25}  # tau * 3 / 4
    x = roof["projection"]["xla"]
    assert (x["ar"]["step_s"], x["dflash"]["step_s"]) == (1, 2)
    assert x["speedup_at_tau"] == {"6.0": 3.0, "3.0": 1.5}
    # No chip figures (a CPU topology): the steps, no projection.
    assert "projection" not in chips.roofline(steps, None, sizes, ("pallas",))
    # The test's own recomputation agrees with the hand-computed figures too.
    r = {"chip": chip, "sizes": sizes, "settings": {"attention": ["pallas", "xla"]}}
    r["roofline"] = roof
    assert_projection_matches_inputs(r)
    roof["projection"]["xla"]["speedup_at_tau"]["6.0"] = 3.1  # and tells a wrong one
    with pytest.raises(AssertionError):
        assert_projection_matches_inputs(r)


def test_committed_dry_run_projections_follow_from_their_own_inputs():
    paths = sorted(
        glob.glob(os.path.join(ROOT, "benchmarks", "results", "tpu_dry_run", "*.json"))
        + glob.glob(os.path.join(ROOT, "benchmarks", "results", "loop_hlo", "*.json"))
    )
    checked = []
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        if isinstance(r, dict) and (r.get("roofline") or {}).get("projection"):
            assert_projection_matches_inputs(r)
            checked.append(os.path.basename(path))
    # The README's and docs/tpu_dry_run.md's inference rows: Qwen3-8B and Llama-3.1-8B at 32K
    # on four chips, Qwen3-4B on v5p, and the cache-write comparisons of benchmarks/loop_hlo.
    assert len(checked) >= 13, checked


def test_hbm_model_on_synthetic_figures_matches_hand_computed_times():
    """The HBM model's step time: max(compute, HBM bytes / bandwidth) + ICI bytes / bandwidth +
    collective latency, its bound the analytic floor; and `steps.{ar,dflash}` as documented."""
    chip = {"bf16_flops": 100.0, "hbm_bw": 10.0, "ici_bw": 5.0}
    extra = dict(hbm_by_op={}, top_ops=[{"op": "fusion", "bytes": 1}])
    steps = {
        # AR: compute 2 s, HBM 5 s (the max), ICI 1 s, latency 0.5 s: 6.5 s; floor 4 s.
        "ar_step": dict(
            flops=200, bytes_accessed=30, collective_moved_bytes=5, hbm_bytes=50,
            loop_collectives=3, collective_latency_s=0.5, **extra,
        ),
        # DFlash: compute 10 s (the max), HBM 6 s, ICI 2 s, latency 1 s: 13 s; floor 10 s.
        "dflash_step": dict(
            flops=1000, bytes_accessed=40, collective_moved_bytes=10, hbm_bytes=60,
            loop_collectives=6, collective_latency_s=1.0, **extra,
        ),
    }  # fmt: skip
    sizes = dict(ar_param_bytes=20, ar_cache_bytes=10, ar_floor_bytes=40)
    sizes.update(dflash_param_bytes=25, dflash_cache_bytes=15, dflash_floor_bytes=55)
    roof = chips.roofline(steps, chip, sizes, ("pallas",), taus=(6.5,))
    p = roof["projection"]["pallas"]
    assert p["ar"]["time_s"] == 6.5 and p["dflash"]["time_s"] == 13.0
    assert p["ar"]["floor_time_s"] == 4.0 and p["dflash"]["floor_time_s"] == 10.0
    assert p["hbm_step_ratio"] == 2.0
    assert p["hbm_speedup_at_tau"] == {"6.5": 3.25}
    assert p["floor_speedup_at_tau"] == {"6.5": 6.5 * 4 / 10}
    ar = roof["steps"]["ar"]
    assert (ar["floor_bytes"], ar["hbm_bytes"], ar["collectives"]) == (40, 50, 3)
    assert ar["hbm_over_floor"] == 1.25 and ar["collective_latency_s"] == 0.5
    assert ar["time_s"] == 6.5 and ar["top_ops"] == extra["top_ops"]
    r = {"chip": chip, "sizes": sizes, "settings": {"attention": ["pallas"]}, "roofline": roof}
    assert_projection_matches_inputs(r)
    roof["projection"]["pallas"]["hbm_speedup_at_tau"]["6.5"] = 3.3
    with pytest.raises(AssertionError):
        assert_projection_matches_inputs(r)
