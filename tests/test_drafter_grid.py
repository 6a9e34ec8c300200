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


@pytest.mark.once
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


def test_drafters_side_by_side_share_the_autoregressive_runs(bundled_pair):
    """Several drafters (a trained one and prompt lookup) over the same prompts: each greedy
    output equal to the same AR run, and the ratio table is each one's tau over the first's."""
    import dflash_jax as dj

    target, drafter, prompts = bundled_pair
    settings = {"t0_b8": drafter_grid.parse_setting("t0_b8")}
    drafters = {"drafter": drafter, "prompt_lookup": dj.PromptLookup()}
    got = drafter_grid.run_grid(target, drafters, prompts[:2], settings, 24, 2, ())
    assert set(got) == set(drafters)
    assert all(got[label]["t0_b8"]["identical"] == 2 for label in drafters)
    results = {
        f"{label}:t0_b8": {"d": drafter_grid.summarize(got[label]["t0_b8"]["acceptance"])}
        for label in drafters
    }
    table = drafter_grid.ratios(results, list(drafters), settings, ["d"])
    want = results["prompt_lookup:t0_b8"]["d"]["tau"] / results["drafter:t0_b8"]["d"]["tau"]
    assert f"| t0_b8 | prompt_lookup | {want:.3f} |" in table
    assert drafter_grid.drafter_label("assets/x/drafter_dflash2/") == "drafter_dflash2"


def test_drafter_directories_load_as_their_kind(bundled_pair, tmp_path):
    """--drafter's directories: an EAGLE-3 directory loads as EAGLE-3, a z-lab one as DFlash,
    prompt lookup as itself, in the order given."""
    import os

    import numpy as np

    import dflash_jax as dj
    from _pair import PAIR
    from dflash_jax.drafters import eagle3 as e3
    from dflash_jax.drafters import prompt_lookup

    target = bundled_pair[0]
    cfg = e3.make_eagle3_config(target.config, draft_vocab_size=64, target_layer_ids=(0, 1, 2))
    d2t = np.zeros(64, np.int64)  # the first 64 ids
    e3.save_eagle3(e3.Eagle3(cfg, e3.init_eagle3_params(cfg), d2t), str(tmp_path / "e3"))
    dirs = [str(tmp_path / "e3"), os.path.join(PAIR, "drafter"), "prompt_lookup:2-3"]
    got = drafter_grid.load_drafters(dirs, [prompt_lookup.from_spec(d) for d in dirs], target)
    assert isinstance(got[0], dj.Eagle3) and got[0].config.draft_vocab_size == 64
    assert isinstance(got[1], dj.Drafter) and isinstance(got[2], dj.PromptLookup)
