"""`python -m dflash_jax.training.regenerate` loses nothing a user gives (issue #66):

- every flag, value and output path is checked before any model loads or any file is written
  (one `error:` line, exit 2, the user's files and the output's directory as they were);
- the journal (OUT.partial) knows its target by its files, so a resume with another target,
  or with the same directory's weights changed, is refused in one line naming both;
- Ctrl-C (SIGINT) and SIGTERM are one line and exit 130 / 143 at any moment: before the
  first batch nothing is left behind; after it, the finished batches stay in the journal and a
  rerun resumes to the same file an uninterrupted run writes.

The runs are real subprocesses of the CLI on the bundled tiny-code target (batches of one
prompt, so there are batches to interrupt between); the refused cases run in children forked
from one interpreter that imported jax once (tests/_probe_zygote.py).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dflash_jax.data import sources
from dflash_jax.training import regenerate as regen

# Host-side behaviour the jax version does not change: `make test` only (tests/README.md).
pytestmark = pytest.mark.once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "assets", "tiny-code", "target")
N_PROMPTS, MAX_NEW = 12, 24
ARGS = ("--batch_size=1", f"--max_new_tokens={MAX_NEW}")


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", NO_COLOR="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.pop("XLA_FLAGS", None)
    return env


def _cmd(target, prompts, out, *extra):
    return [
        sys.executable,
        "-m",
        "dflash_jax.training.regenerate",
        f"--target={target}",
        f"--prompts={prompts}",
        f"--out={out}",
        *extra,
    ]


# The same CLI with a pause before each batch after the first (the real `generate` then runs),
# so a signal sent once the first batch is journaled lands while the run goes on, however fast
# a warm machine finishes the other batches (they once all finished in the 10 ms the test took
# to see the journal line, and the run exited 0).
_PAUSED = (
    "import runpy, time\n"
    "from dflash_jax.decoding import generation\n"
    "real, calls = generation.generate, []\n"
    "def paused(*a, **k):\n"
    "    calls.append(1)\n"
    "    if len(calls) > 1:\n"
    "        time.sleep(5)\n"
    "    return real(*a, **k)\n"
    "generation.generate = paused\n"
    "runpy.run_module('dflash_jax.training.regenerate', run_name='__main__', alter_sys=True)\n"
)


def _paused_cmd(target, prompts, out, *extra):
    return [sys.executable, "-c", _PAUSED] + _cmd(target, prompts, out, *extra)[3:]


def _default_sigint():
    # A child of a non-interactive shell may inherit SIGINT ignored; a user's Ctrl-C is not.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(cmd):
    return subprocess.run(
        cmd,
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_default_sigint,
    )


def _one_line(err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    return lines[0]


def _write_prompts(path):
    with open(path, "w") as f:
        for i in range(N_PROMPTS):
            f.write(json.dumps({"prompt": f"def f{i}(x):\n    return"}) + "\n")


def _listing(d):
    return sorted(
        os.path.relpath(os.path.join(r, n), d) for r, ds, fs in os.walk(d) for n in fs + ds
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The prompt file and what an uninterrupted run writes from it (bytes)."""
    d = tmp_path_factory.mktemp("reference")
    prompts = str(d / "prompts.jsonl")
    _write_prompts(prompts)
    out = str(d / "ref.jsonl")
    res = _run(_cmd(TARGET, prompts, out, *ARGS))
    assert res.returncode == 0, res.stderr[-3000:]
    with open(out, "rb") as f:
        ref = f.read()
    assert len(ref.splitlines()) == N_PROMPTS
    return prompts, ref


