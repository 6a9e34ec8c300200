"""One writer per output: an advisory lock beside what a command-line run writes, taken after its
flags are checked and before any model loads.

    locks.acquire("out.jsonl", "--json_out")                    # out.jsonl.lock
    locks.acquire("/tmp/run", "--workdir", directory=True)      # /tmp/run/.lock
    ...                                                         # the run
    locks.release_all()         # cli.run does it; so do atexit and the interrupt guard's exit

Two runs on one output lose work: two infer.py runs on one --json_out each replace the file
with their own, so one run's lines vanish although it reported them; two train.py runs on one
workdir race on its checkpoints and metrics. The second run is refused instead: `LockHeld` (a
ValueError, so the CLIs print one `error:` line and exit 2) naming the run that holds the lock
(its pid and host, from the lock file).

The lock is `fcntl.flock` on the lock file, which records {"pid", "host", "started", "argv"}.
The kernel drops a flock when its process ends, however it ends (a crash, SIGKILL), so a lock
file that a dead run left behind is free: the next run takes it over with a note naming the
run that left it. Releasing removes the lock file (and a directory `acquire` created, when it
is left empty). Under `python -m dflash_jax.launch` only process 0 takes the lock (the others
write nothing); a multi-process run of another launcher takes it on its primary process.

Standard library only: the CLIs take the lock before importing JAX.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import socket
import sys
import threading
import time
from typing import List, Optional

# `dflash_jax.parallel.launch.ENV_PROCESS_ID` (not imported: that package imports JAX; a test
# checks the two agree).
ENV_PROCESS_ID = "DFLASH_PROCESS_ID"
DIR_LOCK = ".lock"


class LockHeld(ValueError):
    """Another run holds the output's lock (one line naming it)."""


def _name_max(folder: str) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def lock_path(output: str, directory: bool = False) -> str:
    """Where `output`'s lock lives: DIR/.lock for a directory; FILE.lock beside a file (of the
    file a symbolic link names; a hashed hidden name when FILE.lock would be too long)."""
    real = os.path.realpath(output)
    if directory:
        return os.path.join(real, DIR_LOCK)
    folder, name = os.path.split(real)
    lock = name + ".lock"
    if len(os.fsencode(lock)) > _name_max(folder if os.path.isdir(folder) else "/"):
        lock = "." + hashlib.sha1(os.fsencode(name)).hexdigest()[:16] + ".lock"
    return os.path.join(folder, lock)


def _describe(info: dict) -> str:
    who = f"pid {info.get('pid', '?')} on {info.get('host', '?')}"
    started = info.get("started")
    if isinstance(started, (int, float)):
        who += time.strftime(", started %Y-%m-%d %H:%M:%S", time.localtime(started))
    return who


def _read(fd: int) -> dict:
    try:
        data = os.pread(fd, 65536, 0)
        info = json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


class Lock:
    """A held lock (`acquire`); `release()` is idempotent and thread-safe."""

    def __init__(self, path: str, fd: int, created: List[str], what: str, output: str):
        self.path, self.fd, self.created = path, fd, created
        self.what, self.output = what, output
        self._mutex = threading.Lock()

    def release(self) -> None:
        with self._mutex:
            if self.fd is None:
                return
            fd, self.fd = self.fd, None
            try:  # only the file this lock holds (never one a later run created)
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    os.unlink(self.path)
            except OSError:
                pass
            os.close(fd)
            _remove_dirs(self.created)  # what acquire created, when left empty
        if self in _held:
            _held.remove(self)


_held: List[Lock] = []
_hooks = {"installed": False}


def release_all() -> None:
    """Releases every lock this process holds (at exit, or when a CLI's main ends)."""
    for lock in list(_held):
        lock.release()


def _install_hooks() -> None:
    if _hooks["installed"]:
        return
    _hooks["installed"] = True
    atexit.register(release_all)
    from dflash_jax.support import interrupts

    interrupts.at_immediate_exit(release_all)  # Ctrl-C / SIGTERM while nothing was written


def _remove_dirs(created: List[str]) -> None:
    """Removes the directories `_make_dirs` created (outermost first), innermost first, while
    they are empty."""
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            break


def _make_dirs(path: str, what: str) -> List[str]:
    """Creates `path` and its missing parents; the directories created, outermost first."""
    missing = []
    p = path
    while not os.path.exists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    created = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            continue
        except OSError as e:
            _remove_dirs(created)
            raise ValueError(f"cannot create the {what} {path}: {e.strerror or e}") from None
        created.append(d)
    return created


def secondary_launch_process() -> bool:
    """A process other than the first of `python -m dflash_jax.launch` (it writes nothing)."""
    return os.environ.get(ENV_PROCESS_ID, "0").strip() not in ("", "0")


def acquire(output: str, what: str, *, directory: bool = False) -> Optional[Lock]:
    """Takes `output`'s lock for this process (`lock_path`), or raises `LockHeld` (one line
    naming the holder's pid and host). `what`: the flag or name the message uses. A directory
    output is created (and removed at release when this left it empty). Released at exit (normal,
    error, or the interrupt guard's immediate exit) or by `Lock.release` / `release_all`.
    None (no lock) in a secondary launch process."""
    if secondary_launch_process():
        return None
    path = lock_path(output, directory)
    created = _make_dirs(os.path.dirname(path), what) if directory else []
    for _ in range(20):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            _remove_dirs(created)
            raise ValueError(
                f"{what} {output}: cannot create its lock file {path} ({e.strerror or e})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            info = _read(fd)
            for _ in range(10):  # the holder writes its name right after taking the lock
                if info.get("pid"):
                    break
                time.sleep(0.05)
                info = _read(fd)
            os.close(fd)
            raise LockHeld(
                f"{what} {output} is in use by another run ({_describe(info)}; lock file "
                f"{path}): wait for it to end or choose another {what}"
            ) from None
        try:  # released (and its file removed) between our open and our flock: try again
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except OSError:
            same = False
        if same:
            break
        os.close(fd)
    else:
        raise LockHeld(f"{what} {output}: its lock file {path} keeps changing; try again")
    left = _read(fd)
    if left.get("pid"):
        sys.stderr.write(
            f"note: {what} {output}: taking over the lock left by a run that ended without "
            f"releasing it ({_describe(left)})\n"
        )
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "argv": sys.argv,
    }
    data = (json.dumps(info) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    lock = Lock(path, fd, created, what, output)
    _held.append(lock)
    _install_hooks()
    return lock
