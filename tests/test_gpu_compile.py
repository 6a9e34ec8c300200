"""The real XLA:GPU compiler on this CPU machine (the CUDA build of jax, one abstract NVIDIA H200
from our target config, `dry_run.topology_devices("h200")`): the decode loops hold the kernel a
real H200 runs and copy no cache per step; the dry-run JSON's HBM model and projection.

Skipped (with the reason) only where the CUDA plugin is not installed; `make test-newest`
installs it (`jax[cuda12]` into .venv312: docs/gpu_dry_run.md).
"""

import os
import re

import pytest

from dflash_jax import dry_run

pytestmark = [
    pytest.mark.skipif(
        dry_run.cuda_plugin_missing(),
        reason='needs the CUDA build of jax: pip install "jax[cuda12]==<jax version>" '
        "(make test-newest installs it; no GPU needed)",
    ),
    pytest.mark.slow,  # GPU compiles: left out of `make test-fast`, run by `make test`
]

CONTEXT, NEW = 1024, 64


@pytest.fixture(scope="module")
def h200():
    return dry_run.topology_devices("h200")


def _compile(h200, tmp, variant=None, step_costs=True, only=None):
    """The tiny preset (8B head shapes: 8 KV heads of 128) compiled for the abstract H200 at 1K
    context with --hlo_dir, under DFLASH_PALLAS_GPU_BACKEND=variant (None: the default):
    (dry-run JSON dict, {program: optimized HLO text})."""
    devices, chip = h200
    with pytest.MonkeyPatch.context() as mp:
        if variant is None:
            mp.delenv("DFLASH_PALLAS_GPU_BACKEND", raising=False)
        else:
            mp.setenv("DFLASH_PALLAS_GPU_BACKEND", variant)
        r = dry_run.dry_run_infer(
            "tiny",
            "tensor=1",
            batch=1,
            context=CONTEXT,
            max_new_tokens=NEW,
            devices=devices,
            chip=chip,
            attention=("pallas",),
            step_costs=step_costs,
            only=only,
            hlo_dir=str(tmp),
            topology="h200",
        )
    texts = {n: open(os.path.join(tmp, f"{n}.hlo")).read() for n in r["programs"]}
    return r, texts


@pytest.fixture(scope="module")
def default_run(h200, tmp_path_factory):
    """What `python -m dflash_jax.dry_run --topology=h200 --model=tiny --programs=dflash_decode,
    ar_decode` compiles: both decode loops with the kernels an H200 runs (the prefill compiles
    in `triton_run`)."""
    return _compile(h200, tmp_path_factory.mktemp("h200"), only=("dflash_decode", "ar_decode"))


@pytest.fixture(scope="module")
def triton_run(h200, tmp_path_factory):
    return _compile(
        h200,
        tmp_path_factory.mktemp("h200_triton"),
        "triton",
        step_costs=False,
    )


def _kernels(text):
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))


def _expected_default():
    from pallas_kernels import backend

    return "pallas_cudnn" if backend.triton_deprecated() else "pallas_triton"


@pytest.mark.parametrize("variant", ["default", "triton"])
def test_decode_loops_hold_the_kernel_and_copy_no_cache(default_run, triton_run, variant):
    """Each decode loop compiled for the H200 calls the GPU attention kernel inside its loop body
    (cuDNN's fused attention without a bias, the default on jax >= 0.11; the Pallas Triton kernel
    under DFLASH_PALLAS_GPU_BACKEND=triton) and no instruction of the loop body pads, copies,
    transposes, concatenates or relayouts a cache-sized buffer: before, the cuDNN draft
    concatenated the drafter's context with the block in every layer every step
    (`input_concatenate_fusion bf16[1,capacity+16,8,128]`) and took a [B,1,T,S] bias."""
    from dflash_jax.decoding.programs import buffer_sizes
    from dflash_jax.dry_run import hlo

    r, texts = default_run if variant == "default" else triton_run
    impl = r["settings"]["compiled_attention"]["pallas"]
    assert impl == (_expected_default() if variant == "default" else "pallas_triton")
    kernel = {"pallas_cudnn": "__cudnn$fmhaSoftmax", "pallas_triton": "__gpu$xla.gpu.triton"}[impl]
    for name in ("dflash_decode", "ar_decode"):
        text = texts[name]
        cap = buffer_sizes(CONTEXT, NEW, 16 if name == "dflash_decode" else 1)[2]
        comps = hlo.computations(text)
        body = hlo.loop_body_computations(text)
        assert body, name
        in_loop = [ln for c in body for ln in comps[c] if f'custom_call_target="{kernel}"' in ln]
        # Target layers (2) verify; the drafter's layer (1) drafts: once per layer per step.
        assert len(in_loop) == (3 if name == "dflash_decode" else 2), (name, _kernels(text))
        assert "fmhaScaleBiasSoftmax" not in text, name
        found = hlo.cache_sized_copies(text, cap, cap * 8 * 128)
        assert found == [], (variant, name, found)
        assert r["programs"][name]["cache_sized_copies"] == []  # the JSON says the same


