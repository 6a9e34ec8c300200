"""benchmarks/ as tools (issue 64): the index in benchmarks/README.md is what
`benchmarks/index.py` writes from the scripts' docstrings, every script there is in it and says
what it measures and the command of its committed results; a script added without either, or
left out of the index, is reported (on a folder made here); every one-off experiment in
benchmarks/experiments/ has a README naming its scripts and starts from the repository root;
and every committed result JSON's command names a script that exists (at its old path, through
`index.MOVED`)."""

import glob
import json
import os
import subprocess
import sys

import pytest

from benchmarks import index

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
EXPERIMENT_SCRIPTS = sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(BENCH, "experiments", "*", "*.py"))
    if os.path.basename(p) != "__init__.py"
)

TOOL = '''"""What {name} measures.

    python benchmarks/{name} --out=x.json

Committed results: `python benchmarks/{name} --out=benchmarks/results/x.json`.
"""
'''


def _readme():
    with open(os.path.join(BENCH, "README.md"), encoding="utf-8") as f:
        return f.read()


def _folder(tmp_path, scripts=("a.py",)):
    """A benchmarks folder: the scripts, a README whose index is the generator's."""
    for name in scripts:
        (tmp_path / name).write_text(TOOL.format(name=name))
    (tmp_path / "README.md").write_text(f"# B\n\n{index.BEGIN}\n{index.END}\n\nmore text\n")
    assert index.write(str(tmp_path)) == []
    assert index.check(str(tmp_path)) == []
    return tmp_path


def test_the_committed_index_is_what_the_generator_writes():
    assert index.check() == []
    tools, experiments, problems = index.collect()
    assert problems == []
    doc = _readme()
    assert doc[doc.index(index.BEGIN) : doc.index(index.END)].count("\n| [`") == len(tools) + len(
        experiments
    )


def test_every_script_in_benchmarks_is_in_the_index_with_what_it_measures_and_its_command():
    scripts = sorted(
        os.path.basename(p)
        for p in glob.glob(os.path.join(BENCH, "*.py"))
        if not p.endswith("__init__.py")
    )
    assert "bench_dflash.py" in scripts and "index.py" in scripts  # the tools, not an empty glob
    assert index.listed(_readme()) == scripts
    tools = {t.name: t for t in index.collect()[0]}
    assert sorted(tools) == scripts
    for t in tools.values():
        assert t.measures and not t.measures.startswith(index.RESULTS), t.name
        assert t.results, t.name
    # The table's cells are the docstrings': a fact of one script's, found in its row.
    row = next(ln for ln in _readme().splitlines() if ln.startswith("| [`step_costs.py`]"))
    assert tools["step_costs.py"].measures in row
    assert "--json_out=benchmarks/results/tiny-code/step_costs.json" in row


def test_an_unlisted_script_is_reported_and_write_lists_it(tmp_path):
    folder = _folder(tmp_path)
    (folder / "b.py").write_text(TOOL.format(name="b.py"))
    problems = index.check(str(folder))
    assert "b.py: not in README.md's index" in problems
    assert any("differs from the scripts' docstrings" in p for p in problems)
    assert index.write(str(folder)) == []
    assert index.check(str(folder)) == []
    assert index.listed((folder / "README.md").read_text()) == ["a.py", "b.py"]
    assert (folder / "README.md").read_text().endswith("<!-- /index -->\n\nmore text\n")
    # A script gone from the folder but still listed is reported too.
    (folder / "b.py").unlink()
    assert "b.py: in README.md's index but not in benchmarks/" in index.check(str(folder))


def test_an_edited_docstring_makes_the_index_stale(tmp_path):
    folder = _folder(tmp_path)
    (folder / "a.py").write_text(TOOL.format(name="a.py").replace("What", "How much"))
    assert index.check(str(folder)) == [
        "README.md's index differs from the scripts' docstrings: "
        "run `python benchmarks/index.py --write`"
    ]


def test_a_script_that_does_not_say_what_it_measures_or_its_command_is_reported(tmp_path):
    folder = _folder(tmp_path)
    (folder / "bare.py").write_text("import os\n")
    (folder / "nocmd.py").write_text('"""What it measures.\n\nMore."""\n')
    (folder / "twice.py").write_text(
        '"""What.\n\nCommitted results: `python x`.\n\nCommitted results: `python y`."""\n'
    )
    problems = index.write(str(folder))  # written anyway; the problems stay
    assert any(p.startswith("bare.py: no module docstring") for p in problems)
    assert any(p.startswith("bare.py: 0 `Committed results:`") for p in problems)
    assert any(p.startswith("nocmd.py: 0 `Committed results:`") for p in problems)
    assert any(p.startswith("twice.py: 2 `Committed results:`") for p in problems)
    assert not any(p.startswith("a.py") for p in problems)
    assert index.check(str(folder)) == problems