def _interrupt_after_first_batch(target, prompts, out, sig):
    """Runs the paused CLI, sends `sig` once OUT.partial holds a whole batch line; (rc, stdout,
    stderr)."""
    journal = out + ".partial"
    proc = subprocess.Popen(
        _paused_cmd(target, prompts, out, *ARGS),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with open(journal) as f:
                if len(f.read().split("\n")) >= 3:  # the header and a whole batch line
                    break
        except OSError:
            pass
        time.sleep(0.01)
    # The batch is on disk before the run hands the signals to its own handling (the guard's
    # line until then says nothing was written): the paused command waits 5 s before its next
    # batch, so 0.5 s on the signal lands in the handling that keeps the batch.
    time.sleep(0.5)
    if proc.poll() is not None:  # ended before the signal: say how, not only "0 == 130"
        o, e = proc.communicate()
        pytest.fail(f"the run ended ({proc.returncode}) before the signal:\n{o}\n{e[-3000:]}")
    proc.send_signal(sig)
    o, e = proc.communicate(timeout=120)
    return proc.returncode, o, e


def _journal_batches(journal):
    with open(journal) as f:
        lines = f.read().split("\n")
    assert lines[-1] == "", "the journal ends with a whole line"
    head, rows = json.loads(lines[0]), [json.loads(ln) for ln in lines[1:-1]]
    assert "fingerprint" in head and head["target"]["files"]
    return rows


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_after_a_batch_keeps_it_and_the_resume_equals_an_uninterrupted_run(
    reference, tmp_path, sig, code
):
    prompts, ref = reference
    out = str(tmp_path / "out.jsonl")
    rc, _, err = _interrupt_after_first_batch(TARGET, prompts, out, sig)
    assert rc == code, err[-3000:]
    rows = _journal_batches(out + ".partial")
    assert 1 <= len(rows) < N_PROMPTS
    s = "es" if len(rows) > 1 else ""
    assert _one_line(err) == (
        f"interrupted: {len(rows)} finished batch{s} kept in {out}.partial; rerun the same "
        "command to resume"
    )
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")

    res = _run(_cmd(TARGET, prompts, out, *ARGS))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"{len(rows)} finished batches resumed" in res.stdout
    with open(out, "rb") as f:
        assert f.read() == ref
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl"]  # the journal gone, no temporary left


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN])
def test_ctrl_c_before_the_first_batch_is_one_line_130_and_nothing_written(
    reference, tmp_path, inherited
):
    """Sent once the target is loaded (the run's first stdout line), while the first batch
    compiles; also when SIGINT came ignored from a background shell (it was swallowed: the
    run went on and exited 0)."""
    prompts, _ = reference
    out = str(tmp_path / "out.jsonl")
    proc = subprocess.Popen(
        _cmd(TARGET, prompts, out, *ARGS),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, inherited),
    )
    assert proc.stdout.readline().startswith("regenerating ")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert _one_line(err) == "interrupted: nothing was written"
    assert os.listdir(tmp_path) == []


