"""benchmarks/compare_drafters.py (issue 43): its projection rule against the dry runs' step
times written out here, its flags' refusals, and its measurement on the bundled pair (every
greedy output equal to autoregressive decoding, the rows' figures consistent with the
acceptance lengths)."""

import numpy as np
import pytest

from benchmarks import compare_drafters as cd


def _dry_run(topology, drafter, block, ar_s, step_s, ar_floor=1.0, floor=2.0):
    """A dry-run JSON as `python -m dflash_jax.dry_run` writes it, the fields the rule reads."""
    settings = {"attention": ["pallas"], "block_size": block, "batch": 1}
    if drafter is not None:  # older dry runs name no drafter: DFlash
        settings["drafter"] = drafter
    proj = {
        "ar": {"time_s": ar_s, "floor_time_s": ar_floor},
        "dflash": {"time_s": step_s, "floor_time_s": floor},
        "hbm_step_ratio": step_s / ar_s,
    }
    return {
        "topology": topology,
        "mesh": "single",
        "settings": settings,
        "roofline": {"projection": {"pallas": proj}},
    }


def test_projected_speedup_is_tau_over_steps_times_the_step_time_ratio():
    records = [
        _dry_run("h200", None, 16, 1e-4, 1.5e-4, floor=2.0),
        _dry_run("h200", "eagle3", 8, 1e-4, 2.5e-4, floor=3.0),
        _dry_run("v5e:2x4", "eagle3", 8, 2e-4, 3e-4),
        {"topology": "h200", "settings": {"block_size": 16}, "roofline": {}},  # no projection
    ]
    ratios = cd.step_ratios(records)
    assert set(ratios) == {"h200", "v5e:2x4"}
    assert ratios["h200"][("dflash", 16)]["ratio"] == pytest.approx(1.5)
    assert ratios["h200"][("eagle3", 8)]["floor_ratio"] == pytest.approx(3.0)
    # Two prompts: DFlash commits [3, 1] and [2] (tau over steps 6/3 = 2), EAGLE-3 [1, 1].
    measured = {
        cd.AR: dict(acceptance=None, decode_s=2.0, tokens=100, identical=None),
        "d": dict(acceptance=[[3, 1], [2]], decode_s=1.0, tokens=100, identical=2),
        "e": dict(acceptance=[[1, 1]], decode_s=4.0, tokens=100, identical=2),
    }
    kinds, sizes = {"d": "dflash", "e": "eagle3"}, {"d": 16, "e": 8}
    rows = {r["drafter"]: r for r in cd.rows_of(measured, kinds, sizes, ratios, "x", 0.0)}
    assert list(rows) == [cd.AR, "d", "e"]
    d, e = rows["d"], rows["e"]
    assert d["tau_steps"] == pytest.approx(2.0) and d["passes_per_token"] == pytest.approx(0.5)
    assert d["tau"] == pytest.approx((2.0 + 2.0) / 2)  # z-lab's mean over responses
    assert d["cpu_speedup"] == pytest.approx(2.0) and e["cpu_speedup"] == pytest.approx(0.5)
    assert d["projected"]["h200"] == {"compiled": pytest.approx(2.0 / 1.5), "floor": 1.0}
    assert d["projected"]["v5e:2x4"] is None  # no DFlash dry run there
    assert e["projected"]["v5e:2x4"]["compiled"] == pytest.approx(1.0 / 1.5)
    assert e["projected"]["h200"]["floor"] == pytest.approx(1.0 / 3.0)
    table = cd.markdown(list(rows.values()), sorted(ratios))
    assert "| 0 | x | d | 16 | 2.000 | 0.500 | 2.00x | 1.33x / 1.00x | n/a | 2 |" in table


def test_block_sizes_one_for_all_or_one_each_and_bad_ones_are_one_line():
    assert cd.block_sizes(["8"], 3) == [8, 8, 8]
    assert cd.block_sizes(["16", " 8"], 2) == [16, 8]
    for bad, n, match in ((["8", "8"], 3, "1 or 3"), (["x"], 1, "not an integer"),
                          (["1"], 1, "must be in")):  # fmt: skip
        with pytest.raises(ValueError, match="--block_sizes") as e:
            cd.block_sizes(bad, n)
        assert match in str(e.value) and "\n" not in str(e.value)


@pytest.mark.once  # host-side bookkeeping around generate, which other tests run on both jaxes
def test_measure_on_the_bundled_pair(bundled_pair, tmp_path):
    """DFlash, prompt lookup and an EAGLE-3 drafter (random: it drafts, it is seldom right)
    beside AR on the same batches: every greedy output equal to AR's, the DFlash drafter
    accepted, the rows' passes per token the inverse of tau over steps, the plot written."""
    from dflash_jax.drafters import eagle3 as e3
    from dflash_jax.drafters.prompt_lookup import PromptLookup

    target, drafter, prompts = bundled_pair
    cfg = e3.make_eagle3_config(target.config, draft_vocab_size=64, target_layer_ids=(0, 2, 4))
    eagle = e3.Eagle3(cfg, e3.init_eagle3_params(cfg), np.zeros(64, np.int64))
    drafters = {"dflash": (drafter, 8), "lookup": (PromptLookup(8), 8), "eagle3": (eagle, 4)}
    kinds = {k: cd.drafter_kind(d) for k, (d, _) in drafters.items()}
    assert kinds == {"dflash": "dflash", "lookup": "prompt_lookup", "eagle3": "eagle3"}
    got = cd.measure(target, drafters, prompts[:3], 0.0, 16, 2, ())
    assert got[cd.AR]["tokens"] == 4 * 16  # two batches of 2 rows, no stop token
    assert all(got[k]["identical"] == 3 for k in drafters)
    assert max(max(a) for a in got["dflash"]["acceptance"]) >= 3  # drafts accepted
    sizes = {k: b for k, (_, b) in drafters.items()}
    rows = cd.rows_of(got, kinds, sizes, {}, "code", 0.0)
    for r in rows[1:]:
        acc = got[r["drafter"]]["acceptance"]
        assert r["passes_per_token"] == pytest.approx(sum(map(len, acc)) / sum(map(sum, acc)))
        assert r["cpu_speedup"] > 0 and r["projected"] == {}
    cd.plot(rows, [], str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
