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
import shutil
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


# ------------------------------------------------------------ setups for the outputs section

OLD = '{"old": "results the user keeps"}\n'


def _prompts_and_old(tmp):
    """A prompt file and an earlier --json_out that a failed run must leave as it is."""
    with open(os.path.join(tmp, "p.jsonl"), "w") as f:
        f.write('{"prompt": "def f(x):"}\n{"prompt": "import os"}\n')
    with open(os.path.join(tmp, "old.jsonl"), "w") as f:
        f.write(OLD)


def _target_copy(tmp, weights=True, generation_config=None):
    """{tmp}/target: the bundled target's files as links, config.json a copy; weights=False:
    model.safetensors is junk, so a check that runs only after loading names the weights."""
    _prompts_and_old(tmp)
    d = os.path.join(tmp, "target")
    os.makedirs(d, exist_ok=True)
    src = os.path.join(PAIR, "target")
    for name in os.listdir(src):
        if name == "config.json":
            shutil.copy(os.path.join(src, name), os.path.join(d, name))
        elif name != "model.safetensors" or weights:
            os.symlink(os.path.join(src, name), os.path.join(d, name))
    if not weights:
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(b"not weights")
    if generation_config is not None:
        with open(os.path.join(d, "generation_config.json"), "w") as f:
            f.write(generation_config)


def _file(name, text):
    def setup(tmp):
        _prompts_and_old(tmp)
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)

    return setup


def _junk_target(**kw):
    return lambda tmp: _target_copy(tmp, weights=False, **kw)


_LATE = [  # a prompt file, an earlier --json_out, a target whose weights cannot be read
    "infer.py",
    "--target={tmp}/target",
    "--drafter={pair}/drafter",
    "--prompt_file={tmp}/p.jsonl",
    "--json_out={tmp}/old.jsonl",
    "--max_new_tokens=2",
]
_PAIR_RUN = [
    "infer.py",
    "--target={pair}/target",
    "--prompt_file={tmp}/p.jsonl",
    "--max_new_tokens=2",
]
_KEEP = ("{tmp}/old.jsonl",)


# --------------------------------------------------------------------------------- the table
# Sections by area; each row is one defect that the probe found (or a rule that must hold).

CASES = [
    # ---- outputs and infer.py inputs
    # Checks that ran only after loading the models (and after the old --json_out was deleted)
    # run first: the target's weights are junk here, so a late check names them instead.
    Case(
        "late_denoise_steps_keeps_json_out",
        _LATE + ["--denoise_steps=16"],
        want_err=r"denoise_steps must be in \[1, 15\]",
        setup=_junk_target(),
        unchanged=_KEEP,
    ),
    Case(
        "late_context_length_keeps_json_out",
        _LATE + ["--max_new_tokens=5000"],
        want_err=r"context length max_position_embeddings=4096",
        setup=_junk_target(),
        unchanged=_KEEP,
    ),
    Case(
        "late_stop_id_keeps_json_out",
        _LATE,
        want_err=r"stop_token_ids .*99999",
        setup=_junk_target(generation_config='{"eos_token_id": 99999}'),
        unchanged=_KEEP,
    ),
    Case(
        "late_attention_impl_keeps_json_out",
        _LATE + ["--attention_impl=pallas"],  # no Pallas kernel on a CPU
        want_err=r"pallas",
        setup=_junk_target(),
        unchanged=_KEEP,
    ),
    Case(
        "late_unknown_attention_impl",
        _LATE + ["--attention_impl=flash"],
        want_err=r"--attention_impl must be one of",
        setup=_junk_target(),
        unchanged=_KEEP,
    ),
    Case(
        "late_seed_beyond_int64",
        _LATE + ["--seed=9223372036854775808"],
        want_err=r"--seed must be in \[-9223372036854775808, 9223372036854775807\]",
        setup=_junk_target(),
        unchanged=_KEEP,
    ),
    # An output that resolves to an input is refused (the prompt file, a model file).
    Case(
        "json_out_is_the_prompt_file",
        _PAIR_RUN + ["--json_out={tmp}/sub/../p.jsonl"],
        want_err=r"--json_out .* is the --prompt_file",
        setup=lambda tmp: (_prompts_and_old(tmp), os.makedirs(os.path.join(tmp, "sub"))),
        unchanged=("{tmp}/p.jsonl",),
    ),
    Case(
        "json_out_is_a_model_file",
        _LATE[:1] + ["--target={tmp}/target", "--json_out={tmp}/target/config.json"],
        want_err=r"--json_out .* is a file of the --target",
        setup=_target_copy,
        unchanged=("{tmp}/target/config.json",),
    ),
    Case(
        "json_out_links_to_a_model_file",
        _LATE[:1] + ["--target={tmp}/target", "--json_out={tmp}/alias.json"],
        want_err=r"--json_out .* is a file of the --target",
        setup=lambda tmp: (
            _target_copy(tmp),
            os.symlink(os.path.join(tmp, "target", "config.json"), os.path.join(tmp, "alias.json")),
        ),
        unchanged=("{tmp}/target/config.json",),
    ),
    # --resume changes nothing in a file it does not recognise as its own record file.
    Case(
        "resume_one_json_line_without_newline",
        _PAIR_RUN + ["--json_out={tmp}/r.json", "--resume"],
        want_err=r"r\.json:1: not a record of this tool",
        setup=_file("r.json", '{"a": 1}'),
        unchanged=("{tmp}/r.json",),
    ),
    Case(
        "resume_text_file",
        _PAIR_RUN + ["--json_out={tmp}/notes.txt", "--resume"],
        want_err=r"notes\.txt:1: not a record of this tool",
        setup=_file("notes.txt", "my notes\nthe last line"),
        unchanged=("{tmp}/notes.txt",),
    ),
    Case(
        "prompt_and_prompt_file",
        _PAIR_RUN + ["--prompt=def g():"],
        want_err=r"--prompt and --prompt_file",
        setup=_prompts_and_old,
    ),
    # ---- model directories: config.json, generation_config.json, chat templates
    # ---- train.py, the dry run, the launcher, eval_tau
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
