"""The CLI probe: bad inputs and faults a new user meets, as a table run against the real
command-line tools (`infer.py`, `train.py`, `python -m dflash_jax.dry_run`,
`python -m dflash_jax.launch`, `benchmarks/eval_tau.py`), each case in its own subprocess.

Every case states what must happen: exit status, the one `error: ...` line on stderr (a regular
expression), no traceback, and, where the case involves files the user gave, that their bytes
are unchanged afterwards. New defects of this kind get a row here.

Cases run concurrently (two at a time) to keep the suite's time; each must fail fast, before a
model is compiled (that is the rule being probed: bad input is refused before any compute).

A row: Case(name, argv, want_rc, want_err, setup=None, env=None, unchanged=(), cwd=ROOT)
  argv      the command after the interpreter, e.g. ["infer.py", "--seed=1e30"]; "{tmp}" is the
            case's scratch directory, "{pair}" the bundled pair's target directory
  want_rc   the exit status (2 for bad input)
  want_err  a regular expression the stderr's `error:` line must match (None: any stderr)
  setup     fn(tmp) run before the case (writes the files it needs)
  unchanged file paths (with "{tmp}") whose bytes must be the same after the run
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
from typing import Callable, Dict, Optional, Sequence

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = os.path.join(ROOT, "assets", "tiny-code")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    argv: Sequence[str]
    want_rc: int = 2
    want_err: Optional[str] = None
    setup: Optional[Callable[[str], None]] = None
    env: Optional[Dict[str, str]] = None
    unchanged: Sequence[str] = ()
    timeout: float = 120.0


def _fill(s: str, tmp: str) -> str:
    return s.replace("{tmp}", tmp).replace("{pair}", PAIR)


def run_case(case: Case, tmp: str):
    os.makedirs(tmp, exist_ok=True)
    if case.setup is not None:
        case.setup(tmp)
    before = {}
    for p in case.unchanged:
        p = _fill(p, tmp)
        before[p] = open(p, "rb").read() if os.path.exists(p) else None
    env = dict(os.environ, JAX_PLATFORMS="cpu", NO_COLOR="1")
    env.update({k: _fill(v, tmp) for k, v in (case.env or {}).items()})
    proc = subprocess.run(
        [sys.executable] + [_fill(a, tmp) for a in case.argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=case.timeout,
        stdin=subprocess.DEVNULL,
    )
    after = {p: (open(p, "rb").read() if os.path.exists(p) else None) for p in before}
    return proc, before, after


def check(case: Case, proc, before, after):
    """The list of what is wrong with one case's run (empty: it holds)."""
    wrong = []
    err = proc.stderr
    if proc.returncode != case.want_rc:
        wrong.append(f"exit {proc.returncode}, want {case.want_rc}")
    if "Traceback (most recent call last)" in err:
        wrong.append("traceback on stderr")
    if case.want_rc == 2:
        lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        if len(lines) != 1:
            wrong.append(f"{len(lines)} 'error:' lines, want 1")
        elif case.want_err and not re.search(case.want_err, lines[0]):
            wrong.append(f"error line {lines[0]!r} does not match {case.want_err!r}")
    elif case.want_err and not re.search(case.want_err, err + proc.stdout):
        wrong.append(f"output does not match {case.want_err!r}")
    for p in before:
        if before[p] != after[p]:
            wrong.append(f"{p} changed")
    return wrong


# --------------------------------------------------------------------------------- the table
# Sections by area; each row is one defect that the probe found (or a rule that must hold).

