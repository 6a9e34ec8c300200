"""The CLI probe: bad inputs and faults a new user meets, as a table run against the real
command-line tools (`infer.py`, `train.py`, `python -m dflash_jax.dry_run`,
`python -m dflash_jax.launch`, `benchmarks/eval_tau.py`), each case in its own subprocess.

Every case states what must happen: exit status, the one `error: ...` line on stderr (a regular
expression), no traceback, and, where the case involves files the user gave, that their bytes
are unchanged afterwards. New defects of this kind get a row here.

Cases run two at a time, each in a child forked from one interpreter that imported jax and
the library once (`tests/_probe_zygote.py`: importing jax was most of a refused case's time),
cases that set environment variables in their own interpreter; each must fail fast, before a
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

# Dozens of CLI subprocesses: `make test`, not `make test-fast`. Every case is refused in
# argument checking, before jax computes anything: once, in the oldest jax's suite.
pytestmark = [pytest.mark.slow, pytest.mark.once]

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
    quiet: bool = False  # stderr is the error line alone (no log line before it)


def _fill(s: str, tmp: str) -> str:
    return s.replace("{tmp}", tmp).replace("{pair}", PAIR)


def _prepare(case: Case, tmp: str):
    """Runs the case's setup in tmp; the bytes of its `unchanged` files before the run."""
    os.makedirs(tmp, exist_ok=True)
    if case.setup is not None:
        case.setup(tmp)
    return {
        p: (open(p, "rb").read() if os.path.exists(p) else None)
        for p in (_fill(p, tmp) for p in case.unchanged)
    }


def _after(before):
    return {p: (open(p, "rb").read() if os.path.exists(p) else None) for p in before}


def _base_env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", NO_COLOR="1")
    # The caller's device count (XLA_FLAGS forcing 8 host devices) must not change a case.
    env.pop("XLA_FLAGS", None)
    return env


def run_case(case: Case, tmp: str):
    """The case in its own interpreter: (CompletedProcess, bytes before, bytes after)."""
    before = _prepare(case, tmp)
    env = _base_env()
    env.update({k: _fill(v, tmp) for k, v in (case.env or {}).items() if v is not None})
    for k in [k for k, v in (case.env or {}).items() if v is None]:  # None: unset
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable] + [_fill(a, tmp) for a in case.argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=case.timeout,
        stdin=subprocess.DEVNULL,
    )
    return proc, before, _after(before)


