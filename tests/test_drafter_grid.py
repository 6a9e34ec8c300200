"""benchmarks/drafter_grid.py: the settings it parses, and its grid on the bundled pair (greedy
outputs equal AR token for token, trees accept more than the chain)."""

import pytest

from benchmarks import drafter_grid


def test_settings_parse_and_bad_ones_are_one_line():
    assert drafter_grid.parse_setting("t0_b16_tree64") == {
        "temperature": 0.0, "block_size": 16, "tree_budget": 64, "denoise_steps": 1,
    }  # fmt: skip
    assert drafter_grid.parse_setting("t1_b8_denoise2")["denoise_steps"] == 2
    for bad in ("t2_b16", "b16", "t0_b16_tree", "t0_b16_tree8_denoise2"):
        with pytest.raises(ValueError, match="--settings"):
            drafter_grid.parse_setting(bad)


def test_grid_on_the_bundled_pair(bundled_pair):
    target, drafter, prompts = bundled_pair
    names = ("t0_b16", "t0_b16_tree16", "t1_b16")
    settings = {n: drafter_grid.parse_setting(n) for n in names}
    got = drafter_grid.run_grid(target, drafter, prompts[:3], settings, 24, 2, ())
    s = {n: drafter_grid.summarize(got[n]["acceptance"]) for n in names}
    assert got["t0_b16"]["identical"] == got["t0_b16_tree16"]["identical"] == 3
    assert got["t1_b16"]["identical"] is None  # sampled: not expected token for token
    assert s["t0_b16"]["longest_step"] >= 3 and s["t0_b16"]["tau"] > 1.3
    assert s["t0_b16_tree16"]["tau_steps"] > s["t0_b16"]["tau_steps"]
    hist = s["t0_b16"]["acceptance_histogram"]
    assert sum(hist) == s["t0_b16"]["steps"] and hist[0] == 0
    table = drafter_grid.markdown(
        {n: {"d": dict(s[n], identical=got[n]["identical"], responses=3)} for n in names}, ["d"]
    )
    assert "| t0_b16 |" in table and "3/3" in table and "n/a (T=1)" in table
