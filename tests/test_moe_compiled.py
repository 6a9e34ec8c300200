"""benchmarks/experiments/moe/moe_compiled.py: a DFlash-only run takes its AR step from the
run of the same chip, mesh and batch; the break-even tau is the ratio of the projected step
times; the speedup's tau is capped at block + 1; the routed kernels' bound is shown beside the
expected bytes (the bytes themselves where a run has none)."""

from benchmarks.experiments.moe import moe_compiled


CHIP = dict(bf16_flops=1e15, hbm_bw=1e9, ici_bw=1e9)  # 1 GB/s: time_s = GB read


def _step(gb, bound=None):
    step = dict(flops=0.0, hbm_bytes=gb * 1e9, collective_moved_bytes=0, collective_latency_s=0)
    return step if bound is None else dict(step, hbm_bytes_bound=bound * 1e9)


def _run(batch, block, ar=True):
    steps = {"dflash_step": _step(4.0 * block / 16, bound=6.0 if block == 16 else None)}
    sizes = {"dflash_floor_bytes": 3e9 * block / 16}
    if ar:
        steps["ar_step"] = _step(1.0)
        sizes["ar_floor_bytes"] = 0.8e9
    return {
        "topology": "v5p:2x2x1",
        "mesh": "tensor=4",
        "commit": "abcdef0123",
        "chip": CHIP,
        "sizes": sizes,
        "settings": {"batch": batch, "block_size": block},
        "roofline": {"steps": steps},
    }


def test_table_pairs_runs_and_computes_break_even():
    rows = [moe_compiled.row_of(r) for r in (_run(1, 16), _run(1, 4, ar=False), _run(4, 8, False))]
    out = moe_compiled.table(rows, tau=6.1)
    assert [(r["batch"], r["block"]) for r in out] == [(1, 16), (1, 4)]  # batch 4: no AR run
    b16, b4 = out
    assert b16["break_even_tau"] == 4.0 and b16["speedup"] == 6.1 / 4.0
    assert b16["floor_break_even_tau"] == 3e9 / 0.8e9 and b16["ar_over_floor"] == 1.25
    assert b4["tau"] == 5 and b4["speedup"] == 5 / 1.0  # tau capped at block + 1
    assert b16["dflash_bound_gb"] == 6.0 and b16["ar_bound_gb"] == 1.0  # AR: no bound recorded
    assert b4["dflash_bound_gb"] == 1.0  # 4.0 * 4 / 16 GB, none recorded
    md = moe_compiled.markdown(out, 6.1)
    assert "| v5p:2x2x1 (tensor=4) | 1 | 4 |" in md and "(tau 5)" in md
    assert "| 4.00 (1.33x; 6.00) |" in md and "| 1.00 (1.25x; 1.00) |" in md
