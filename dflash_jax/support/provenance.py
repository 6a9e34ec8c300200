"""Where a result file came from: the command line, the git commit (and whether the working
tree differed from it), the date and the machine. Every script that writes a result under
benchmarks/results/ puts `record()` into it; `tests/test_figure_sources.py` checks that each
committed JSON there has at least "command" and "commit"."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from typing import Any, Dict, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
# Results are written into the tree: their own changes do not make the code dirty.
RESULTS_DIR = os.path.join("benchmarks", "results")
# Environment variables that change what the library computes or compiles (recorded as set).
ENV_PREFIXES = ("DFLASH_", "XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64", "LIBTPU_INIT_ARGS")


def _git(*args: str) -> Optional[str]:
    try:
        r = subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=ROOT, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def command(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> str:
    """The command line as one would retype it from the repository root: `python SCRIPT ARGS`
    (`python -m PACKAGE ARGS` for a package's __main__.py), arguments shell-quoted; `prog`
    replaces what comes before the arguments."""
    argv = list(sys.argv if argv is None else argv)
    if prog is None:
        script = os.path.abspath(argv[0]) if argv and argv[0] else ""
        if os.path.basename(script) == "__main__.py" and script.startswith(ROOT + os.sep):
            rel = os.path.relpath(os.path.dirname(script), ROOT)
            prog = "python -m " + rel.replace(os.sep, ".")
        elif script.startswith(ROOT + os.sep):
            prog = "python " + os.path.relpath(script, ROOT)
        else:
            prog = "python " + (argv[0] if argv else "")
    return " ".join([prog] + [shlex.quote(a) for a in argv[1:]])


def machine() -> Dict[str, Any]:
    """Platform, CPU count, Python, and jax's version and devices when jax is imported."""
    out: Dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    jax = sys.modules.get("jax")
    if jax is not None:
        out["jax"] = jax.__version__
        try:
            devs = jax.devices()
            out["backend"] = jax.default_backend()
            out["devices"] = f"{len(devs)} x {devs[0].device_kind}"
        except RuntimeError:  # no backend could start: record what is known
            pass
    return out


def record(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> Dict[str, Any]:
    """{"command", "commit", "dirty", "date", "machine", "env"} for a result written now.
    commit: `git rev-parse HEAD` (None outside a git checkout); dirty: whether tracked files
    outside benchmarks/results/ differ from it (None when unknown); date: UTC, ISO 8601."""
    head = _git("rev-parse", "HEAD")
    status = _git(
        "status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){RESULTS_DIR}"
    )
    return {
        "command": command(argv, prog),
        "commit": head.strip() if head else None,
        "dirty": None if status is None else bool(status.strip()),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
    }
