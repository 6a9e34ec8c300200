"""Nothing lost on the new paths (issue #66): one writer per output, outputs checked before any
compute, signals at the end of a run, a resumed run's logged figures.

  * two runs on one output: the second is refused in one line naming the first (its pid),
    before any model loads, and the first run's output is whole (`dflash_jax/support/locks.py`:
    infer.py's --json_out, train.py's workdir, regeneration's --out); a lock a dead run left
    is taken over with a note; a lock is released however its run ends;
  * an output that would fail after the work (a directory nothing can be created in, even as
    root; a name past the file system's limit; a profile or export directory blocked by a
    file) is refused first: one `error:` line, exit 2, nothing written;
  * Ctrl-C during a tool's shutdown is one line, no atexit KeyboardInterrupt traceback;
    SIGTERM after infer.py's first batch says what was kept and how to resume;
  * a train.py refusal leaves no train.log; a resumed training run logs the loss the
    uninterrupted run logs at the same step.
"""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dflash_jax.support import locks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = os.path.join(ROOT, "assets", "tiny-code")


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", NO_COLOR="1")
    env.pop("XLA_FLAGS", None)
    return env


def _start(argv, **kw):
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=kw.pop("stdin", subprocess.DEVNULL),
        text=True,
        # A child of a non-interactive shell may inherit SIGINT ignored; a user's Ctrl-C is not.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **kw,
    )


def _run(argv, timeout=300):
    proc = _start(argv)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _lines(err):
    assert "Traceback" not in err and "Fatal Python error" not in err, err[-3000:]
    return [ln for ln in err.splitlines() if ln.strip()]


def _tree(folder):
    """{relative path: bytes (None for a directory)} of everything under `folder`."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), folder)] = None
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = open(p, "rb").read()
    return out


def _prompt_file(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"def f{i}(x, y):\n    "}) + "\n")


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _wait_for(cond, timeout, what):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.05)


# --------------------------------------------------------------------------- the lock itself


def test_a_held_lock_refuses_in_one_line_and_a_stale_one_is_taken_over(tmp_path, capfd):
    out = str(tmp_path / "out.jsonl")
    # A lock file that a run killed before it could release it left behind: its flock is gone
    # with its process, so the next run takes it over, saying whose it was.
    dead = _dead_pid()
    path = locks.lock_path(out)
    assert path == out + ".lock"
    with open(path, "w") as f:
        json.dump({"pid": dead, "host": "elsewhere", "started": 0}, f)
    lock = locks.acquire(out, "--json_out")
    err = capfd.readouterr().err
    assert f"taking over the lock left by a run that ended without releasing it (pid {dead}" in err
    assert json.load(open(path))["pid"] == os.getpid()
    # Held (here, by this very process through another open file): refused, naming the holder.
    with pytest.raises(locks.LockHeld) as e:
        locks.acquire(str(tmp_path / "." / "out.jsonl"), "--json_out")
    msg = str(e.value)
    assert "\n" not in msg and f"pid {os.getpid()}" in msg and "in use by another run" in msg
    lock.release()
    assert not os.path.exists(path) and not os.path.exists(out)
    lock.release()  # twice: nothing more happens
    # A directory output: DIR/.lock, the directory created for it and removed when left empty.
    wd = tmp_path / "new" / "workdir"
    lock = locks.acquire(str(wd), "--workdir", directory=True)
    assert os.listdir(wd) == [".lock"]
    lock.release()
    assert not (tmp_path / "new").exists()
    # A file name long enough that NAME.lock would not fit: a hashed hidden name beside it.
    long_out = str(tmp_path / ("x" * 252 + ".jsonl"))
    assert len(os.path.basename(locks.lock_path(long_out))) < 64


def test_the_launch_process_variable_is_the_launchers():
    from dflash_jax.parallel import launch

    assert locks.ENV_PROCESS_ID == launch.ENV_PROCESS_ID


_HOLDER = textwrap.dedent(
    """
    import sys
    from dflash_jax.support import interrupts, locks
    interrupts.guard("holder interrupted")
    locks.acquire(sys.argv[1], "--out", directory=sys.argv[2] == "dir")
    print("held", flush=True)
    if sys.argv[3] == "error":
        raise SystemExit(1)
    sys.stdin.read()
    """
)


def _holder(path, kind, then="wait"):
    proc = _start(["-c", _HOLDER, path, kind, then], stdin=subprocess.PIPE)
    if then == "wait":
        assert proc.stdout.readline() == "held\n", proc.stderr.read()
    return proc


@pytest.mark.once
def test_a_second_train_or_regeneration_run_is_refused_naming_the_first(tmp_path):
    """train.py on a workdir and regeneration on an --out that another run holds: exit 2, one
    line naming the holder's pid, before any model loads; nothing in the workdir changes. The
    holder's lock goes with it whether it ends by a signal or by an error."""
    wd = str(tmp_path / "w")
    out = str(tmp_path / "regen.jsonl")
    _prompt_file(tmp_path / "p.jsonl", 2)
    holders = [_holder(wd, "dir"), _holder(out, "file")]
    before = _tree(tmp_path)
    runs = [
        [
            "train.py",
            "--config=configs/tiny_test.py",
            f"--workdir={wd}",
            "--config.data.kind=synthetic",
            "--config.num_train_steps=2",
            "--config.eval_every=0",
        ],
        [
            "-m",
            "dflash_jax.training.regenerate",
            f"--target={PAIR}/target",
            f"--prompts={tmp_path / 'p.jsonl'}",
            f"--out={out}",
            "--max_new_tokens=4",
        ],
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_run, runs))
    for (rc, stdout, err), holder, what in zip(results, holders, ("--workdir", "--out")):
        lines = _lines(err)
        assert rc == 2 and len(lines) == 1, (rc, err[-2000:])
        assert lines[0].startswith(f"error: {what} ") and f"pid {holder.pid} on " in lines[0]
        assert stdout == ""
    assert _tree(tmp_path) == before  # no train.log, no responses, nothing
    # The holders end: by Ctrl-C in the guard's immediate exit, and by an error.
    holders[0].send_signal(signal.SIGINT)
    holders[1].stdin.close()
    assert holders[0].wait(timeout=60) == 130 and holders[1].wait(timeout=60) == 0
    assert not os.path.exists(wd)  # its lock removed, and the directory it created
    assert not os.path.exists(out + ".lock")
    failing = _holder(out, "file", then="error")
    assert failing.wait(timeout=60) == 1 and not os.path.exists(out + ".lock")


