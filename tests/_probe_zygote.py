"""A fork server for the CLI probe (tests/test_cli_probe.py): imports jax and the library once,
then runs each case's command line in a child forked from that state, two at a time.

    python tests/_probe_zygote.py JOBS.json

JOBS.json: a list of {"argv": [...], "dir": ..., "timeout": s}, argv as after the interpreter
(`["infer.py", "--seed=x"]`, `["-m", "dflash_jax.dry_run", ...]`, `["-c", "code"]`). Each
child runs in the repository root with stdin from /dev/null and writes DIR/stdout, DIR/stderr
and DIR/rc (its exit status; -9 when killed past its timeout).

A refused case spends most of its seconds importing jax (about 1.8 s of a 2-3 s case on this
machine); here the imports are paid once. The child runs the command as the interpreter would:
the script or module executed afresh as `__main__` (`runpy`), its flags parsed from its own
argv, an uncaught exception printed as a traceback with exit status 1, `SystemExit` as the
status. Only library modules are preloaded (never a script), so no flag is defined twice.
Cases that set environment variables run as their own processes (the test's `run_case`): some
variables are read when jax is imported.
"""

import json
import os
import runpy
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = (
    "numpy",
    "jax",
    "jax.numpy",
    "absl.app",
    "absl.flags",
    "absl.logging",
    "ml_collections",
    "flax.linen",
    "optax",
    "dflash_jax",
    "dflash_jax.frontend.infer_flags",
    "dflash_jax.frontend.batch_runner",
    "dflash_jax.frontend.infer_run",
    "dflash_jax.frontend.textgen",
    "dflash_jax.models.hub",
    "dflash_jax.decoding.generation",
    "dflash_jax.dry_run.cli",
    "dflash_jax.support.cli",
    "dflash_jax.training.experiment",
)


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # as the interpreter does with a non-integer code
    return 1


def _child(argv, out_dir):
    """Runs in the forked child; never returns."""
    os.chdir(ROOT)
    fds = [
        os.open(os.devnull, os.O_RDONLY),
        os.open(os.path.join(out_dir, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        os.open(os.path.join(out_dir, "stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    code = 1
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], ROOT
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ROOT
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_status(e)
    except BaseException:  # noqa: BLE001 - the interpreter's own report of an uncaught error
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream has nothing left to write
                pass
        os._exit(code)


def main(jobs_path: str) -> None:
    for name in PRELOAD:
        __import__(name)
    with open(jobs_path) as f:
        jobs = json.load(f)
    pending, running = list(jobs), {}
    while pending or running:
        while pending and len(running) < 2:
            job = pending.pop(0)
            os.makedirs(job["dir"], exist_ok=True)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(job["argv"], job["dir"])
            running[pid] = (job, time.monotonic())
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for p, (job, start) in list(running.items()):
                if time.monotonic() - start > job["timeout"]:
                    os.kill(p, 9)
            time.sleep(0.01)
            continue
        job, _ = running.pop(pid)
        rc = os.waitstatus_to_exitcode(status)
        with open(os.path.join(job["dir"], "rc"), "w") as f:
            f.write(str(rc))


if __name__ == "__main__":
    main(sys.argv[1])