def test_the_variant_follows_the_devices_compiled_for(h200, default_run):
    """The abstract H200 gets what a real H200 runs (cuDNN on jax >= 0.11), though this process
    has no GPU: the choice reads the device kind of the devices compiled for."""
    from dflash_jax.models import attention
    from pallas_kernels import backend

    devices, _ = h200
    assert backend._gpu_device_kind() is None  # no local GPU to ask
    assert devices[0].platform == "gpu" and devices[0].device_kind == "NVIDIA H200"
    assert attention.for_devices("pallas", devices) == _expected_default()
    assert default_run[0]["settings"]["compiled_attention"] == {"pallas": _expected_default()}


def test_dry_run_json_has_the_gpu_roofline(default_run):
    """The dry-run JSON for the H200: the memory plan fits, the HBM model's per-step figures
    (floor, counted HBM bytes, no collectives on one GPU, time, top ops) and the projection,
    with the chip's published figures; FLOPs from the loop bodies' matmuls (XLA:GPU's compiled
    cost analysis has none), DFlash's above AR's (16 rows against 1)."""
    r, _ = default_run
    assert r["chip"]["chip"] == "h200" and r["chip"]["hbm_bw"] == 4.8e12
    assert r["chip"]["device_kind"] == "NVIDIA H200"
    assert all(p["fits"] for p in r["programs"].values())
    roof = r["roofline"]
    assert "abstract GPU" in roof["note"] and "PROJECTED" in roof["note"]
    for kind in ("ar", "dflash"):
        s = roof["steps"][kind]
        assert s["collectives"] == 0 and s["collective_latency_s"] == 0
        assert 0 < s["floor_bytes"] <= s["hbm_bytes"], (kind, s)
        assert s["time_s"] == pytest.approx(s["hbm_bytes"] / 4.8e12)  # HBM-bound at batch 1
        assert s["top_ops"] and s["top_ops"][0]["bytes"] > 0
    steps = roof["steps"]
    assert steps["dflash_step"]["flops"] > 10 * steps["ar_step"]["flops"] > 0
    proj = roof["projection"]["pallas"]
    ratio = steps["dflash"]["time_s"] / steps["ar"]["time_s"]
    assert proj["hbm_step_ratio"] == pytest.approx(ratio)
    assert proj["hbm_speedup_at_tau"]["6.5"] == pytest.approx(6.5 / ratio)
    assert "speedup_at_tau" not in proj  # no cost-analysis model without a cost analysis


def test_triton_prefill_fits_a_hopper_block(triton_run):
    """The Triton variant's prefill compiles for the H200: its 512-position chunks verify in
    chunks of TRITON_MAX_ROWS // G positions (pallas_kernels._by_query_chunks); before, the
    Triton kernel's tile of all 1024 query rows asked for 320 KB of shared memory, 227 KB being
    a Hopper block's limit (RESOURCE_EXHAUSTED, reported as "does not fit")."""
    r, texts = triton_run
    p = r["programs"]["prefill"]
    assert p["fits"] and "error" not in p, p.get("error")
    assert "__gpu$xla.gpu.triton" in texts["prefill"]