def run_forked(cases: Sequence[Case], base: str):
    """Cases without their own environment through tests/_probe_zygote.py (jax and the library
    imported once, each case in a child forked from there, two at a time): {name: (
    CompletedProcess, bytes before, bytes after)}, as `run_case` gives."""
    import json

    befores, jobs = {}, []
    for c in cases:
        tmp = os.path.join(base, c.name)
        befores[c.name] = _prepare(c, tmp)
        jobs.append({"argv": [_fill(a, tmp) for a in c.argv], "dir": tmp, "timeout": c.timeout})
    path = os.path.join(base, "jobs.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    zygote = os.path.join(ROOT, "tests", "_probe_zygote.py")
    subprocess.run(
        [sys.executable, zygote, path],
        cwd=ROOT,
        env=_base_env(),
        check=True,
        timeout=60 + sum(c.timeout for c in cases),
        stdin=subprocess.DEVNULL,
    )
    out = {}
    for c, job in zip(cases, jobs):

        def read(name, d=job["dir"]):
            with open(os.path.join(d, name)) as f:
                return f.read()

        proc = subprocess.CompletedProcess(c.argv, int(read("rc")), read("stdout"), read("stderr"))
        out[c.name] = (proc, befores[c.name], _after(befores[c.name]))
    return out


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
        if case.quiet and err.strip().splitlines() != lines:
            wrong.append(f"stderr has more than the error line: {err[:300]!r}")
    elif case.want_err and not re.search(case.want_err, err + proc.stdout):
        wrong.append(f"output does not match {case.want_err!r}")
    for p in before:
        if before[p] != after[p]:
            wrong.append(f"{p} changed")
    return wrong


# -------------------------------------------------------------- setups: corrupted model dirs


def _copy_model(tmp: str, which: str = "target", edit=None, files=None) -> str:
    """The bundled pair's `which` directory copied into tmp (the weights linked, not copied),
    then `edit(config_dict)` applied to its config.json and `files` ({name: text}) written."""
    import json
    import shutil

    src, dst = os.path.join(PAIR, which), os.path.join(tmp, which)
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
        else:
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    if edit is not None:
        path = os.path.join(dst, "config.json")
        cfg = json.load(open(path))
        cfg = edit(cfg) or cfg
        json.dump(cfg, open(path, "w"))
    for name, text in (files or {}).items():
        with open(os.path.join(dst, name), "w") as f:
            f.write(text)
    return dst


def _with_template(template: str):
    """A setup: the bundled target with `template` as its chat template."""
    import json

    def setup(tmp):
        cfg = json.load(open(os.path.join(PAIR, "target", "tokenizer_config.json")))
        cfg["chat_template"] = template
        _copy_model(tmp, files={"tokenizer_config.json": json.dumps(cfg)})

    return setup


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


def _set(**fields):
    return lambda cfg: {**cfg, **fields}


def _set_drafter(**fields):
    return lambda cfg: {**cfg, **fields, "dflash_config": {**cfg["dflash_config"], **fields}}


_T = ["infer.py", "--target={tmp}/target", "--max_new_tokens=2"]
_TD = _T + ["--drafter={tmp}/drafter"]


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
    Case(  # a prompt too long for the context is named by its file and line, not its index
        "prompt_file_too_long_names_the_line",
        _PAIR_RUN,
        want_err=r"p\.jsonl:2: \d+ prompt tokens \+ max_new_tokens 2 exceed",
        setup=_file("p.jsonl", '{"prompt": "hi"}\n{"prompt": "' + "word " * 6000 + '"}\n'),
    ),
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
    Case(
        "target-config-json-list",
        _T,
        want_err=r"target/config\.json: expected a JSON object, got list",
        setup=lambda t: _copy_model(t, files={"config.json": "[1, 2]"}),
    ),
    Case(
        "target-config-zero-heads",
        _T,
        want_err=r"config\.json: num_attention_heads must be >= 1, got 0",
        setup=lambda t: _copy_model(t, edit=_set(num_attention_heads=0)),
    ),
    Case(
        "target-config-heads-not-multiple-of-kv-heads",
        _T,
        want_err=r"config\.json: num_attention_heads=4 is not a multiple of num_key_value_heads=3",
        setup=lambda t: _copy_model(t, edit=_set(num_key_value_heads=3)),
    ),
    Case(
        "target-config-string-layers",
        _T,
        want_err=r"config\.json: num_hidden_layers must be an integer, got '6'",
        setup=lambda t: _copy_model(t, edit=_set(num_hidden_layers="6")),
    ),
    Case(
        "target-config-negative-vocab",
        _T,
        want_err=r"config\.json: vocab_size must be >= 1, got -5",
        setup=lambda t: _copy_model(t, edit=_set(vocab_size=-5)),
    ),
    Case(
        "target-config-string-bool",
        _T,
        want_err=r"config\.json: tie_word_embeddings must be true or false, got 'false'",
        setup=lambda t: _copy_model(t, edit=_set(tie_word_embeddings="false")),
    ),
    Case(
        "generation-config-json-list",
        _T,
        want_err=r"generation_config\.json: expected a JSON object, got list",
        setup=lambda t: _copy_model(t, files={"generation_config.json": "[0]"}),
    ),
    Case(
        "generation-config-string-eos",
        _T,
        want_err=r"generation_config\.json: eos_token_id must be a token id",
        setup=lambda t: _copy_model(t, files={"generation_config.json": '{"eos_token_id": "0"}'}),
    ),
    Case(
        "generation-config-truncated",
        _T,
        want_err=r"target/generation_config\.json: not valid JSON",
        setup=lambda t: _copy_model(t, files={"generation_config.json": '{"eos_token_id": '}),
    ),
    Case(
        "drafter-config-zero-block-size",
        _TD,
        want_err=r"drafter/config\.json: dflash_config\.block_size must be >= 2, got 0",
        setup=lambda t: (_copy_model(t), _copy_model(t, "drafter", _set_drafter(block_size=0))),
    ),
    Case(
        "drafter-config-string-layer-ids",
        _TD,
        want_err=r"drafter/config\.json: dflash_config\.target_layer_ids must be a non-empty",
        setup=lambda t: (
            _copy_model(t),
            _copy_model(t, "drafter", _set_drafter(target_layer_ids="1,2,3")),
        ),
    ),
    Case(
        "tokenizer-config-json-list",
        _T,
        want_err=r"tokenizer_config\.json: expected a JSON object, got list",
        setup=lambda t: _copy_model(t, files={"tokenizer_config.json": "[]"}),
    ),
    Case(
        "chat-template-nested-loops-end-within-the-bound",
        _T,
        want_err=r"target/tokenizer_config\.json: refused to render: rendering took more than 2 s",
        setup=_with_template(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        ),
        env={"DFLASH_TEMPLATE_TIME_LIMIT": "2"},
        timeout=60.0,
    ),
    Case(
        "chat-template-range-beyond-the-sandbox-limit",
        _T,
        want_err=r"tokenizer_config\.json: refused to render: range\(\) of 1000000 items",
        setup=_with_template("{{ range(1000000) | list }}"),
    ),
    Case(
        "chat-template-string-repetition",
        _T,
        want_err=r"tokenizer_config\.json: refused to render: str \* 1000000000000 would have",
        setup=_with_template("{{ 'x' * 1000000000000 }}"),
    ),
    Case(
        "chat-template-python-error",
        _T,
        want_err=r"tokenizer_config\.json: the chat template failed: ",
        setup=_with_template("{{ ('9' * 5000) | int }}{{ 1 / 0 }}"),
    ),
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
    Case(  # JAX_PLATFORMS unset on a CPU host: no TPU probe lines before the error line
        "train_error_alone_without_jax_platforms",
        ["train.py", "--config=configs/tiny_test.py", "--workdir={tmp}/w", "--config.mesh=fsdp=3"],
        want_err=r"config\.mesh 'fsdp=3' does not fit",
        env={"JAX_PLATFORMS": None},
        quiet=True,
    ),
    Case(
        "train_workdir_under_proc",
        ["train.py", "--config=configs/tiny_test.py", "--workdir=/proc/dflash-probe/w"],
        # (root passes os.access there: the check creates a file to know)
        want_err=r"--workdir /proc/dflash-probe/w: (nothing can be created in|/proc is not wr)",
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
                "dry_run_denoise_steps_over_block",
                ["--topology=cpu:2", "--model=small", "--denoise_steps=16"],
                r"--denoise_steps must be in \[1, 15\]",
            ),
            (
                "dry_run_eagle3_tree",
                ["--topology=cpu:2", "--model=small", "--drafter=eagle3", "--tree_budget=8"],
                r"--tree_budget is for DFlash drafters; --drafter=eagle3 drafts a chain",
            ),
            (
                "dry_run_draft_vocab_without_eagle3",
                ["--topology=cpu:2", "--model=small", "--draft_vocab_size=100"],
                r"--draft_vocab_size is for --drafter=eagle3",
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
            # Outputs and model limits checked before the compile (no result lost after it).
            (
                "dry_run_json_out_missing_dir",
                ["--topology=cpu:2", "--model=tiny", "--json_out={tmp}/no/such/r.json"],
                r"--json_out .*r\.json: directory .*no/such does not exist",
            ),
            (
                "dry_run_json_out_is_dir",
                ["--topology=cpu:2", "--model=tiny", "--json_out={tmp}"],
                r"--json_out .* is a directory",
            ),
            (
                "dry_run_hlo_dir_is_file",
                ["--topology=cpu:2", "--model=tiny", "--hlo_dir=pyproject.toml/hlo"],
                r"--hlo_dir pyproject\.toml/hlo: \S*pyproject\.toml exists and is not a directory",
            ),
            (
                "dry_run_context_past_model",
                ["--topology=cpu:2", "--model=tiny", "--context=10000000"],
                r"tiny: --context 10000000 \+ --max_new_tokens 256 = .* exceeds .*"
                r"max_position_embeddings=",
            ),
            (
                "dry_run_expert_axis_dense",
                ["--topology=cpu:2", "--model=tiny", "--mesh=expert=2"],
                r"tiny: the mesh axis expert=2 .*dense",
            ),
            (
                "dry_run_expert_axis_not_dividing",
                ["--topology=cpu:6", "--model=tiny_moe", "--mesh=expert=3,data=2"],
                r"tiny_moe: the mesh axis expert=3 does not divide the target's \d+ experts",
            ),
        ]
    ],
    Case(
        "train_dry_run_json_out_missing_dir",
        [
            "train.py",
            "--config=configs/tiny_test.py",
            "--dry_run",
            "--topology=cpu:2",
            "--dry_run_model=tiny",
            "--json_out={tmp}/no/r.json",
        ],
        want_err=r"--json_out .*r\.json: directory .* does not exist",
    ),
    Case(  # an expert axis over a dense target: refused before the weights load, as train.py does
        "infer_expert_axis_dense_target",
        ["infer.py", "--mesh=expert=2", "--max_new_tokens=2"],
        want_err=r"the mesh axis expert=2 splits a mixture-of-experts target's experts, but "
        r"the target is dense",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
    ),
    # Settings that cannot apply without a drafter are refused (as --tree_budget is).
    *[
        Case(name, ["infer.py", "--target={pair}/target", "--drafter=", *args], want_err=err)
        for name, args, err in [
            ("infer_compare_ar_no_drafter", ["--compare_ar"], r"--compare_ar needs a drafter"),
            ("infer_denoise_no_drafter", ["--denoise_steps=2"], r"denoise_steps needs a drafter"),
            (
                "infer_confidence_no_drafter",
                ["--confidence_threshold=0.5"],
                r"confidence_threshold needs a drafter",
            ),
            (
                "infer_schedule_no_drafter",
                ["--denoise_schedule=fixed"],
                r"denoise_schedule needs a drafter",
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
            (
                "infer_dry_run_json_out_is_dir",
                "--json_out=/tmp",
                r"--json_out /tmp is a directory",
            ),
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
    Case(
        "step_costs_bad_block_sizes",
        ["benchmarks/step_costs.py", "--block_sizes=2,x"],
        want_err=r"--block_sizes wants integers",
    ),
]


def _run_all(cases, base):
    """Every case: those that set environment variables in their own interpreter (some are read
    when jax is imported), two at a time; the rest forked from one that imported jax once."""
    own = [c for c in cases if c.env]
    out = run_forked([c for c in cases if not c.env], base)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futs = {c.name: pool.submit(run_case, c, os.path.join(base, c.name)) for c in own}
        out.update({name: f.result() for name, f in futs.items()})
    return out


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
    # The fork server reports as the interpreter does: the same verdicts, exit statuses, and
    # the error line of a refused run of a real CLI.
    refused = Case("refused", ["infer.py", "--seed=1e30"], want_err=r"--seed")
    forked = run_forked(
        [dataclasses.replace(case, unchanged=(p,)), crash, refused], str(tmp_path / "z")
    )
    assert forked["control"][0].returncode == 1 and open(p).read() == "new"
    assert check(crash, *forked["crash"]) == ["traceback on stderr"]
    assert forked["crash"][0].returncode == 1 and "RuntimeError: x" in forked["crash"][0].stderr
    assert check(refused, *forked["refused"]) == []
    own = run_case(refused, str(tmp_path / "r"))[0]
    assert (forked["refused"][0].returncode, forked["refused"][0].stderr) == (
        own.returncode,
        own.stderr,
    )
