"""The config files the docs and scripts name exist and load, and the bundled pair's
reproduction script (scripts/reproduce_tiny_code.sh) parses and runs its whole chain."""

import glob
import importlib.util
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "reproduce_tiny_code.sh")
# A repo path (not one at a git revision, `git show REV:configs/old.py`).
CONFIG_PATH = re.compile(r"(?<![:\w/])configs/[A-Za-z0-9_/]+\.py\b")
# Files that tell a user which config to run.
NAMING = [
    "Makefile",
    "README.md",
    "train.py",
    "notebooks/build_notebook.py",
    "scripts/*.sh",
    "docs/*.md",
    "assets/*/README.md",
    "benchmarks/README.md",
    "configs/**/*.py",
]


def _load(path):
    spec = importlib.util.spec_from_file_location("cfg_under_test", os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def _dry_run(tmp_path):
    runs = tmp_path / "runs"
    out = subprocess.run(
        ["bash", SCRIPT, "--dry_run", str(runs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert not runs.exists()  # a dry run writes nothing
    return out.stdout.splitlines()


def test_reproduce_script_parses():
    out = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_reproduce_script_runs_every_stage_in_order(tmp_path):
    lines = _dry_run(tmp_path)
    trained = [
        m.group(0)
        for ln in lines
        if " train.py " in f" {ln} "
        for m in [CONFIG_PATH.search(ln)]
        if m
    ]
    # Each stage of configs/tiny_code/ is used, and every one after its predecessor.
    stages = sorted(
        os.path.relpath(p, ROOT)
        for p in glob.glob(os.path.join(ROOT, "configs", "tiny_code", "*.py"))
        if not p.endswith("__init__.py")
    )
    assert set(trained) == set(stages)
    first = {c: trained.index(c) for c in stages}
    order = (
        ["target", "target_stage2", "target_unlikelihood"],
        ["drafter", "drafter_stage2", "drafter_stage3", "drafter_stage4"],
    )
    for chain in order:
        idx = [first[f"configs/tiny_code/{s}.py"] for s in chain]
        assert idx == sorted(idx), chain
    # A stage's inputs are made by an earlier line: the target and drafter it starts from, the
    # responses it trains on (regen.output, unless it writes them) and the files `cat` joins.
    runs = str(tmp_path / "runs")
    made = []

    def check(src, ln):
        assert any((src + "/").startswith(p) or src == p for p in made), (
            src,
            "used before it is made:",
            ln,
        )

    for ln in lines:
        for key in ("target_path", "drafter.init_path"):
            for m in re.finditer(rf"--config\.{re.escape(key)}=(\S+)", ln):
                check(m.group(1), ln)
        regen = re.search(r"--config\.regen\.output=(\S+)", ln)
        if regen and "--config.regen.only=True" not in ln:
            check(regen.group(1), ln)
        if ln.startswith("cat "):
            srcs, dst = ln[4:].split(" > ")
            for src in srcs.split():
                check(src, ln)
            made.append(dst)
        made += [m.group(1) + "/" for m in re.finditer(r"--workdir=(\S+)", ln)]
        if regen:
            made.append(regen.group(1))
        if " -c " in ln:  # a bfloat16 export: its source, destination (and target) dirs
            made += [a + "/" for a in ln.split()[-3:] if a.startswith(runs)]
    assert lines[-1].startswith("python benchmarks/bench_dflash.py")


def test_reproduce_script_rejects_bad_arguments():
    out = subprocess.run(
        ["bash", SCRIPT, "--fast"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "usage:" in out.stderr


def _named_config_paths():
    """{path: (first file naming it, whether some file passes it as --config=)}."""
    named = {}
    for pattern in NAMING:
        for f in glob.glob(os.path.join(ROOT, pattern), recursive=True):
            text = open(f, encoding="utf-8").read()
            for m in CONFIG_PATH.finditer(text):
                where, as_arg = named.get(m.group(0), (os.path.relpath(f, ROOT), False))
                named[m.group(0)] = (where, as_arg or "--config=" + m.group(0) in text)
    return named


def test_docs_and_scripts_name_config_paths():
    named = _named_config_paths()
    assert named["configs/tiny_code/drafter_stage4.py"][1] and named["configs/tiny_test.py"][1]


@pytest.mark.parametrize("path", sorted(_named_config_paths()))
def test_named_config_exists_and_loads(path):
    """Every configs/... path named in the Makefile, scripts, docs and configs is a file (a
    moved or deleted config leaves no dead reference); one given as --config= loads with
    get_config() into a runnable config."""
    where, as_arg = _named_config_paths()[path]
    assert os.path.isfile(os.path.join(ROOT, path)), (path, "named in", where)
    if as_arg:
        cfg = _load(path)
        assert cfg.mode in ("target", "drafter") and cfg.num_train_steps != 0, path


def test_smollm2_reproduction_script_stages_in_order(tmp_path):
    """scripts/reproduce_smollm2.sh parses and, dry, prints its five stages in order (prompts,
    the regeneration chunks, training on their concatenation, the bfloat16 export, the tau
    evaluation), writing nothing."""
    script = os.path.join(ROOT, "scripts", "reproduce_smollm2.sh")
    assert subprocess.run(["bash", "-n", script], timeout=60).returncode == 0
    runs = tmp_path / "runs"
    out = subprocess.run(
        ["bash", script, "--dry_run", str(runs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CHUNKS": "3"},
    )
    assert out.returncode == 0, out.stderr
    assert not runs.exists()
    lines = out.stdout.splitlines()
    marks = [
        "dflash_jax.data.sources --source=sharegpt",
        "regenerate --target=smollm2-135m-instruct",
        "train.py --config=configs/smollm2/drafter.py",
        "save_drafter",
        "benchmarks/eval_tau.py --target=smollm2-135m-instruct",
    ]
    at = [next(i for i, ln in enumerate(lines) if m in ln.replace("\\", "")) for m in marks]
    assert at == sorted(at), at
    assert sum("dflash_jax.training.regenerate" in ln for ln in lines) == 3
    assert _load("configs/smollm2/drafter.py").target_path == "smollm2-135m-instruct"


def test_smollm2_dflash2_config_is_the_dflash_one_continued_as_dflash2():
    """configs/smollm2/drafter_dflash2.py: the DFlash drafter's config (target, data, model)
    with DFlash 2 on and the continuation's schedule; the DFlash control is the same command
    with dflash2 off, so everything else must match."""
    base = _load("configs/smollm2/drafter.py")
    v2 = _load("configs/smollm2/drafter_dflash2.py")
    assert v2.drafter.dflash2.enabled and not base.drafter.dflash2.enabled
    assert (v2.learning_rate, v2.num_train_steps) == (5e-4, 60)
    for key in ("target_path", "data", "regen", "num_anchors", "gamma"):
        assert v2[key] == base[key], key
    v2.drafter.dflash2.enabled = False
    assert v2.drafter == base.drafter