def _flip_last_byte(path):
    """The same file, same size, one weight's bytes changed (a fine-tune's difference)."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))


def test_a_resume_with_another_target_or_changed_weights_is_refused(reference, tmp_path):
    """The journal of a run on a copy of the target: resumed with a modified copy elsewhere,
    or with its own directory's weights rewritten in place (same shapes, same size), it is one
    line naming both targets, exit 2, before the target loads; the journal and the directory
    unchanged. A journal of the earlier format (no target recorded) is refused too."""
    prompts, ref = reference
    mine, other = str(tmp_path / "target"), str(tmp_path / "finetuned")
    shutil.copytree(TARGET, mine)
    shutil.copytree(TARGET, other)
    _flip_last_byte(os.path.join(other, "model.safetensors"))
    work = tmp_path / "work"
    work.mkdir()
    out = str(work / "out.jsonl")
    rc, o, err = _interrupt_after_first_batch(mine, prompts, out, signal.SIGINT)
    assert rc == 130, o + err[-3000:]
    with open(out + ".partial", "rb") as f:
        journal = f.read()

    res = _run(_cmd(other, prompts, out, *ARGS))
    assert res.returncode == 2 and res.stdout == "", res.stderr[-3000:]
    line = _one_line(res.stderr)
    assert line.startswith(f"error: {out}.partial: an interrupted regeneration with another target")
    assert f"journal: {os.path.realpath(mine)}; given: {os.path.realpath(other)}" in line

    _flip_last_byte(os.path.join(mine, "model.safetensors"))  # the same directory, fine-tuned
    res = _run(_cmd(mine, prompts, out, *ARGS))
    assert res.returncode == 2 and res.stdout == "", res.stderr[-3000:]
    line = _one_line(res.stderr)
    weights = os.path.join(os.path.realpath(mine), "model.safetensors")
    assert re.search(
        rf"journal: {re.escape(weights)} 11549832 bytes, modified [^;]+; given: "
        rf"{re.escape(weights)} 11549832 bytes, modified ",
        line,
    ), line
    assert "delete or move" in line
    assert sorted(os.listdir(work)) == ["out.jsonl.partial"]
    with open(out + ".partial", "rb") as f:
        assert f.read() == journal

    old = json.dumps({"fingerprint": "0" * 64}) + "\n" + journal.decode().split("\n", 1)[1]
    with open(out + ".partial", "w") as f:  # as regenerate wrote it before the target's files
        f.write(old)
    res = _run(_cmd(TARGET, prompts, out, *ARGS))
    assert res.returncode == 2, res.stderr[-3000:]
    assert re.fullmatch(
        rf"error: {re.escape(out)}\.partial: a journal of an earlier version of regenerate, .*"
        rf"delete or move {re.escape(out)}\.partial to start over",
        _one_line(res.stderr),
    )


# name, extra argv, error regex, setup(work) -> None. "{w}" is the case's scratch directory
# (it holds prompts.jsonl, an earlier out.jsonl and a copy of the target); "{t}" the copy.
CASES = [
    ("negative_batch", ["--out={w}/out.jsonl", "--batch_size=-1"], r"--batch_size must be >= 1"),
    ("zero_batch", ["--out={w}/out.jsonl", "--batch_size=0"], r"--batch_size must be >= 1"),
    ("zero_tokens", ["--out={w}/out.jsonl", "--max_new_tokens=0"], r"--max_new_tokens must be"),
    ("neg_tokens", ["--out={w}/out.jsonl", "--max_new_tokens=-5"], r"--max_new_tokens must be"),
    (
        "tokens_past_context",
        ["--out={w}/out.jsonl", "--max_new_tokens=4096"],
        r"--max_new_tokens 4096 leaves no room for a prompt in the target's context \(4096",
    ),
    ("nan_temp", ["--out={w}/out.jsonl", "--temperature=nan"], r"--temperature must be a finite"),
    ("inf_temp", ["--out={w}/out.jsonl", "--temperature=inf"], r"--temperature must be a finite"),
    ("neg_temp", ["--out={w}/out.jsonl", "--temperature=-0.5"], r"--temperature must be >= 0"),
    ("out_is_prompts", ["--out={w}/prompts.jsonl"], r"--out .*prompts.jsonl is the --prompts"),
    ("out_via_dotdot", ["--out={w}/../{n}/prompts.jsonl"], r"is the --prompts \(an input\)"),
    ("out_via_link", ["--out={w}/link.jsonl"], r"--out .*link.jsonl is the --prompts"),
    ("out_is_weights", ["--out={t}/model.safetensors"], r"is a file of the --target model"),
    ("out_is_tokenizer", ["--out={t}/tokenizer.json"], r"is a file of the --target model"),
    ("out_is_directory", ["--out={w}/sub"], r"--out .*/sub: .*/sub is a directory"),
    ("journal_is_directory", ["--out={w}/out.jsonl"], r"out.jsonl.partial is a directory"),
    ("as_given_out_is_prompts", ["--out={w}/prompts.jsonl", "--as_given"], r"is the --prompts"),
    ("out_under_a_file", ["--out={w}/prompts.jsonl/out.jsonl"], r"exists and is not a directory"),
    ("empty_out", ["--out="], r"--out must be a path"),
]


def _setup(work, name):
    os.makedirs(work)
    _write_prompts(os.path.join(work, "prompts.jsonl"))
    with open(os.path.join(work, "out.jsonl"), "w") as f:
        f.write('{"prompt_ids": [1], "response_ids": [2]}\n')  # an earlier run's output
    os.mkdir(os.path.join(work, "sub"))
    os.symlink(os.path.join(work, "prompts.jsonl"), os.path.join(work, "link.jsonl"))
    target = os.path.join(work, "target")
    os.mkdir(target)
    for f in os.listdir(TARGET):  # links: a write through one would change the bundled target
        os.symlink(os.path.join(TARGET, f), os.path.join(target, f))
    if name == "journal_is_directory":
        os.mkdir(os.path.join(work, "out.jsonl.partial"))


def _snapshot(work):
    out = {}
    for rel in _listing(work):
        p = os.path.join(work, rel)
        out[rel] = None if os.path.isdir(p) or os.path.islink(p) else open(p, "rb").read()
    return out


def test_bad_flags_and_outputs_are_refused_before_anything_loads_or_is_written(tmp_path):
    """Each case: exit 2, the one `error:` line, nothing on stdout (the target never loaded:
    the run's first line comes after the load), every file in the scratch directory (prompts,
    an earlier output, the target) byte for byte as it was, and no file added."""
    jobs, before = [], {}
    for name, argv, _ in CASES:
        work = str(tmp_path / name / "w")
        _setup(work, name)
        before[name] = _snapshot(work)
        argv = [a.format(w=work, t=os.path.join(work, "target"), n="w") for a in argv]
        jobs.append(
            {
                "argv": [
                    "-m",
                    "dflash_jax.training.regenerate",
                    f"--target={os.path.join(work, 'target')}",
                    f"--prompts={os.path.join(work, 'prompts.jsonl')}",
                    *argv,
                ],
                "dir": str(tmp_path / name / "io"),
                "timeout": 120,
            }
        )
    with open(tmp_path / "jobs.json", "w") as f:
        json.dump(jobs, f)
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tests", "_probe_zygote.py"),
            str(tmp_path / "jobs.json"),
        ],
        cwd=ROOT,
        env=_env(),
        check=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    for (name, _, want), job in zip(CASES, jobs):
        read = lambda n: open(os.path.join(job["dir"], n)).read()  # noqa: E731
        rc, out, err = int(read("rc")), read("stdout"), read("stderr")
        assert rc == 2 and out == "", (name, rc, out, err[-3000:])
        line = _one_line(err)
        assert line.startswith("error: ") and re.search(want, line), (name, line)
        assert _snapshot(str(tmp_path / name / "w")) == before[name], name


def test_the_library_refuses_bad_settings_before_the_target_is_touched(tmp_path):
    """regenerate / regenerate_chat (the trainer's path) check their settings first: a batch
    size of 0 was a ZeroDivisionError, a negative one wrote an empty file."""
    out = str(tmp_path / "out.jsonl")
    bad = [
        (dict(batch_size=0), "batch_size must be >= 1"),
        (dict(batch_size=-2), "batch_size must be >= 1"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(temperature=float("nan")), "temperature must be a finite"),
        (dict(top_p=0.0), r"top_p must be in \(0"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            regen.regenerate(None, [[1, 2]], out, **kw)  # no target: refused before it is used
        with pytest.raises(ValueError, match=msg):
            regen.regenerate_chat(
                None, [[{"role": "user", "content": "hi"}]], out, render=None, encode=None, **kw
            )
    assert os.listdir(tmp_path) == []
    assert regen._ROLES is sources._ROLES  # one role table, the data layer's


def test_the_trainers_regeneration_journal_knows_its_target(tmp_path, monkeypatch):
    """train.py's regeneration (data.kind=regenerated) hands the journal the loaded target's
    directory, as the CLI does, so a resumed training run on changed weights is refused too;
    a fresh in-memory target has none."""
    import numpy as np

    from configs import default
    from dflash_jax.training import corpus, experiment

    config = default.get_config()
    tcfg, tparams, tpath = experiment._target(config, TARGET, None)
    assert tpath and os.path.samefile(tpath, TARGET)
    seen = []
    monkeypatch.setattr(regen, "regenerate", lambda target, *a, **k: seen.append(target))
    monkeypatch.setattr(regen, "read_records", lambda *a, **k: [{"x": 1}, {"x": 2}])
    config.regen.prompt_source = "random"
    config.regen.num_prompts = 2
    corpus._regenerated_docs(
        config, str(tmp_path), tcfg, tparams, None, None, None, np.random.RandomState(0),
        tpath=tpath,
    )  # fmt: skip
    assert len(seen) == 1 and regen.target_identity(seen[0].path)["dir"] == os.path.realpath(TARGET)
    fresh = default.get_config()
    fresh.target_model.vocab_size = 64
    assert experiment._target(fresh, "", None)[2] is None
