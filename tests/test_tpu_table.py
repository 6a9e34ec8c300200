"""benchmarks/tpu_table.py: the README's and docs' TPU tables are what the script makes of the
committed JSONs (so no figure there lacks its compile), and its block rewriting."""

import os

import pytest

from benchmarks import tpu_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _block(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        doc = f.read()
    a, b = doc.index(tpu_table.BEGIN), doc.index(tpu_table.END)
    return doc[a + len(tpu_table.BEGIN) : b].strip("\n")


def test_committed_tables_are_the_scripts_output():
    results = tpu_table.load(
        [os.path.join(ROOT, "benchmarks", "results", d) for d in ("tpu_dry_run", "gpu_dry_run")]
    )
    taus = [6.5, 5.4]
    assert _block("README.md") == "\n".join(tpu_table.readme_table(results, taus)).strip("\n")
    assert _block(os.path.join("docs", "tpu_dry_run.md")) == tpu_table.full_tables(
        results, taus, "####"
    ).strip("\n")


def test_replace_block_keeps_the_rest_and_refuses_a_doc_without_markers():
    doc = f"intro\n{tpu_table.BEGIN}\nold\n{tpu_table.END}\noutro\n"
    assert tpu_table.replace_block(doc, "new", "x.md") == (
        f"intro\n{tpu_table.BEGIN}\nnew\n{tpu_table.END}\noutro\n"
    )
    with pytest.raises(SystemExit, match="x.md has no"):
        tpu_table.replace_block("no markers", "new", "x.md")


def test_every_row_off_the_goal_says_why():
    """Each inference row whose compiled HBM bytes are over the goal (1.10x the floor for AR,
    1.20x for DFlash) has its one-line reason (`OFF_GOAL`), and no reason stands for a row that
    meets the goal or is not there (a stale line)."""
    results = tpu_table.load(
        [os.path.join(ROOT, "benchmarks", "results", d) for d in ("tpu_dry_run", "gpu_dry_run")]
    )
    off = {
        r["_file"]
        for r in tpu_table.infer_rows(results)
        if (got := tpu_table.over_floor(r)) is not None
        and (got[0] > tpu_table.GOAL[0] or got[1] > tpu_table.GOAL[1])
    }
    assert off == set(tpu_table.OFF_GOAL), (off, set(tpu_table.OFF_GOAL))
    lines = tpu_table.off_goal_lines(results)
    assert len(lines) == (2 + len(off) if off else 0)  # a heading and a blank line, or nothing
    assert not any("not yet found" in ln for ln in lines)
