"""scripts/train_on_device.sh end to end on the CPU in its TINY mode (the bundled tiny-code pair,
its own regenerated answers, a tap store, top-k KL with a draft vocabulary): the timer's
SIGTERM stops train.py after a checkpoint, the stopped run is exported, and the export loads
with its draft vocabulary; bad input is one line and exit 2, nothing written."""

import json
import os
import subprocess
import sys

import pytest

import dflash_jax as dj

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train_on_device.sh")


def _run(out, *args, **env):
    return subprocess.run(
        ["bash", SCRIPT, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "PYTHON": sys.executable,
            "TINY": "1",
            "OUT": str(out),
            **env,
        },
    )


@pytest.mark.once
def test_bad_minutes_is_one_line_and_exit_2_writing_nothing(tmp_path):
    assert subprocess.run(["bash", "-n", SCRIPT], timeout=60).returncode == 0
    out = tmp_path / "out"
    for args in ((), ("0",), ("-1",), ("abc",), ("1", "2"), ("1e3",)):
        r = _run(out, *args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stdout == "" and len(r.stderr.splitlines()) == 1, (args, r.stderr)
        assert r.stderr.startswith("error: "), r.stderr
    assert not out.exists()


@pytest.mark.slow  # a training script end to end: `make test`, not `make test-fast`
@pytest.mark.once
def test_tiny_run_stops_on_its_timer_and_exports_the_drafter(tmp_path):
    out = tmp_path / "out"
    r = _run(out, "0.1", K="512")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    drafter_dir = out / "train" / "export" / "drafter"
    assert f"drafter:  {drafter_dir}" in r.stdout
    # the timer's SIGTERM: a checkpoint, exit 3, then the export by stop_at_step
    assert "SIGTERM to train.py" in r.stdout and "--config.stop_at_step=" in r.stdout
    target = dj.load_target(os.path.join(ROOT, "assets", "tiny-code", "target"))
    d = dj.load_drafter(str(drafter_dir), target=target)
    assert d.draft_vocab is not None and len(d.draft_vocab) == 512
    rows = [json.loads(l) for l in open(out / "train" / "metrics.jsonl")]
    train = [r_ for r_ in rows if r_["split"] == "train"]
    assert train and train[-1]["step"] >= 1 and train[-1]["tokens_per_s"] > 0
    summary = [l for l in r.stdout.splitlines() if l.startswith("summary: ")]
    assert len(summary) == 1 and f"step {train[-1]['step']} " in summary[0], r.stdout
    store = json.load(open(out / "store" / "manifest.json"))
    assert store["tap_layers"] == [1, 2, 3, 4] and store["seq_len"] == 128
