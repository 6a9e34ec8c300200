"""benchmarks/moe_compiled.py: a DFlash-only run takes its AR step from the run of the same
chip, mesh and batch; the break-even tau is the ratio of the projected step times; the
speedup's tau is capped at block + 1."""

from benchmarks import moe_compiled


def _run(batch, block, ar=True):
    steps = {"dflash": {"hbm_bytes": 8e9 * block / 16, "floor_bytes": 6e9 * block / 16}}
    proj = {"dflash": {"time_s": 4.0 * block / 16}}
    if ar:
        steps["ar"] = {"hbm_bytes": 1e9, "floor_bytes": 0.8e9}
        proj["ar"] = {"time_s": 1.0}
    return {
        "topology": "v5p:2x2x1",
        "mesh": "tensor=4",
        "commit": "abcdef0123",
        "settings": {"batch": batch, "block_size": block},
        "roofline": {"steps": steps, "projection": {"pallas": proj}},
    }


def test_table_pairs_runs_and_computes_break_even():
    rows = [moe_compiled.row_of(r) for r in (_run(1, 16), _run(1, 4, ar=False), _run(4, 8, False))]
    out = moe_compiled.table(rows, tau=6.1)
    assert [(r["batch"], r["block"]) for r in out] == [(1, 16), (1, 4)]  # batch 4: no AR run
    b16, b4 = out
    assert b16["break_even_tau"] == 4.0 and b16["speedup"] == 6.1 / 4.0
    assert b16["floor_break_even_tau"] == 6e9 / 0.8e9 and b16["ar_over_floor"] == 1.25
    assert b4["tau"] == 5 and b4["speedup"] == 5 / 1.0  # tau capped at block + 1
    md = moe_compiled.markdown(out, 6.1)
    assert "| v5p:2x2x1 (tensor=4) | 1 | 4 |" in md and "(tau 5)" in md