@pytest.mark.slow
@pytest.mark.once
def test_two_infer_runs_on_one_json_out_the_second_is_refused_the_first_is_whole(tmp_path):
    """The first run (which takes over a lock a dead run left) is paused while it holds the
    lock; the second, on the same file named another way, is refused in one line naming it
    before any model loads; the first then finishes with every one of its records in the file."""
    out = tmp_path / "out.jsonl"
    _prompt_file(tmp_path / "p.jsonl", 12)
    dead = _dead_pid()
    lock_file = str(out) + ".lock"
    with open(lock_file, "w") as f:
        json.dump({"pid": dead, "host": "here", "started": 0}, f)
    argv = [
        "infer.py",
        f"--target={PAIR}/target",
        f"--prompt_file={tmp_path / 'p.jsonl'}",
        "--batch_size=4",
        "--max_new_tokens=16",
    ]
    first = _start(argv + [f"--json_out={out}"])

    def held_by_first():
        try:
            return json.load(open(lock_file)).get("pid") == first.pid
        except (OSError, ValueError):
            return first.poll() is not None

    _wait_for(held_by_first, 120, "the first run did not take the lock")
    first.send_signal(signal.SIGSTOP)  # it holds the lock while the second one starts
    try:
        t0 = time.time()
        rc, stdout, err = _run(argv + [f"--json_out={tmp_path}/./sub/../out.jsonl"])
        took = time.time() - t0
    finally:
        first.send_signal(signal.SIGCONT)
    lines = _lines(err)
    assert rc == 2 and len(lines) == 1, (rc, err[-2000:])
    assert lines[0].startswith("error: --json_out ") and f"pid {first.pid} on " in lines[0]
    assert stdout == "" and took < 60  # no model line: refused before loading
    f_out, f_err = first.communicate(timeout=300)
    assert first.returncode == 0, f_err[-3000:]
    assert f"left by a run that ended without releasing it (pid {dead}" in f_err
    recs = [json.loads(line) for line in open(out)]
    assert sorted(r["index"] for r in recs) == list(range(12))
    assert all(len(r["tokens"]) == 16 for r in recs)
    assert f"wrote {out} (12 JSON lines)" in f_out
    assert not os.path.exists(lock_file)
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl", "p.jsonl"]


# ------------------------------------------------------------------------------ late outputs


