"""Ctrl-C (SIGINT) and SIGTERM while a command-line run has nothing to save: one line on stderr
and an immediate exit, from the first instruction on.

Python turns SIGINT into `KeyboardInterrupt` only between bytecodes of the main thread. During
a long XLA compile the exception waits for the compile; raised inside JAX's tracing or module
imports it prints a traceback of their internals; and leaving the interpreter while XLA's
threads still run can end in a segmentation fault. `guard(line)` arms a watcher thread that the
signal wakes at once (through `signal.set_wakeup_fd`, written by the C-level handler even in the
middle of a compile): it writes `line` and leaves with `os._exit` (130 for SIGINT, 143 for
SIGTERM), running no Python cleanup, which is right while nothing was written. Once a run has
something to save, `release()` hands the signals back to the tool's own handling (infer.py's
file of finished batches, the trainer's checkpoint on signal). `raise_on_sigterm()` makes a
released SIGTERM raise `Terminated` (a KeyboardInterrupt) instead of killing the process, so
that what the tool does on Ctrl-C (keep the finished work, say how to resume) runs for both;
`exit_status()` is then 143. `at_immediate_exit(fn)` runs `fn` (e.g. removing a lock file)
before the watcher's immediate exit. `cli.run` arms the guard again once a tool's main has
ended, so a signal during the interpreter's shutdown (atexit handlers, JAX's teardown) is one
line too, never a KeyboardInterrupt traceback.

Standard library only: the tools call `guard` before importing JAX.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}

_state = {
    "line": None,
    "armed": False,
    "pipe": None,
    "installed": False,
    "old_fd": -1,
    "old": {},
    "terminated": False,
}
_lock = threading.Lock()
_exit_hooks: list = []


class Terminated(KeyboardInterrupt):
    """SIGTERM once released, in a tool that called `raise_on_sigterm`: handled where Ctrl-C is."""


def _raise_terminated(signum, frame):
    _state["terminated"] = True
    raise Terminated()


def raise_on_sigterm() -> None:
    """From `release()` on (now, when not armed), SIGTERM raises `Terminated` instead of its
    default action (the process killed at once: no line, nothing flushed or released)."""
    if threading.current_thread() is not threading.main_thread():
        return
    with _lock:
        if _state["installed"]:
            _state["old"][signal.SIGTERM] = _raise_terminated
            return
    signal.signal(signal.SIGTERM, _raise_terminated)


def exit_status() -> int:
    """The exit status of a run stopped by a released signal: 143 after SIGTERM, else 130."""
    return EXIT_CODES[signal.SIGTERM] if _state["terminated"] else EXIT_CODES[signal.SIGINT]


def at_immediate_exit(fn) -> None:
    """`fn()` runs (from the watcher thread) right before the guard's immediate exit."""
    if fn not in _exit_hooks:
        _exit_hooks.append(fn)


def _python_handler(signum, frame):
    """The Python-level handler while installed: nothing while armed (the watcher exits);
    released, what the signal did before `guard` (KeyboardInterrupt, or the default action)."""
    if _state["armed"]:
        # The watcher exits; should `release()` win the race for the lock first, it hands this
        # signal on to the released handlers instead of losing it.
        _state["pending"] = signum
        return
    old = _state["old"].get(signum, signal.SIG_DFL)
    if callable(old):
        return old(signum, frame)
    if old == signal.SIG_IGN:
        return None
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _watch(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 16)
        except OSError:
            return
        if not data:
            return
        with _lock:
            if not _state["armed"]:
                continue
            line = _state["line"]
        signum = data[-1]
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stdout must not stop the exit
            pass
        os.write(2, (line.rstrip("\n") + "\n").encode())
        for fn in list(_exit_hooks):
            try:
                fn()
            except Exception:  # noqa: BLE001 - the exit must happen
                pass
        os._exit(EXIT_CODES.get(signum, 130))


def guard(line: str) -> bool:
    """Arms (or re-words) the immediate exit on SIGINT / SIGTERM with `line`. Only from the main
    thread (elsewhere: False, nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        _state["line"] = line
        if _state["pipe"] is None:
            r, w = os.pipe()
            os.set_blocking(w, False)
            _state["pipe"] = (r, w)
            threading.Thread(target=_watch, args=(r,), name="interrupt-guard", daemon=True).start()
        if not _state["installed"]:
            for sig in EXIT_CODES:
                _state["old"][sig] = signal.signal(sig, _python_handler)
            _state["old_fd"] = signal.set_wakeup_fd(_state["pipe"][1], warn_on_full_buffer=False)
            _state["installed"] = True
        _state["armed"] = True
    return True


def armed() -> bool:
    return bool(_state["armed"])


def release(handlers: Optional[dict] = None) -> None:
    """From here on the signals do what they did before `guard` (or what the tool installed
    since), or what `handlers` ({signum: handler}) says: the run has something to save. A
    signal that came while armed but that the watcher had not acted on yet is delivered to
    them, not lost. A no-op when not armed."""
    with _lock:
        if not _state["armed"]:
            return
        _state["armed"] = False
    if threading.current_thread() is threading.main_thread() and _state["installed"]:
        for sig, old in _state["old"].items():
            if signal.getsignal(sig) is _python_handler:
                signal.signal(sig, old)
        for sig, handler in (handlers or {}).items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(_state["old_fd"])
        _state["installed"] = False
        pending = _state.pop("pending", None)
        if pending is not None:
            signal.raise_signal(pending)