def _smollm2_ar(h200, tmp):
    """SmolLM2-135M's autoregressive loop compiled for the H200 at batch 1 (what `python -m
    dflash_jax.dry_run --topology=h200 --model=smollm2_135m --programs=ar_decode` compiles):
    (its HBM step over the floor, the loop body's fusions that output a [576, 1536] MLP
    weight-shaped array)."""
    devices, chip = h200
    r = dry_run.dry_run_infer(
        "smollm2_135m", "tensor=1", batch=1, context=512, max_new_tokens=256,
        devices=devices, chip=chip, only=("ar_decode",), hlo_dir=str(tmp), topology="h200",
    )  # fmt: skip
    from dflash_jax.dry_run import hlo

    text = open(os.path.join(tmp, "ar_decode.hlo")).read()
    comps = hlo.computations(text)
    weight_shaped = re.compile(r"= \(?bf16\[(576,1536|1536,576)\]\S* fusion\(")
    products = [
        ln for c in hlo.loop_body_computations(text) for ln in comps[c] if weight_shaped.search(ln)
    ]
    step = r["roofline"]["steps"]["ar"]
    return step["hbm_bytes"] / step["floor_bytes"], products


def test_a_small_targets_one_row_decode_step_reads_each_weight_once(h200, tmp_path, monkeypatch):
    """SmolLM2-135M's AR step on the H200 within 1.25x its HBM floor (measured 1.15x): its
    one-row linears run as GEMMs on a row padded to two (`layers.dot_general`). The control,
    with the padding off: XLA:GPU strength-reduces each 576 x 1536 matrix-vector dot into a
    weight-sized product written to HBM and reduced (2.65x the floor before the fix)."""
    import jax

    from dflash_jax.models import layers

    ratio, products = _smollm2_ar(h200, tmp_path / "padded")
    assert ratio <= 1.25 and products == [], (ratio, products[:2])
    jax.clear_caches()
    monkeypatch.setattr(layers, "_compiling_for_gpu", lambda: False)
    try:
        ratio, products = _smollm2_ar(h200, tmp_path / "plain")
    finally:
        jax.clear_caches()
    assert ratio > 2 and len(products) >= 30, (ratio, len(products))


def test_a_hybrids_256_wide_attention_heads_run_cudnn_with_no_cache_copy(h200, tmp_path):
    """The Qwen3.5 shapes (tiny_hybrid: Gated DeltaNet layers and gated attention with heads of
    256, 4 KV heads) compiled for the H200: each attention layer of both decode loops calls
    cuDNN's fused attention on its 256-wide heads, and no loop body copies a cache. Before,
    `cudnn_attention.supported` stopped at 128 and these layers ran the XLA reference, which
    transposed each K/V cache every step (Qwen3.5-9B at 32K: 33 cache-sized copies in the DFlash
    loop, 8 in AR; the dry run answers jax's compute-capability check for the abstract device:
    `dry_run.topology._cudnn_checks_the_target`)."""
    from dflash_jax.decoding.programs import buffer_sizes
    from dflash_jax.dry_run import hlo

    devices, chip = h200
    r = dry_run.dry_run_infer(
        "tiny_hybrid", "tensor=1", batch=1, context=CONTEXT, max_new_tokens=NEW,
        devices=devices, chip=chip, only=("dflash_decode", "ar_decode"), step_costs=False,
        hlo_dir=str(tmp_path), topology="h200",
    )  # fmt: skip
    assert r["settings"]["compiled_attention"]["pallas"] == "pallas_cudnn"
    cudnn = re.compile(r'= \(bf16\[1,\d+,\d+,256\].*custom_call_target="__cudnn\$fmha')
    # One attention layer of the target's four; the drafter's one layer (heads of 256) drafts.
    for name, calls in (("dflash_decode", 2), ("ar_decode", 1)):
        text = open(os.path.join(tmp_path, f"{name}.hlo")).read()
        comps = hlo.computations(text)
        body = [ln for c in hlo.loop_body_computations(text) for ln in comps[c]]
        assert sum(bool(cudnn.search(ln)) for ln in body) == calls, (name, _kernels(text))
        cap = buffer_sizes(CONTEXT, NEW, 16 if name == "dflash_decode" else 1)[2]
        assert hlo.cache_sized_copies(text, cap, cap * 4 * 256) == [], name