def _blocked_profile(tmp):
    os.makedirs(os.path.join(tmp, "trace"))
    open(os.path.join(tmp, "trace", "plugins"), "w").write("a file where a directory goes")


def _export_file(tmp):
    os.makedirs(os.path.join(tmp, "w"))
    open(os.path.join(tmp, "w", "export"), "w").write("a file where the export goes")


def _export_config_dir(tmp):
    os.makedirs(os.path.join(tmp, "w", "export", "drafter", "config.json"))


_INFER = ["infer.py", f"--target={PAIR}/target", "--max_new_tokens=2"]
_TRAIN = [
    "train.py",
    "--config=configs/tiny_test.py",
    "--workdir={tmp}/w",
    "--config.data.kind=synthetic",
    "--config.num_train_steps=1",
    "--config.eval_every=0",
]
LONG = "n" * 300
# (name, argv, setup, the error line's pattern)
LATE = [
    ("infer_json_out_in_proc", _INFER + ["--json_out=/proc/out.jsonl"], None, r"/proc"),
    ("infer_json_out_name_too_long", _INFER + ["--json_out={tmp}/%s.jsonl" % LONG], None, "255"),
    ("infer_profile_in_proc", _INFER + ["--profile_dir=/proc/trace"], None, r"/proc"),
    ("infer_profile_name_too_long", _INFER + ["--profile_dir={tmp}/" + LONG], None, "255"),
    (
        "infer_profile_blocked",
        _INFER + ["--profile_dir={tmp}/trace"],
        _blocked_profile,
        r"trace/plugins is a file",
    ),
    (
        "train_profile_blocked",
        _TRAIN + ["--profile_dir={tmp}/trace"],
        _blocked_profile,
        r"trace/plugins is a file",
    ),
    ("train_profile_in_proc", _TRAIN + ["--profile_dir=/proc/trace"], None, r"/proc"),
    ("train_workdir_name_too_long", _TRAIN + ["--workdir={tmp}/" + LONG], None, "255"),
    ("train_export_blocked_by_a_file", _TRAIN, _export_file, r"w/export exists and is not a dir"),
    (
        "train_export_config_is_a_directory",
        _TRAIN,
        _export_config_dir,
        r"export/drafter/config\.json is a directory",
    ),
]


@pytest.mark.once
def test_outputs_that_would_fail_after_the_work_are_refused_before_it(tmp_path):
    """Each case refused in one `error:` line, exit 2, with nothing on stdout and its folder
    as it was. The cases run through the CLI probe's fork server (tests/_probe_zygote.py: jax
    and the library imported once, each case a child forked from there, two at a time), as a
    fresh interpreter would run them; the server's own files (stdout, stderr, rc) go beside
    each case's folder, not in it."""
    import re

    from test_cli_probe import Case, run_forked

    cases, work = [], {}
    for name, argv, setup, _ in LATE:
        work[name] = str(tmp_path / name / "work")
        os.makedirs(work[name])
        if setup is not None:
            setup(work[name])
        cases.append(Case(name, [a.replace("{tmp}", work[name]) for a in argv]))
    before = {name: _tree(w) for name, w in work.items()}
    results = run_forked(cases, str(tmp_path))
    wrong = []
    for name, _, _, pattern in LATE:
        proc = results[name][0]
        rc, stdout, err = proc.returncode, proc.stdout, proc.stderr
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if rc != 2 or len(lines) != 1 or not lines[0].startswith("error: "):
            wrong.append(f"{name}: exit {rc}, stderr {err[-600:]!r}")
        elif not re.search(pattern, lines[0]):
            wrong.append(f"{name}: {lines[0]!r} does not match {pattern!r}")
        if stdout or _tree(work[name]) != before[name]:  # nothing computed, nothing written
            wrong.append(f"{name}: stdout {stdout[:200]!r}, files {sorted(_tree(work[name]))[:5]}")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------ signals and refusals


_SHUTDOWN = textwrap.dedent(
    """
    import atexit, sys, time
    from dflash_jax.support import cli, interrupts
    interrupts.guard("interrupted: nothing was written")

    def main(argv):
        interrupts.release()  # as infer.py after its first batch, train.py after a step
        atexit.register(time.sleep, 30)  # a slow teardown (JAX's, Orbax's) at exit
        print("done", flush=True)

    cli.run(main)
    """
)


