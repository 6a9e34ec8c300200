"""benchmarks/experiments/scan_layers/scan_layers_run.py: the looped and scanned stacks timed
side by side in fresh processes, their tokens checked equal; bad flags one line before any
model loads."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "experiments", "scan_layers", "scan_layers_run.py")
PAIR = os.path.join(ROOT, "assets", "tiny-code")

pytestmark = pytest.mark.once  # a script end to end: host-side (tests/README.md)


def _run(*flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, SCRIPT, *flags], capture_output=True, text=True, env=env, cwd=ROOT
    )


def test_times_both_stacks_on_the_bundled_pair():
    proc = _run(
        f"--target={PAIR}/target", f"--drafter={PAIR}/drafter", "--batch=1", "--max_new_tokens=8"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {ln.split()[0]: ln.split()[1:] for ln in proc.stdout.splitlines() if ln.strip()}
    for stack in ("looped", "scanned"):
        assert len(rows[stack]) == 4 and all(float(x) > 0 for x in rows[stack]), rows
    assert "scanned == looped" in proc.stdout


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--batch=0"], "--batch"),
        (["--drafter=/nonexistent"], "--drafter"),
        (["--nope=1"], "nope"),
    ],
)
def test_bad_flags_are_one_line(flags, says):
    proc = _run(*flags)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], proc.stderr


def test_infer_scan_layers_gives_the_loops_text(tmp_path):
    """`infer.py --scan_layers` decodes the looped run's tokens (JSON lines compared), the
    drafter accepted."""
    import json

    outs = {}
    for name, extra in (("looped", []), ("scanned", ["--scan_layers"])):
        out = tmp_path / f"{name}.jsonl"
        proc = subprocess.run(
            [sys.executable, os.path.join(ROOT, "infer.py"), f"--target={PAIR}/target",
             f"--drafter={PAIR}/drafter", "--prompt=def add(a, b):", "--max_new_tokens=24",
             f"--json_out={out}", *extra],
            capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tokens"] for r in outs["scanned"]] == [r["tokens"] for r in outs["looped"]]
    assert max(max(r["acceptance_lengths"]) for r in outs["scanned"]) >= 3


def test_sigterm_is_one_line_and_143():
    """SIGTERM during a benchmark's long work (here its first child process) ends it as
    Ctrl-C does, through `support.cli.run`: one line on stderr, exit 143, no traceback."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, SCRIPT, f"--target={PAIR}/target", f"--drafter={PAIR}/drafter"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    time.sleep(4)  # past the imports: inside the first child's run
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, (proc.returncode, err[-2000:])
    assert err.strip().splitlines() == ["interrupted"], err
