"""Start N local JAX processes that form one process group (a pod slice in miniature).

    python -m dflash_jax.launch --num_processes=2 --devices_per_process=4 -- \
        train.py --config=configs/tiny_test.py --workdir=/tmp/run --config.mesh=data=2,fsdp=4

Every process gets the environment `dflash_jax.parallel.distributed.initialize` reads
(DFLASH_COORDINATOR_ADDRESS=127.0.0.1:<free port>, DFLASH_NUM_PROCESSES, DFLASH_PROCESS_ID), so
the CLIs call `jax.distributed.initialize(coordinator_address, num_processes, process_id)`;
with `--devices_per_process=D` it is a CPU process with D fake devices
(XLA_FLAGS=--xla_force_host_platform_device_count=D, JAX_PLATFORMS=cpu, gloo collectives).
The command after `--` is a Python script (`x.py ...`), a module (`-m pkg.mod ...`), `-c CODE`,
or any executable.

Output lines are prefixed with `[i]`, the process index. The launcher exits 0 when every process
does; when one fails it names it, stops the others (SIGTERM, then SIGKILL after --grace
seconds: a peer of a dead process may be blocked in a collective) and exits with its code; past
--timeout seconds (> 0) it stops them all and exits 124. A command that does not exist, or a
bad flag, is one line `... error: ...` and exit 2 before any process starts. SIGTERM/SIGINT to the launcher is passed on
to the processes (the trainer then saves a checkpoint, coordinated across processes).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence

ENV_ADDRESS = "DFLASH_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "DFLASH_NUM_PROCESSES"
ENV_PROCESS_ID = "DFLASH_PROCESS_ID"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_command(command: Sequence[str]) -> List[str]:
    """Scripts, `-m module` and `-c code` run under this Python; anything else as given."""
    command = list(command)
    if command[0].endswith(".py") or command[0] in ("-m", "-c"):
        return [sys.executable] + command
    return command


def missing_command(command: Sequence[str]) -> Optional[str]:
    """Why `command` cannot start (a script or executable that does not exist), or None."""
    head = command[0]
    if head in ("-m", "-c"):
        return None if len(command) > 1 else f"{head} needs an argument"
    if head.endswith(".py"):
        return None if os.path.isfile(head) else f"no such script: {head}"
    if os.sep in head:
        if not os.path.isfile(head):
            return f"no such file: {head}"
        return None if os.access(head, os.X_OK) else f"not executable: {head}"
    return None if shutil.which(head) else f"command not found: {head}"


def child_env(
    base: dict, process_id: int, num_processes: int, address: str, devices_per_process: int
) -> dict:
    env = dict(base, PYTHONUNBUFFERED="1")
    env.update(
        {
            ENV_ADDRESS: address,
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(process_id),
            # The coordinator (process 0) listens on loopback only.
            "JAX_COORDINATOR_BIND_ADDRESS": address,
        }
    )
    if devices_per_process > 0:
        flags = re.sub(
            r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")
        ).strip()
        env["XLA_FLAGS"] = (
            flags + " " if flags else ""
        ) + f"--xla_force_host_platform_device_count={devices_per_process}"
        env["JAX_PLATFORMS"] = "cpu"
    return env


_GLOO_CHATTER = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


class _Group:
    def __init__(self, procs: List[subprocess.Popen], out):
        self.procs = procs
        self.out = out
        self.lock = threading.Lock()
        self.readers = [
            threading.Thread(target=self._pump, args=(i, p), daemon=True)
            for i, p in enumerate(procs)
        ]
        for t in self.readers:
            t.start()

    def _pump(self, i: int, proc: subprocess.Popen):
        for line in iter(proc.stdout.readline, b""):
            text = line.decode("utf-8", "replace").rstrip("\n")
            if _GLOO_CHATTER.match(text):  # one line per device and communicator: noise
                continue
            with self.lock:
                self.out.write(f"[{i}] {text}\n")
                self.out.flush()

    def say(self, msg: str):
        with self.lock:
            self.out.write(f"[launch] {msg}\n")
            self.out.flush()

    def signal_all(self, sig, only_running=True):
        for p in self.procs:
            if p.poll() is None or not only_running:
                try:
                    os.killpg(p.pid, sig)  # the child and anything it started
                except (ProcessLookupError, PermissionError):
                    pass

    def stop(self, grace: float):
        """SIGTERM the running processes; SIGKILL what is left after `grace` seconds."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        if any(p.poll() is None for p in self.procs):
            self.say(f"still running after {grace:g}s: SIGKILL")
            self.signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def join_output(self):
        for t in self.readers:
            t.join(timeout=5)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(
    command: Sequence[str],
    num_processes: int = 2,
    devices_per_process: int = 0,
    timeout: Optional[float] = None,
    grace: float = 10.0,
    port: int = 0,
    out=None,
) -> int:
    """Runs `command` as `num_processes` processes of one JAX process group; returns the exit
    code the launcher exits with (0, the first failing process's code, or 124 on timeout)."""
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if not command:
        raise ValueError("no command to launch (put it after `--`)")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds (None: no limit), got {timeout}")
    why = missing_command(command)
    if why is not None:
        raise ValueError(why)
    out = sys.stdout if out is None else out
    address = f"127.0.0.1:{port or free_port()}"
    cmd = child_command(command)
    procs = []
    for i in range(num_processes):
        procs.append(
            subprocess.Popen(
                cmd,
                env=child_env(os.environ, i, num_processes, address, devices_per_process),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    group = _Group(procs, out)
    group.say(
        f"{num_processes} process(es)"
        + (f" x {devices_per_process} CPU devices" if devices_per_process else "")
        + f", coordinator {address}, pids "
        + " ".join(str(p.pid) for p in procs)
    )

    forwarded = []

    def forward(signum, frame):
        del frame
        forwarded.append(signum)
        if len(forwarded) > 1:  # a second signal: do not wait for a clean stop
            group.signal_all(signal.SIGKILL)
        else:
            group.say(f"received {signal.Signals(signum).name}: passing it on")
            group.signal_all(signal.SIGTERM)

    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            old[sig] = signal.signal(sig, forward)
    start = time.monotonic()
    code = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, c = failed[0]
                group.say(f"process {i} {_describe(c)}; stopping the others")
                group.stop(grace)
                code = c if c > 0 else 128 - c
                break
            if all(c == 0 for c in codes):
                break
            if timeout and time.monotonic() - start > timeout:
                group.say(f"timeout: still running after {timeout:g}s; stopping all processes")
                group.stop(grace)
                code = 124
                break
            time.sleep(0.05)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        if any(p.poll() is None for p in procs):
            group.stop(0)
        group.join_output()
    if code == 0:
        group.say(f"all {num_processes} process(es) finished in {time.monotonic() - start:.1f}s")
    return code


class _Parser(argparse.ArgumentParser):
    """argparse with the tools' error convention: one line `error: ...`, exit 2."""

    def error(self, message):
        sys.stderr.write(f"error: {message} (see python -m dflash_jax.launch --help)\n")
        sys.exit(2)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1 :]
    else:
        own, command = argv, []
    p = _Parser(
        prog="python -m dflash_jax.launch",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--num_processes", type=int, default=2)
    p.add_argument(
        "--devices_per_process",
        type=int,
        default=0,
        help="> 0: CPU processes with this many fake devices each",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds for the whole group (> 0; default: no limit); then exit 124",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping processes",
    )
    p.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    args = p.parse_args(own)
    if not command:
        p.error("give the command to run after `--`, e.g. -- train.py --config=...")
    if args.num_processes < 1 or args.devices_per_process < 0:
        p.error("--num_processes must be >= 1 and --devices_per_process >= 0")
    if args.timeout is not None and not (args.timeout > 0 and math.isfinite(args.timeout)):
        p.error(
            f"--timeout must be a number of seconds > 0 (omit it for no limit), got {args.timeout:g}"
        )
    if args.grace < 0 or not math.isfinite(args.grace):
        p.error(f"--grace must be a number of seconds >= 0, got {args.grace:g}")
    why = missing_command(command)
    if why is not None:  # before any process starts
        p.error(why)
    return launch(
        command,
        args.num_processes,
        args.devices_per_process,
        args.timeout,
        args.grace,
        args.port,
    )


if __name__ == "__main__":
    sys.exit(main())
