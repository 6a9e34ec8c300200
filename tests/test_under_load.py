"""benchmarks/experiments/under_load/under_load.py without compiling: its arguments refused
with one clear error, its table and plot from rows (the compiled figures come from the dry run,
tested elsewhere)."""

import pytest
from absl import app

from benchmarks.experiments.under_load import under_load


def test_taus_and_sizes_are_checked():
    assert under_load._taus(["16:6.5", "8:4"]) == {16: 6.5, 8: 4.0}
    with pytest.raises(app.UsageError, match="block:tau"):
        under_load._taus(["16"])
    with pytest.raises(app.UsageError, match=r"\[1, block\]"):
        under_load._taus(["4:6.5"])  # more tokens per step than the block holds
    with pytest.raises(app.UsageError, match="integers >= 1"):
        under_load._ints("batches", ["0"])


def test_table_and_plot_from_rows(tmp_path):
    rows = [
        dict(batch=1, block=16, ar_step_ms=3.0, dflash_step_ms=3.6, ratio=1.2, tau=6.5,
             break_even_tau=1.2, ar_compute_bound=False, dflash_compute_bound=False,
             ar_tokens_per_s_per_chip=41.7, dflash_tokens_per_s_per_chip=225.7, speedup=5.42),
        dict(batch=64, block=16, ar_step_ms=3.5, dflash_step_ms=14.0, ratio=4.0, tau=6.5,
             break_even_tau=4.0, ar_compute_bound=False, dflash_compute_bound=True,
             ar_tokens_per_s_per_chip=2286, dflash_tokens_per_s_per_chip=3714, speedup=1.62),
        dict(batch=1, block=4, ar_step_ms=3.0, dflash_step_ms=3.2, ratio=1.07,
             break_even_tau=1.07, ar_compute_bound=False, dflash_compute_bound=False,
             ar_tokens_per_s_per_chip=41.7),
    ]  # fmt: skip
    lines = under_load.table(rows)
    assert len(lines) == 2 + len(rows)
    assert "| 64 | 16 | 3.500 | 14.000 | compute | 4.00 |" in lines[3]
    assert lines[3].endswith("| 3714 (6.5) | 1.62x |")
    assert "no published tau" in lines[4] and lines[4].endswith("| - |")
    path = tmp_path / "p.png"
    under_load.plot(rows, str(path), "test")
    assert path.stat().st_size > 1000
