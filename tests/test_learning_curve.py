"""benchmarks/plot_learning_curve.py: stages offset within a drafter, drafters each from 0, and
the training hours summed from the trainer's logged rates (the figures of the same-CPU-budget
comparison of issue 43)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import plot_learning_curve as plc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = 100  # tokens per step in these files


def _write(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture
def files(tmp_path):
    # drafter A: two stages; drafter B: one. Rates in tokens/s, logged every 2 steps.
    a1 = _write(
        tmp_path / "a1.jsonl",
        [
            {"split": "train", "step": 2, "loss": 5.0, "tokens_per_s": 50.0},  # 2*100/50 = 4 s
            {"split": "train", "step": 4, "loss": 4.0, "tokens_per_s": 20.0},  # 10 s
            {"split": "eval", "step": 4, "loss": 4.5, "tau": 1.1},
        ],
    )
    a2 = _write(
        tmp_path / "a2.jsonl",
        [
            {"split": "train", "step": 2, "loss": 3.0, "tokens_per_s": 100.0},  # 2 s
            {"split": "eval", "step": 2, "loss": 3.5, "tau": 1.3},
        ],
    )
    b1 = _write(
        tmp_path / "b1.jsonl",
        [
            {"split": "train", "step": 3, "loss": 6.0, "tokens_per_s": 10.0},  # 30 s
            {"split": "eval", "step": 3, "loss": 6.5, "tau": 1.05},
        ],
    )
    return a1, a2, b1


def test_stages_follow_each_other_and_drafters_start_at_zero(files):
    (a1, a2, b1) = plc.read_runs(list(files), TOKENS, groups=["0", "0", "1"])
    h = 1 / 3600
    assert [(t, pytest.approx(x), l) for t, x, l in a1[0]] == [
        (200, 4 * h, 5.0),
        (400, 14 * h, 4.0),
    ]
    assert a1[1] == [(400, pytest.approx(14 * h), 4.5, 1.1)]
    # stage 2 continues after stage 1's last step (4) and its 14 s
    assert a2[0] == [(600, pytest.approx(16 * h), 3.0)]
    assert a2[1] == [(600, pytest.approx(16 * h), 3.5, 1.3)]
    # the other drafter starts from zero tokens and zero hours
    assert b1[0] == [(300, pytest.approx(30 * h), 6.0)]
    assert b1[1] == [(300, pytest.approx(30 * h), 6.5, 1.05)]
    # without groups every run is a stage of one drafter (the old reading)
    b_as_stage = plc.read_runs(list(files), TOKENS)[2]
    assert b_as_stage[0] == [(900, pytest.approx(46 * h), 6.0)]


def test_a_group_per_run_or_one_line(files, tmp_path):
    with pytest.raises(ValueError, match="2 groups for 3 runs"):
        plc.read_runs(list(files), TOKENS, groups=["0", "1"])
    out = tmp_path / "curve.png"
    args = [
        sys.executable,
        "benchmarks/plot_learning_curve.py",
        f"--runs={','.join(files)}",
        f"--tokens_per_step={TOKENS}",
    ]
    bad = subprocess.run(
        args + ["--groups=0,1", f"--out={out}"], capture_output=True, text=True, cwd=ROOT
    )
    assert bad.returncode != 0 and "2 groups for 3 runs" in bad.stderr
    assert "Traceback" not in bad.stderr and not out.exists()
    ok = subprocess.run(
        args + ["--groups=0,0,1", "--x=hours", f"--out={out}", "--labels=a 1,a 2,b"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert ok.returncode == 0, ok.stderr
    points = json.loads(out.with_suffix(".json").read_text())
    assert points["runs"]["b"]["eval"] == [
        {"tokens": 300, "hours": round(30 / 3600, 4), "loss": 6.5, "tau": 1.05}
    ]
    assert out.stat().st_size > 1000


def test_projection_recovers_a_power_law_and_refuses_a_flat_curve(tmp_path):
    # tau - 1 = 0.002 * T^0.5 at T = 1e4, 4e4, 1.6e5 tokens: 1.2, 1.4, 1.8
    evals = [(t, 0.0, 5.0, 1.0 + 0.002 * t**0.5) for t in (1e4, 4e4, 1.6e5)]
    evals.append((2e4, 0.0, 5.0, 0.9))  # below 1: left out of the fit
    p = plc.project(evals, [3.0], hours=1e-4)
    assert p["alpha"] == pytest.approx(0.5) and p["c"] == pytest.approx(0.002)
    assert p["points"] == 3
    # (3 - 1) / 0.002 = 1000 = T^0.5: T = 1e6 tokens, 100 hours at 1e-4 h a token
    assert p["targets"]["3.0"]["tokens"] == pytest.approx(1e6)
    assert p["targets"]["3.0"]["hours"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="does not rise"):
        plc.project([(1e4, 0, 5, 1.5), (1e5, 0, 5, 1.2)], [3.0])
    with pytest.raises(ValueError, match="needs two"):
        plc.project([(1e4, 0, 5, 1.5), (1e5, 0, 5, 0.99)], [3.0])
    # the CLI: a third panel and the projection in the JSON
    run = _write(
        tmp_path / "r.jsonl",
        [{"split": "train", "step": 100, "loss": 4.0, "tokens_per_s": 100.0}]
        + [
            {"split": "eval", "step": s, "loss": 4.0, "tau": 1.0 + 0.002 * (s * TOKENS) ** 0.5}
            for s in (100, 400, 1600)
        ],
    )
    out = tmp_path / "p.png"
    ok = subprocess.run(
        [
            sys.executable,
            "benchmarks/plot_learning_curve.py",
            f"--runs={run}",
            f"--tokens_per_step={TOKENS}",
            "--project=3",
            f"--out={out}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert ok.returncode == 0, ok.stderr
    proj = json.loads(out.with_suffix(".json").read_text())["projection"]
    assert proj["targets"]["3.0"]["tokens"] == pytest.approx(1e6)
    # 100 steps x 100 tokens in 100 s: 1e6 tokens are 1e4 s
    assert proj["targets"]["3.0"]["hours"] == pytest.approx(1e4 / 3600)