CASES = [
    # ---- outputs and infer.py inputs
    # ---- model directories: config.json, generation_config.json, chat templates
    # ---- train.py, the dry run, the launcher, eval_tau
    # train.py: bad input found before anything runs or is written (no train.log, no
    # regenerated.jsonl: regeneration takes hours on an 8B target).
    *[
        Case(
            name,
            ["train.py", "--config=configs/tiny_test.py", "--workdir={tmp}/w", *args],
            want_err=err,
            unchanged=("{tmp}/w/train.log", "{tmp}/w/regenerated.jsonl"),
        )
        for name, args, err in [
            (
                "train_mesh_does_not_fit",
                ["--config.mesh=fsdp=3"],
                r"config\.mesh 'fsdp=3' does not fit",
            ),
            (
                "train_taps_beyond_target_layers",
                ["--config.drafter.target_layer_ids=(0,5)"],
                r"drafter\.target_layer_ids \[0, 5\].*has 2 layers",
            ),
            ("train_mesh_size_not_int", ["--config.mesh=data=x"], r"config\.mesh.*'data'.*'x'"),
            (
                "train_profile_steps_one_number",
                ["--profile_steps=5"],
                r"--profile_steps must be START:COUNT",
            ),
            (
                "train_missing_data_file",
                ["--config.data.kind=files", "--config.data.paths=('{tmp}/nope.txt',)"],
                r"nope\.txt: the data file named by config\.data\.paths does not exist",
            ),
        ]
    ],
    Case(
        "train_workdir_under_proc",
        ["train.py", "--config=configs/tiny_test.py", "--workdir=/proc/dflash-probe/w"],
        want_err=r"cannot create the workdir /proc/dflash-probe/w",
    ),
    Case(
        "train_jax_platforms_tpu_without_one",
        ["train.py", "--config=configs/tiny_test.py", "--workdir={tmp}/w"],
        want_err=r"JAX_PLATFORMS='tpu'.*Unable to initialize backend",
        env={"JAX_PLATFORMS": "tpu"},
        unchanged=("{tmp}/w/train.log",),
    ),
    Case(
        "infer_jax_platforms_tpu_without_one",
        ["infer.py", "--max_new_tokens=2"],
        want_err=r"JAX_PLATFORMS='tpu'.*Unable to initialize backend",
        env={"JAX_PLATFORMS": "tpu"},
    ),
    # The dry run: topologies and sizes refused in one line before any compile.
    *[
        Case(name, ["-m", "dflash_jax.dry_run", *args], want_err=err)
        for name, args, err in [
            ("dry_run_topology_cpu_abc", ["--topology=cpu:abc"], r"cpu:N wants a number"),
            ("dry_run_topology_cpu_0", ["--topology=cpu:0"], r"cpu:N wants a number"),
            (
                "dry_run_context_0",
                ["--topology=cpu:2", "--model=small", "--context=0"],
                r"--context must be >= 1",
            ),
            (
                "dry_run_batch_0",
                ["--topology=cpu:2", "--model=small", "--batch=0"],
                r"--batch must be >= 1",
            ),
            (
                "dry_run_tau_nan",
                ["--topology=cpu:2", "--model=small", "--tau=nan"],
                r"--tau .*'nan'",
            ),
            (
                "dry_run_tau_negative",
                ["--topology=cpu:2", "--model=small", "--tau=-3"],
                r"--tau .*'-3'",
            ),
        ]
    ],
    *[
        Case(
            name,
            ["infer.py", "--dry_run", "--topology=cpu:2", "--dry_run_model=small", arg],
            want_err=err,
        )
        for name, arg, err in [
            (
                "infer_dry_run_block_size_0",
                "--block_size=0",
                r"--block_size must be in \[2, 64\], got 0",
            ),
            ("infer_dry_run_batch_size_0", "--batch_size=0", r"--batch_size must be >= 1, got 0"),
        ]
    ],
    # The launcher: refused before any process starts.
    Case(
        "launch_command_not_found",
        ["-m", "dflash_jax.launch", "--num_processes=1", "--", "dflash-no-such-command"],
        want_err=r"command not found: dflash-no-such-command",
    ),
    Case(
        "launch_negative_timeout",
        ["-m", "dflash_jax.launch", "--num_processes=1", "--timeout=-5", "--", "-c", "pass"],
        want_err=r"--timeout must be .*> 0",
    ),
    Case(
        "eval_tau_empty_datasets",
        [
            "benchmarks/eval_tau.py",
            "--target={pair}/target",
            "--drafter={pair}/drafter",
            "--datasets=",
        ],
        want_err=r"--datasets is empty",
    ),
]


def _run_all(cases, base):
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futs = {c.name: pool.submit(run_case, c, os.path.join(base, c.name)) for c in cases}
        return {name: f.result() for name, f in futs.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    names = [c.name for c in CASES]
    assert len(set(names)) == len(names), "case names must be unique"
    return _run_all(CASES, str(tmp_path_factory.mktemp("probe")))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_probe_case(case, results):
    proc, before, after = results[case.name]
    wrong = check(case, proc, before, after)
    assert not wrong, f"{case.name}: {'; '.join(wrong)}\nstderr:\n{proc.stderr[-3000:]}"


def test_the_checker_rejects_a_traceback_and_a_changed_file(tmp_path):
    """A control: the checker itself fails a run with a traceback, the wrong exit status, two
    error lines or a changed file."""
    p = str(tmp_path / "f")
    open(p, "w").write("old")
    case = Case("control", ["-c", f"open({p!r}, 'w').write('new'); raise SystemExit(1)"])
    proc, before, after = run_case(dataclasses.replace(case, unchanged=(p,)), str(tmp_path / "c"))
    wrong = check(dataclasses.replace(case, unchanged=(p,)), proc, before, after)
    assert any("exit 1" in w for w in wrong) and any("changed" in w for w in wrong)
    crash = Case("crash", ["-c", "raise RuntimeError('x')"], want_rc=1)
    proc, before, after = run_case(crash, str(tmp_path / "d"))
    assert check(crash, proc, before, after) == ["traceback on stderr"]