@pytest.mark.once
def test_ctrl_c_during_a_tools_shutdown_is_one_line(tmp_path):
    """A CLI (cli.run, as infer.py and train.py) whose main has ended, interrupted in its atexit
    handlers: one line and 130, not 'Exception ignored in atexit callback' and a traceback."""
    proc = _start(["-c", _SHUTDOWN])
    assert proc.stdout.readline() == "done\n"
    time.sleep(1.0)  # in the atexit handler
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert _lines(err) == ["interrupted while exiting: the run had already ended"]


@pytest.mark.once
def test_a_train_refusal_after_logging_started_leaves_no_train_log(tmp_path):
    """A target whose config.json is not JSON is refused when it is read (after train.log is
    opened): one line, exit 2, and neither train.log nor the workdir the run created."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{not json")
    rc, stdout, err = _run(
        [
            "train.py",
            "--config=configs/tiny_test.py",
            f"--workdir={tmp_path / 'w'}",
            f"--config.target_path={target}",
        ]
    )
    lines = _lines(err)
    assert rc == 2 and len(lines) == 1 and "config.json" in lines[0], err[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["target"]
    # An existing workdir keeps what it had (and gets nothing new).
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "notes.txt").write_text("mine")
    rc, _, err = _run(
        [
            "train.py",
            "--config=configs/tiny_test.py",
            f"--workdir={tmp_path / 'w'}",
            f"--config.target_path={target}",
        ]
    )
    assert rc == 2 and os.listdir(tmp_path / "w") == ["notes.txt"], err[-2000:]


@pytest.mark.slow
@pytest.mark.once
def test_sigterm_after_the_first_infer_batch_says_what_was_kept_and_how_to_resume(tmp_path):
    out = tmp_path / "out.jsonl"
    _prompt_file(tmp_path / "p.jsonl", 12)
    proc = _start(
        [
            "infer.py",
            f"--target={PAIR}/target",
            f"--prompt_file={tmp_path / 'p.jsonl'}",
            f"--json_out={out}",
            "--batch_size=1",
            "--max_new_tokens=64",
        ]
    )
    _wait_for(
        lambda: (out.exists() and out.read_text().count("\n") >= 1) or proc.poll() is not None,
        240,
        "no batch finished",
    )
    time.sleep(0.3)  # past the first batch's bookkeeping (the guard released after its write)
    proc.send_signal(signal.SIGSTOP)  # no batch finishes between the check and the signal
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (proc.returncode, err[-2000:])
    assert _lines(err) == [
        f"interrupted: finished batches are in {out}; rerun with --resume to continue"
    ]
    recs = [json.loads(line) for line in open(out)]  # every line whole
    assert 1 <= len(recs) < 12
    assert not os.path.exists(str(out) + ".lock")


# ------------------------------------------------------------------------ resumed training


def test_a_resumed_run_logs_the_loss_the_uninterrupted_run_logs(tmp_path):
    """A stage stopped at step 6 with log_every 4 and resumed: the line at step 8 is the mean
    of steps 5..8, as in one uninterrupted run (the window's sums are in the checkpoint), not
    of 7..8 alone."""
    from configs import tiny_test
    from dflash_jax.training import trainer

    def config(**kw):
        c = tiny_test.get_config()
        c.data.update(kind="synthetic", num_docs=40, doc_len=40)
        c.update(
            num_train_steps=8, log_every=4, eval_every=0, checkpoint_every=100, export=False, **kw
        )
        return c

    def logged(wd):
        rows = [json.loads(line) for line in open(os.path.join(wd, "metrics.jsonl"))]
        return {r["step"]: r for r in rows if r["split"] == "train"}

    full = str(tmp_path / "full")
    whole = trainer.train_and_evaluate(config(), full)
    staged = str(tmp_path / "staged")
    first = trainer.train_and_evaluate(config(stop_at_step=6), staged)
    second = trainer.train_and_evaluate(config(), staged)
    assert first["losses"] + second["losses"] == whole["losses"]  # the steps themselves agree
    a, b = logged(full), logged(staged)
    assert sorted(a) == [4, 8] and sorted(b) == [4, 6, 8]
    for key in ("loss", "grad_norm", "acc_k01", "block_accept_len"):
        assert b[8][key] == a[8][key], key
    # The stage's own line at step 6 is the mean of the steps it ran of that window.
    losses = dict(whole["losses"])
    assert b[6]["loss"] == pytest.approx((losses[5] + losses[6]) / 2, rel=1e-5)
