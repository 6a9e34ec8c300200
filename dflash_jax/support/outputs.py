"""Writing a tool's results whole: each file through a temporary file beside it and a rename
(a reader, or a run stopped half-way, sees the old file or the new one, never part of one), and
SIGINT / SIGTERM while a set of files is written deferred until every one of them is in place.

    from dflash_jax.support import interrupts, outputs
    interrupts.guard("interrupted: nothing was written")   # during the long work
    ...
    outputs.write_all({json_out: text, png: png_bytes})    # then one line and 130 / 143 if a
                                                           # signal came while they were written

Standard library only.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from typing import Mapping, Optional, Union

from dflash_jax.support import interrupts

Data = Union[str, bytes]


def _stage(path: str, data: Data) -> str:
    """A temporary file beside `path` holding `data`, with the mode `path` has (or a new
    file's); removed on any error."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):  # keep the permissions of the file it replaces
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_atomic(path, data: Data) -> str:
    """Writes `data` (text as UTF-8, or bytes) to `path` through a temporary file in the same
    directory and `os.replace`: `path` is the old file or the new one, whole, whatever happens.
    Returns the path."""
    return write_many({path: data})[0]


def write_many(files: Mapping) -> list:
    """Every (path, data) of `files` written as `write_atomic` does, all or none: each staged
    beside its path first (an error there removes them all and leaves every path as it was),
    then renamed into place. Returns the paths."""
    staged = []
    try:
        for path, data in files.items():
            staged.append((os.fspath(path), _stage(os.fspath(path), data)))
    except BaseException:
        for _, tmp in staged:
            _unlink(tmp)
        raise
    for path, tmp in staged:
        os.replace(tmp, path)
    return [path for path, _ in staged]


def write_all(files: Mapping, done: Optional[str] = None) -> list:
    """Writes every (path, data) of `files` with `write_many` (all or none), with SIGINT / SIGTERM
    held back until the last one is in place: a signal that came meanwhile then ends the run
    with one line on stderr, "interrupted: wrote <paths> (whole)", and exit status 130 / 143
    (`interrupts.EXIT_CODES`). Afterwards the signals end the process at once with `done`
    (default: the same line) through `interrupts.guard`. Main thread only. Returns the paths."""
    paths = [os.fspath(p) for p in files]
    line = f"interrupted: wrote {', '.join(paths)} (whole)"
    got = []

    def _record(signum, frame):
        got.append(signum)

    for sig in interrupts.EXIT_CODES:  # ours first: a signal before release still exits clean
        signal.signal(sig, _record)
    interrupts.release()  # the guard's watcher off (it keeps our handlers)
    try:
        write_many(files)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        interrupts.guard(done or line)
    if got:
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - a closed stdout must not stop the exit
            pass
        os.write(2, (line + "\n").encode())
        os._exit(interrupts.EXIT_CODES.get(got[0], 130))
    return paths


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def check_outputs(outputs: Mapping, inputs=(), create_dirs: bool = False) -> list:
    """Checks, before any compute, the files a run will write: `outputs` {what (a flag's name,
    e.g. "--json_out"): path or None (not written)}. Each must be writable (`checks.writable_file`;
    with `create_dirs`, a missing directory only needs a writable existing ancestor), no two the
    same file, and none one of `inputs` (paths the run reads: writing would lose them).
    ValueError, one line. Returns the paths written."""
    from dflash_jax.support import checks

    seen = {}
    for what, path in outputs.items():
        if path is None:
            continue
        path = os.fspath(path)
        parent = base = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(base) and os.path.dirname(base) != base:
            base = os.path.dirname(base)
        if not os.path.isdir(base):
            raise ValueError(f"{what} {path}: {base} is a file, not a directory")
        if create_dirs and not os.path.isdir(parent):
            if not os.access(base, os.W_OK | os.X_OK):
                raise ValueError(f"{what} {path}: directory {base} is not writable")
        else:
            checks.writable_file(path, what)
        for other, p in seen.items():
            if _same(p, path):
                raise ValueError(f"{what} and {other} are the same file {path}: give two")
        for p in inputs:
            if p is not None and os.path.exists(p) and _same(p, path):
                raise ValueError(f"{what} {path} is an input of this run: writing it would lose it")
        seen[what] = path
    return list(seen.values())