def test_an_experiment_needs_a_readme_naming_each_script(tmp_path):
    folder = _folder(tmp_path)
    topic = folder / "experiments" / "question"
    topic.mkdir(parents=True)
    (topic / "__init__.py").write_text('"""Package marker: not a script."""\n')
    (topic / "probe.py").write_text('"""What the probe answered."""\n')
    assert "experiments/question: no README.md (the question, scripts, results)" in index.write(
        str(folder)
    )
    (topic / "README.md").write_text("# Question\n\nDoes it pay?\n\n- Script: none named.\n")
    assert index.write(str(folder)) == [
        "experiments/question/probe.py: not named in its folder's README.md"
    ]
    (topic / "README.md").write_text("# Question\n\nDoes it pay?\n\n- Script: `probe.py`.\n")
    assert index.write(str(folder)) == [] and index.check(str(folder)) == []
    tools, experiments, _ = index.collect(str(folder))
    assert experiments == [index.Experiment("question", "Does it pay?", ("probe.py",))]
    assert (
        "| [`experiments/question/`](experiments/question/) | Does it pay? | `probe.py` |"
        in (folder / "README.md").read_text()
    )


def test_the_check_flag_exits_nonzero_naming_the_unlisted_script(tmp_path):
    folder = _folder(tmp_path)
    (folder / "b.py").write_text(TOOL.format(name="b.py"))
    script = os.path.join(BENCH, "index.py")
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, script, *a], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    stale = run("--check", f"--root={folder}")
    assert stale.returncode == 1 and "error: b.py: not in README.md's index" in stale.stderr
    assert run("--check").returncode == 0  # the committed README
    printed = run(f"--root={folder}")
    assert printed.returncode == 0 and "| [`b.py`](b.py) | What b.py measures. |" in printed.stdout


def test_experiment_scripts_have_readmes_and_left_the_tools_folder():
    assert len(EXPERIMENT_SCRIPTS) >= 20
    for old, new in index.MOVED.items():
        assert not os.path.exists(os.path.join(ROOT, old)), old
        assert os.path.isfile(os.path.join(ROOT, new)), new
    assert sorted(index.MOVED.values()) == EXPERIMENT_SCRIPTS
    for rel in EXPERIMENT_SCRIPTS:
        with open(os.path.join(ROOT, os.path.dirname(rel), "README.md"), encoding="utf-8") as f:
            assert os.path.basename(rel) in f.read(), rel


@pytest.mark.parametrize("script", EXPERIMENT_SCRIPTS)
def test_an_experiment_starts_from_the_repository_root(script):
    """Its imports resolve from where it is now: absl's --helpshort prints its docstring (exit 1,
    absl's status for help) before anything is computed."""
    r = subprocess.run(
        [sys.executable, script, "--helpshort"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out[-2000:]
    first = index.read_tool(os.path.join(ROOT, script))[0].measures.split()[:4]
    if r.returncode == 1:  # the absl scripts: the usage, from the module docstring
        assert " ".join(first) in " ".join(out.split()), out[-2000:]
    else:  # tree_table.py takes no flags of its own: it printed its tables
        assert r.returncode == 0 and script.endswith("tree_table.py"), (r.returncode, out[-2000:])


def test_every_recorded_benchmark_command_names_a_script_that_exists():
    paths = sorted(glob.glob(os.path.join(BENCH, "results", "**", "*.json"), recursive=True))
    seen, moved = 0, 0
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for rec in data if isinstance(data, list) else [data.get("meta", data)]:
            cmd = rec.get("command") or ""
            now = index.script_now(cmd)
            if now is None:
                continue
            seen += 1
            moved += now.startswith("benchmarks/experiments/")  # recorded at the old path
            assert os.path.isfile(os.path.join(ROOT, now)), (os.path.relpath(path, ROOT), cmd)
    # Tools' and (old-path) experiments' commands both, not an empty glob.
    assert seen > 20 and moved >= 10, (seen, moved)
    assert index.script_now("python benchmarks/ddpm_tau.py --steps=1") == (
        "benchmarks/experiments/ddpm/ddpm_tau.py"
    )
    assert index.script_now("benchmarks/bench_dflash.py --x=1") == "benchmarks/bench_dflash.py"
    assert index.script_now("python -m dflash_jax.dry_run --model=tiny") is None
