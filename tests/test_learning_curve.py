"""benchmarks/plot_learning_curve.py: stages offset within a drafter, drafters each from 0, and
the training hours summed from the trainer's logged rates (the figures of the same-CPU-budget
comparison of issue 43)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
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


# The ledger (--ledger): every run of a project on cumulative CPU-hours (start + data +
# training) and cumulative training tokens, with a table.


def _ledger_file(tmp_path, files, edit=None):
    a1, a2, b1 = files
    # a run whose metrics have no clock (no tokens_per_s): the ledger gives its hours
    c1 = _write(
        tmp_path / "c1.jsonl",
        [
            {"split": "train", "step": 5, "loss": 7.0},
            {"split": "eval", "step": 5, "loss": 7.5, "tau": 1.02},
        ],
    )
    common = dict(tokens_per_step=TOKENS, command="python train.py ...")
    runs = [
        dict(common, name="a1", label="a 1", drafter_kind="dflash", metrics=a1,
             data_cpu_hours=0.5, status="superseded", main_line=True),
        dict(common, name="a2", label="a 2", drafter_kind="dflash", metrics=a2, continues="a1",
             data_cpu_hours=0.25, steps=3, status="shipped", main_line=True),
        dict(common, name="b1", label="b", drafter_kind="eagle3", metrics=b1, start_tokens=0,
             start_cpu_hours=0.5, status="shipped"),
        dict(common, name="c1", label="c", drafter_kind="dflash", metrics=c1, steps=10,
             start_cpu_hours=0.5, train_cpu_hours=2.0, status="lost"),
    ]  # fmt: skip
    ledger = {"cpu_hours": "hours of the test", "runs": runs}
    if edit:
        edit(runs)
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps(ledger))
    return str(path)


def _plot(*args):
    return subprocess.run(
        [sys.executable, "benchmarks/plot_learning_curve.py", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_ledger_cumulative_hours_tokens_table_and_projection(files, tmp_path):
    ledger = _ledger_file(tmp_path, files)
    out, js, md = tmp_path / "l.png", tmp_path / "l.json", tmp_path / "l.md"
    ok = _plot(f"--ledger={ledger}", "--project=2", f"--out={out}", f"--json_out={js}",
               f"--table_out={md}")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert out.stat().st_size > 1000 and md.exists()
    runs = {r["name"]: r for r in json.loads(js.read_text())["runs"]}
    s = 1 / 3600
    # a1: data 0.5 h, then its trainer's clock: 4 s + 10 s to step 4 (400 tokens)
    a1_end = 0.5 + 14 * s
    assert runs["a1"]["evals"][0]["cpu_hours"] == pytest.approx(a1_end)
    assert runs["a1"]["evals"][0]["tokens"] == 400
    # a2 continues a1: + 0.25 h of data + 2 s to step 2; 3 steps trained (log ends at 2), so
    # its end is 3 s of training at its own rate
    assert runs["a2"]["evals"][0]["cpu_hours"] == pytest.approx(a1_end + 0.25 + 2 * s)
    assert runs["a2"]["evals"][0]["tokens"] == 400 + 200
    assert runs["a2"]["end_cpu_hours"] == pytest.approx(a1_end + 0.25 + 3 * s)
    assert runs["a2"]["end_tokens"] == 700
    # b1, another drafter from scratch on reused data: 0.5 h + 30 s, 300 tokens
    assert runs["b1"]["evals"][0]["cpu_hours"] == pytest.approx(0.5 + 30 * s)
    assert runs["b1"]["evals"][0]["tokens"] == 300
    # c1 has no clock: the ledger's 2 h over 10 steps, so step 5 is at 0.5 + 1 h
    assert runs["c1"]["evals"][0]["cpu_hours"] == pytest.approx(1.5)
    assert runs["c1"]["end_cpu_hours"] == pytest.approx(2.5) and runs["c1"]["end_tokens"] == 1000
    table = md.read_text()
    row = next(line for line in table.splitlines() if line.startswith("| a 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["a 2", "dflash", "3", "0.00", "0.00", "0.25", "0.00", "0.75", "1.300",
                     "1.300", "shipped"]  # fmt: skip
    assert sum(line.startswith("| ") for line in table.splitlines()) >= 4 + 1 + 1
    # two main-line points: the power law through them, against hours and against tokens
    proj = json.loads(js.read_text())["projection"]
    alpha_t = np.log(0.3 / 0.1) / np.log(600 / 400)
    assert proj["against_tokens"]["targets"]["2.0"]["tokens"] == pytest.approx(
        400 * 10 ** (1 / alpha_t)
    )
    h1, h2 = a1_end, a1_end + 0.25 + 2 * s
    alpha_h = np.log(0.3 / 0.1) / np.log(h2 / h1)
    assert proj["against_cpu_hours"]["targets"]["2.0"]["cpu_hours"] == pytest.approx(
        h1 * 10 ** (1 / alpha_h)
    )


def _drop_command(runs):
    del runs[1]["command"]


def _wrong_start(runs):
    runs[1]["start_cpu_hours"] = 9.0


def _no_clock(runs):
    del runs[3]["train_cpu_hours"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (_drop_command, "run 2 (a2): missing key(s) command"),
        (_wrong_start, "start_cpu_hours 9.0, but a1, which it continues, ends at"),
        (_no_clock, "no clock"),
    ],
)
def test_ledger_refuses_inconsistent_entries(files, tmp_path, edit, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plc.read_ledger(_ledger_file(tmp_path, files, edit))


def test_ledger_bad_input_is_one_line_and_exit_2(files, tmp_path):
    out = tmp_path / "l.png"
    missing = str(tmp_path / "gone.jsonl")

    def _gone(runs):
        runs[2]["metrics"] = missing

    for ledger, words in (
        (_ledger_file(tmp_path, files, _gone), f"metrics file {missing} not found"),
        (str(tmp_path / "no_ledger.json"), "no_ledger.json not found"),
    ):
        bad = _plot(f"--ledger={ledger}", f"--out={out}")
        assert bad.returncode == 2, bad.stderr
        assert bad.stderr.startswith("error: ") and words in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and not out.exists()
