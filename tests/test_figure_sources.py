"""Every figure the docs quote comes from a committed result file that names its command and
commit: each JSON under benchmarks/results/ has both, every result file a doc cites exists, the
demo / sampling / unlikelihood figures the docs quote are the ones in their files, and
`dflash_jax.support.provenance` records the command and commit as git and the command line give them."""

import glob
import json
import os
import re
import subprocess

import pytest

from dflash_jax.support import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DOCS = [
    "README.md",
    "benchmarks/README.md",
    "docs/*.md",
    "benchmarks/results/**/README.md",
    "benchmarks/experiments/*/README.md",
]
# A result file a doc names: benchmarks/results/... or, from benchmarks/README.md, results/...
# (not after "=": a command's output flag, which may name a file not made yet; nor after
# ":", a file at a git revision).
CITED = re.compile(r"(?<![\w/.=:-])(?:benchmarks/)?results/[\w*./{},-]+\.(?:json|md|txt|png)\b")


def _read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _json(rel):
    return json.loads(_read(rel))


def _docs():
    for pattern in DOCS:
        for path in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
            yield os.path.relpath(path, ROOT)


def test_every_result_json_names_its_command_and_commit():
    paths = sorted(glob.glob(os.path.join(RESULTS, "**", "*.json"), recursive=True))
    assert len(paths) > 40  # the committed results, not an empty glob
    bad = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        # bench_dflash.py keeps them in "meta"; a dry run of several meshes writes a list.
        for rec in data if isinstance(data, list) else [data.get("meta", data)]:
            cmd, commit = rec.get("command"), rec.get("commit")
            if not (isinstance(cmd, str) and cmd.strip()):
                bad.append(f"{os.path.relpath(path, ROOT)}: command {cmd!r}")
            if not (isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}", commit)):
                bad.append(f"{os.path.relpath(path, ROOT)}: commit {commit!r}")
            for p in rec.get("predates", []):  # later code changes, each a full commit
                assert re.fullmatch(r"[0-9a-f]{40}", p["commit"]) and ":" in p["change"], path
    assert not bad, "\n".join(bad)


def test_every_result_file_a_doc_cites_exists():
    missing = []
    for doc in _docs():
        base = "benchmarks" if doc == "benchmarks/README.md" else ""
        for m in CITED.finditer(_read(doc)):
            rel = m.group(0)
            if not rel.startswith("benchmarks/"):
                rel = os.path.join(base or "benchmarks", rel)
            # "results.{json,md}" names two files; "*_kv_pallas.json" a set
            names = [rel]
            brace = re.search(r"\{([^}]*)\}", rel)
            if brace:
                names = [
                    rel[: brace.start()] + x + rel[brace.end() :] for x in brace.group(1).split(",")
                ]
            for name in names:
                if not glob.glob(os.path.join(ROOT, name)):
                    missing.append(f"{doc}: {m.group(0)}")
    assert not missing, "\n".join(missing)


def test_quoted_figures_are_the_result_files():
    demo = _json("benchmarks/results/tiny-code/demo.json")
    assert demo["identical_to_ar"] and {round(t, 2) for t in demo["tau"]} == {2.44}
    speedups = " / ".join(f"{r['totals']['speedup']:.2f}x" for r in demo["runs"])
    rates = "median rates {:.0f} vs {:.0f} tok/s".format(
        demo["median"]["decode_tokens_per_s"], demo["median"]["ar_decode_tokens_per_s"]
    )
    for doc in ("README.md", "benchmarks/README.md"):
        text = " ".join(_read(doc).split())  # line breaks as spaces
        assert "tau 2.44" in text and speedups in text and rates in text, doc
    ops = _json("benchmarks/results/tiny-code/op_costs.json")
    ratio = f"{ops['ratios']['categorical_over_sample_categorical']:.2f}x cheaper"
    for doc in ("docs/generation.md", "benchmarks/README.md"):
        assert ratio in " ".join(_read(doc).split()), doc
    us = ops["choosers_us"]
    assert ops["ratios"]["categorical_over_sample_categorical"] == (
        us["jax.random.categorical"] / us["sampling.sample_categorical"]
    )
    ul = _json("benchmarks/results/toy/unlikelihood.json")["repeated_4gram_share_by_weight"]
    text = " ".join(_read("docs/training.md").split())
    assert f"{ul['1.0']:.3f} of greedy tokens in repeated 4-grams against {ul['0.0']:.3f}" in text


def test_record_names_the_command_line_and_the_checkout():
    rec = provenance.record(
        argv=[
            os.path.join(ROOT, "benchmarks", "experiments", "token_choosers", "op_costs.py"),
            "--x=a b",
        ]
    )
    assert rec["command"] == "python benchmarks/experiments/token_choosers/op_costs.py '--x=a b'"
    main = os.path.join(ROOT, "dflash_jax", "dry_run", "__main__.py")
    assert provenance.command([main, "--model=tiny"]) == "python -m dflash_jax.dry_run --model=tiny"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout: the commit and the tree's state as git says
        assert rec["commit"] == head.stdout.strip()
        status = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":(exclude)benchmarks/results",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert rec["dirty"] == bool(status.strip())
    else:  # a copy without git history: nothing invented
        assert rec["commit"] is None and rec["dirty"] is None
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rec["date"])
    assert rec["machine"]["cpu_count"] == os.cpu_count()


def test_ddpm_tpu_page_is_the_scripts():
    """benchmarks/results/ddpm/tpu/README.md is what benchmarks/experiments/ddpm/ddpm_tpu.py
    makes of the committed dry runs (and the CPU taus): rerun
    `python benchmarks/experiments/ddpm/ddpm_tpu.py --write`."""
    from benchmarks.experiments.ddpm import ddpm_tpu

    assert _read(os.path.relpath(ddpm_tpu.OUT, ROOT)) == ddpm_tpu.page()
    st = ddpm_tpu.steps()
    assert sorted(st) == [1, 2, 4]
    # More passes cost more: each extra drafter pass reads the drafter and the LM head again.
    # The AR step is one program whichever K (its JSONs compiled at different commits agree to
    # rounding: 3.6855948 / 3.6855952 ms).
    ar = [a for _, a, _, _ in st.values()]
    assert st[1][0] < st[2][0] < st[4][0] and max(ar) == pytest.approx(min(ar), rel=1e-6)
