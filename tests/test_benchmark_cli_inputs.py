"""The benchmark CLIs on bad input (issue #66, class 9): benchmarks/plot_learning_curve.py,
drafter_grid.py and compare_drafters.py check their flags, input files and output paths before
anything is read, fitted, loaded or decoded (one line, `error: ...`, exit 2, nothing written);
no data (an empty file, no drafter steps, zero tokens) is said, never a division by zero or a
NaN; a projection to a tau at or below 1, or one the fit reaches at no finite x, is refused;
Ctrl-C / SIGTERM is one line and 130 / 143; and what they write is written whole
(dflash_jax/support/outputs.py). Every CLI run here fails before any model loads."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from benchmarks import compare_drafters as cd
from benchmarks import drafter_grid as dg
from benchmarks import plot_learning_curve as plc
from dflash_jax.support import outputs

# Host-side behaviour the jax version does not change: `make test` only (tests/README.md).
pytestmark = pytest.mark.once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRY_RUNS = os.path.join(ROOT, "benchmarks", "results", "smollm2", "compare", "dry_runs")


def _run(script, *args, **kw):
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        **kw,
    )


def _one_line_refusal(res, words):
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-2000:]
    assert words in lines[0], lines[0]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


RISING = [
    {"split": "train", "step": 2, "loss": 5.0, "tokens_per_s": 50.0},
    {"split": "eval", "step": 2, "loss": 4.5, "tau": 1.1},
    {"split": "eval", "step": 4, "loss": 4.0, "tau": 1.2},
]


# ------------------------------------------------------------------ plot_learning_curve.py


def _ledger(tmp_path, metrics, **run):
    entry = dict(name="a", label="a", drafter_kind="dflash", metrics=metrics, tokens_per_step=100,
                 command="python train.py", status="shipped", main_line=True)  # fmt: skip
    entry.update(run)
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps({"runs": [entry]}))
    return str(path)


def _curve_cases(tmp_path):
    """(args, words of the one line) per bad input; the figure would be tmp_path/out/c.png."""
    ok = _jsonl(tmp_path / "ok.jsonl", RISING)
    out = f"--out={tmp_path / 'out' / 'c.png'}"
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty.jsonl").write_text("")
    no_step = _jsonl(tmp_path / "no_step.jsonl", [{"split": "train", "loss": 5.0}])
    nan_tau = _jsonl(tmp_path / "nan.jsonl", [{"split": "eval", "step": 2, "loss": 1.0,
                                              "tau": float("nan")}])  # fmt: skip
    flat = _jsonl(tmp_path / "flat.jsonl", [
        {"split": "eval", "step": 2, "loss": 1.0, "tau": 1.2},
        {"split": "eval", "step": 4, "loss": 1.0, "tau": 1.2000001},
    ])  # fmt: skip
    nothing = _jsonl(tmp_path / "nothing.jsonl", [{"split": "train", "step": 2}])
    ledger = _ledger(tmp_path, ok)
    (tmp_path / "number.json").write_text("7")
    tps0 = tmp_path / "tps0"
    tps0.mkdir()
    spare = tmp_path / "spare"
    spare.mkdir()
    (spare / "ledger.json").write_text(
        json.dumps(
            {"unattributed_data": "regeneration, 3 h", "runs": json.load(open(ledger))["runs"]}
        )  # fmt: skip
    )
    return [
        ([f"--runs={ok}", f"--out={tmp_path / 'a_file' / 'c.png'}"], "a_file is a file"),
        ([f"--runs={tmp_path / 'empty.jsonl'}", out], "has no records (empty)"),
        ([f"--runs={no_step}", out], "no_step.jsonl:1: not a metrics record"),
        ([f"--runs={nan_tau}", out], "nan.jsonl:1: tau nan is not a finite number"),
        ([f"--runs={nothing}", out], "no train loss or eval tau records"),
        ([f"--runs={ok}", out, "--tokens_per_step=0"], "--tokens_per_step must be >= 1"),
        ([f"--runs={ok}", out, "--smooth=0"], "--smooth must be >= 1"),
        ([f"--runs={ok}", out, "--project=1"], "must be a finite number above 1"),
        ([f"--runs={ok}", out, "--project=0.5"], "must be a finite number above 1"),
        ([f"--runs={ok}", out, "--project=nan"], "must be a finite number above 1"),
        ([f"--runs={ok}", out, "--project=inf"], "must be a finite number above 1"),
        ([f"--runs={flat}", out, "--project=3"], "reaches tau 3 at no finite x"),
        ([f"--runs={ok}", out, f"--json_out={ok}"], "is an input of this run"),
        ([f"--runs={ok}", out, f"--table_out={tmp_path / 't.md'}"], "with --ledger only"),
        ([f"--runs={ok}", f"--out={tmp_path / 'out' / 'c.txt'}"], "not a figure file name"),
        ([f"--runs={ok}", out, "--groups=x"], "--groups: 'x' is not a drafter index"),
        ([f"--ledger={tmp_path / 'number.json'}", out], 'a list of runs, or {"runs"'),
        # the JSON beside --out (ledger.png -> ledger.json) would be the ledger itself
        ([f"--ledger={ledger}", f"--out={tmp_path / 'ledger.png'}"], "is an input of this run"),
        ([f"--ledger={_ledger(tps0, ok, tokens_per_step=0)}", out], "no tokens per step"),
        ([f"--ledger={spare / 'ledger.json'}", out], "unattributed_data is not a list"),
        ([f"--ledger={ledger}", out, "--tokens_per_step=10"], "--tokens_per_step is for --runs"),
    ]


def test_learning_curve_bad_input_is_one_line_before_anything_is_written(tmp_path):
    cases = _curve_cases(tmp_path)
    before = sorted(os.listdir(tmp_path))
    for args, words in cases:
        _one_line_refusal(_run("plot_learning_curve.py", *args), words)
        assert sorted(os.listdir(tmp_path)) == before, args  # nothing written, no folder made
    # the good file of those cases draws (the refusals were about the rest)
    out = tmp_path / "out" / "c.png"
    ok = _run("plot_learning_curve.py", f"--runs={tmp_path / 'ok.jsonl'}", f"--out={out}",
              "--project=1.5", "--tokens_per_step=100")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert out.stat().st_size > 1000
    proj = json.loads(out.with_suffix(".json").read_text())["projection"]
    assert proj["targets"]["1.5"]["tokens"] > 400
    assert [n for n in os.listdir(out.parent) if n.endswith(".tmp")] == []


def test_projection_refuses_goals_at_or_below_one_and_infinite_answers():
    evals = [(t, 0.0, 5.0, 1.0 + 0.002 * t**0.5) for t in (1e4, 4e4, 1.6e5)]
    for bad in (1.0, 0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite number above 1"):
            plc.project(evals, [bad])
    # a nearly flat curve: tau 3 only at an overflowing token count
    with pytest.raises(ValueError, match="at no finite x"):
        plc.project([(1e4, 0, 5, 1.2), (2e4, 0, 5, 1.2000001)], [3.0])
    got = plc.project(evals, [3.0], hours=1e-4)["targets"]["3.0"]
    assert got["tokens"] == pytest.approx(1e6) and got["hours"] == pytest.approx(100.0)


def _fifo_writer(path, first):
    """Opens the FIFO `path` for writing (returns once the reader has opened it) and writes
    `first` without ending the line: the reader is then waiting for the rest."""
    ready = threading.Event()
    box = {}

    def _open():
        box["f"] = open(path, "w")
        box["f"].write(first)
        box["f"].flush()
        ready.set()

    threading.Thread(target=_open, daemon=True).start()
    return ready, box


@pytest.mark.parametrize(
    "script, args, sig, code",
    [
        ("plot_learning_curve.py", ["--runs={fifo}", "--out={out}"], signal.SIGINT, 130),
        ("compare_drafters.py", ["--dry_runs={fifo}", "--json_out={out}"], signal.SIGTERM, 143),
    ],
)
def test_interrupted_while_reading_is_one_line_and_nothing_written(tmp_path, script, args, sig,
                                                                   code):  # fmt: skip
    """The signal comes while the script waits on its input (a FIFO): armed from the start."""
    fifo = str(tmp_path / "input.json")
    os.mkfifo(fifo)
    out = tmp_path / "out.png" if script.startswith("plot") else tmp_path / "out.json"
    proc = subprocess.Popen(
        [sys.executable, f"benchmarks/{script}", *(a.format(fifo=fifo, out=out) for a in args)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ready, box = _fifo_writer(fifo, '{"step": 1')
    try:
        assert ready.wait(60), "the script never opened its input"
        time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            box["f"].close()
        except (KeyError, OSError):
            pass
    assert proc.returncode == code, err
    assert err.strip() == "interrupted: nothing was written"
    assert sorted(os.listdir(tmp_path)) == ["input.json"]


# ------------------------------------------------------------ drafter_grid / compare_drafters


def test_no_drafter_steps_is_no_data_not_a_division_by_zero():
    s = dg.summarize([[], []])
    assert s["tau"] is None and s["tau_steps"] is None and s["steps"] == 0
    base = {"t0_b16": {"d": dict(dg.summarize([[3, 2]]), identical=1, responses=1)}}
    empty = {"t0_b16": {"d": dict(s, identical=0, responses=1)}}
    results = {f"a:{k}": v for k, v in base.items()} | {f"b:{k}": v for k, v in empty.items()}
    assert dg.NO_DATA in dg.ratios(results, ["a", "b"], ["t0_b16"], ["d"])
    results = {f"a:{k}": v for k, v in empty.items()} | {f"b:{k}": v for k, v in base.items()}
    assert dg.NO_DATA in dg.ratios(results, ["a", "b"], ["t0_b16"], ["d"])
    assert dg.NO_DATA in dg.markdown(empty, ["d"])
    # compare_drafters: no steps and no AR tokens (nothing decoded): no passes, no speedup
    measured = {
        cd.AR: dict(acceptance=None, decode_s=0.0, tokens=0, identical=None),
        "x": dict(acceptance=[[]], decode_s=0.0, tokens=0, identical=1),
    }
    ratios = {"v5e": {("dflash", 16): {"ratio": 2.0, "floor_ratio": 1.5}}}
    rows = cd.rows_of(measured, {"x": "dflash"}, {"x": 16}, ratios, "d", 0.0)
    x = rows[1]
    assert x["tau"] is None and x["passes_per_token"] is None and x["cpu_speedup"] is None
    assert x["projected"] == {"v5e": None}
    table = cd.markdown(rows, ["v5e"])
    assert dg.NO_DATA in table and "nan" not in table.lower()
    json.dumps(rows, allow_nan=False)  # no NaN figure anywhere


def _dry(**edit):
    with open(os.path.join(DRY_RUNS, "v5e_8_dflash_b16.json")) as f:
        rec = json.load(f)
    rec = rec[0] if isinstance(rec, list) else rec
    for path, value in edit.items():
        *keys, last = path.split("__")
        node = rec
        for k in keys:
            node = node[k]
        if value is None:
            del node[last]
        else:
            node[last] = value
    return rec


@pytest.mark.parametrize(
    "edit, words",
    [
        (dict(topology=None), "no topology"),
        (dict(settings__block_size=None), "settings.block_size None"),
        (dict(settings__attention="pallas"), "settings.attention 'pallas' is not a list"),
        (dict(roofline__projection__pallas__ar__time_s=0.0), "ar.time_s 0.0 is not a finite"),
        (dict(roofline__projection__pallas__dflash__floor_time_s=float("nan")), "floor_time_s"),
        (dict(roofline__projection__pallas__hbm_step_ratio=None), "none of the 1 dry runs"),
    ],
)
def test_a_wrong_dry_run_is_refused_before_anything_is_measured(tmp_path, edit, words):
    path = tmp_path / "dry.json"
    path.write_text(json.dumps(_dry(**edit)))
    with pytest.raises(ValueError, match="--dry_runs") as e:
        cd.read_dry_runs(str(path))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_shipped_dry_runs_are_read():
    records, sources = cd.read_dry_runs(os.path.join(DRY_RUNS, "*.json"))
    assert len(records) >= 8 and len(set(sources)) == 8
    assert set(cd.step_ratios(records)) == {r["topology"] for r in records}


def test_grid_and_compare_bad_input_is_one_line_before_any_model(tmp_path):
    (tmp_path / "a_file").write_text("x")
    dry = tmp_path / "dry.json"
    # no topology and no loops side by side: once read only when the results were written
    dry.write_text(
        json.dumps(_dry(topology=None, roofline__projection__pallas__hbm_step_ratio=None))
    )
    kept = tmp_path / "kept.json"
    kept.write_text(json.dumps(_dry()))
    before = {p: open(p).read() for p in (dry, kept)}
    # a target that does not exist: reaching it would be a different error
    common = ["--target=/nonexistent/target", "--num_prompts=1"]
    cases = [
        ("drafter_grid.py", [f"--json_out={tmp_path / 'a_file' / 'g.json'}"], "a_file is a file"),
        ("drafter_grid.py", [f"--json_out={tmp_path / 'g.md'}"], "give a .json name"),
        ("drafter_grid.py", ["--settings="], "--settings: give one or more"),
        ("drafter_grid.py", ["--datasets="], "--datasets: give one or more"),
        ("drafter_grid.py", ["--drafter="], "--drafter: give one or more"),
        ("compare_drafters.py", ["--temperatures="], "--temperatures: give one or more"),
        ("compare_drafters.py", ["--drafter="], "--drafter: give one or more"),
        ("compare_drafters.py", [f"--dry_runs={dry}"], "no topology"),
        ("compare_drafters.py", [f"--dry_runs={kept}", f"--json_out={kept}"], "is an input"),
        ("compare_drafters.py", [f"--json_out={tmp_path / 'a_file' / 'c.json'}"], "is a file"),
    ]
    for script, args, words in cases:
        _one_line_refusal(_run(script, *common, *args), words)
    assert sorted(os.listdir(tmp_path)) == ["a_file", "dry.json", "kept.json"]
    assert {p: open(p).read() for p in (dry, kept)} == before


# --------------------------------------------------------------- dflash_jax/support/outputs


def test_outputs_are_all_or_none_and_never_clobber_an_input(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.md"
    a.write_text("old a")
    with pytest.raises(OSError):
        outputs.write_many({a: "new a", tmp_path / "missing" / "b.md": "new b"})
    assert a.read_text() == "old a" and sorted(os.listdir(tmp_path)) == ["a.json"]
    outputs.write_many({a: "new a", b: b"new b"})
    assert a.read_text() == "new a" and b.read_bytes() == b"new b"
    with pytest.raises(ValueError, match="is an input of this run"):
        outputs.check_outputs({"--out": str(a)}, [str(a)])
    with pytest.raises(ValueError, match="--x and --out are the same file"):
        outputs.check_outputs({"--out": str(a), "--x": str(tmp_path / "." / "a.json")})
    with pytest.raises(ValueError, match="is a file, not a directory"):
        outputs.check_outputs({"--out": str(a / "c.png")}, create_dirs=True)
    assert outputs.check_outputs({"--out": str(tmp_path / "new" / "c.png")}, create_dirs=True)


SIGNAL_IN_WRITES = """
import os, signal, sys
sys.path.insert(0, {root!r})
from dflash_jax.support import interrupts, outputs

