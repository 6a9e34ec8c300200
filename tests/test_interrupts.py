"""Ctrl-C at any moment of a command-line run: during the imports, during the first compile,
between batches. Whatever the moment, the process ends with the documented exit status and
one line on stderr: no traceback, no `Fatal Python error` (a segfault at exit once followed a
Ctrl-C in the first compile), no file half-written (`dflash_jax/support/interrupts.py`)."""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import pytest

# Subprocesses of the real tools: `make test`, not the edit loop.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def interrupted(argv, delay, sig=signal.SIGINT):
    """(exit status, stdout, stderr) of `python argv...` sent `sig` after `delay` seconds."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", NO_COLOR="1")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A child of a non-interactive shell may inherit SIGINT ignored; a user's Ctrl-C is not.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(delay)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def _clean(err):
    assert "Traceback" not in err and "Fatal Python error" not in err, err[-3000:]
    return [ln for ln in err.splitlines() if ln.strip()]


def _parallel(fn, args):
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda a: fn(*a), args))


def test_infer_ctrl_c_at_any_moment_is_one_line_and_130(tmp_path):
    """infer.py on a prompt file with --json_out, interrupted in the imports, the compile and
    the batches: exit 130, one line; the file is absent (no batch finished) or holds whole
    JSON lines (the finished batches, as the line says)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(12)))
    runs = []
    for delay in (0.2, 1.5, 4.0, 9.0):  # imports, compile, first batch, later batches
        out = tmp_path / f"out_{delay}.jsonl"
        argv = [
            "infer.py",
            f"--prompt_file={prompts}",
            f"--json_out={out}",
            "--batch_size=1",
            "--max_new_tokens=200",
        ]
        runs.append((argv, delay, out))
    results = _parallel(lambda argv, d, o: (interrupted(argv, d), o), runs)
    for ((rc, _, err), out), (_, delay, _) in zip(results, runs):
        if rc == 0:  # finished before the signal (a fast machine): nothing to check
            continue
        lines = _clean(err)
        assert rc == 130, (delay, rc, err[-2000:])
        assert len(lines) == 1, (delay, lines)
        if os.path.exists(out):
            assert "finished batches are in" in lines[0], (delay, lines)
            for row in open(out):
                json.loads(row)  # every line whole
        else:
            assert "was not written" in lines[0] or "nothing was written" in lines[0], lines


def test_train_ctrl_c_before_the_first_step_is_one_line_and_no_checkpoint(tmp_path):
    """train.py interrupted in its imports and in the first step's compile: exit 130 (143 for
    SIGTERM), one line, no checkpoint. (After the first step a signal saves the step and
    exits 3: test_training.py::test_sigterm_saves_a_checkpoint_that_resumes.)"""
    runs = []
    for delay, sig in ((0.2, signal.SIGINT), (1.5, signal.SIGINT), (1.5, signal.SIGTERM)):
        wd = tmp_path / f"w_{delay}_{int(sig)}"
        argv = [
            "train.py",
            "--config=configs/tiny_test.py",
            f"--workdir={wd}",
            "--config.num_train_steps=100000",
            "--config.eval_every=0",
        ]
        runs.append((argv, delay, sig, wd))
    results = _parallel(lambda a, d, s, w: interrupted(a, d, s), runs)
    for (rc, _, err), (_, delay, sig, wd) in zip(results, runs):
        lines = _clean(err)
        assert rc == (130 if sig == signal.SIGINT else 143), (delay, rc, err[-2000:])
        assert lines == [
            "interrupted before the first training step: this run saved no checkpoint"
        ], lines
        ckpts = wd / "checkpoints"
        assert not ckpts.exists() or not any(p.name.isdigit() for p in ckpts.iterdir())


def test_dry_run_ctrl_c_in_imports_and_compile_is_one_line_and_130():
    argv = ["-m", "dflash_jax.dry_run", "--topology=cpu:2", "--model=tiny"]
    for rc, _, err in _parallel(interrupted, [(argv, 0.2), (argv, 3.0)]):
        assert rc == 130 and _clean(err) == ["interrupted: nothing was written"], (rc, err[-2000:])


_HANDOFF = """
import signal, sys
from dflash_jax.support import interrupts
interrupts.raise_on_sigterm()
interrupts.guard("interrupted: nothing was written")
# The signal's Python-level handler ran while armed (the C handler also wakes the watcher; here
# the release wins the race for the lock, so the watcher would find the guard disarmed).
interrupts._python_handler(getattr(signal, sys.argv[1]), None)
try:
    interrupts.release({signal.SIGINT: signal.default_int_handler})
except KeyboardInterrupt as e:
    print(type(e).__name__)
else:
    print("lost")
"""


@pytest.mark.parametrize(
    "sig, raised", [("SIGINT", "KeyboardInterrupt"), ("SIGTERM", "Terminated")]
)
def test_a_signal_that_comes_as_the_guard_is_released_reaches_the_released_handlers(sig, raised):
    """A signal whose handler ran just before `release()` (the batch saved, the watcher not yet
    scheduled) was dropped: the watcher found the guard disarmed and the run went on to exit 0
    (a CI run of the regeneration test). It is now raised to the handlers the tool installs."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run(
        [sys.executable, "-c", _HANDOFF, sig], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == [raised]