interrupts.guard("interrupted: nothing was written")

class Late:  # a path that sends SIGTERM to this process as the files are being written
    def __init__(self, p): self.p, self.n = p, 0
    def __fspath__(self):
        self.n += 1
        if self.n == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.p

outputs.write_all({{{a!r}: "A" * 100000, Late({b!r}): "B" * 100000}})
print("not reached")
"""


def test_a_signal_while_writing_waits_until_every_file_is_whole(tmp_path):
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.md")
    code = SIGNAL_IN_WRITES.format(root=ROOT, a=a, b=b)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 143, res.stderr
    assert res.stderr.strip() == f"interrupted: wrote {a}, {b} (whole)"
    assert "not reached" not in res.stdout
    assert open(a).read() == "A" * 100000 and open(b).read() == "B" * 100000
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b.md"]  # no temporary file left


# ------------------------------------------------ the other benchmark scripts: cli.run, not app.run


@pytest.mark.parametrize(
    "script, args, words",
    [
        ("scale_costs.py", ["--sizes=foo"], "--sizes entries look like 512x8"),
        ("experiments/dflash2/dflash2_cost.py", [], "--out is required"),
        ("experiments/tap_store/tap_cache.py", [], "--config is required"),
        ("rerun_dry_runs.py", ["stray"], "unexpected arguments: ['stray']"),
        ("plot_training.py", ["--no_such_flag=1"], "Unknown command line flag 'no_such_flag'"),
    ],
)
def test_other_benchmarks_say_a_usage_error_in_one_line(script, args, words):
    """absl's app.run printed the whole module doc (30-50 lines) before the one that matters."""
    _one_line_refusal(_run(script, *args), words)
