"""The index of benchmarks/README.md, made from the scripts themselves: a row per script in
benchmarks/ (the tools) and a row per experiment folder in benchmarks/experiments/.

    python benchmarks/index.py            # print the index
    python benchmarks/index.py --check    # exit 1, saying what differs, when the README's is stale
    python benchmarks/index.py --write    # rewrite the README's index between its markers

A tool's row: what it measures (the first paragraph of its module docstring) and the command
that wrote its committed results (the docstring's paragraph that starts `Committed results:`).
An experiment's row: its question (the first paragraph of the folder's README.md after the
title) and its scripts. A script without a docstring, without that paragraph, or an experiment
folder without a README.md naming each of its scripts, is a problem `--check` reports (as is a
script the README's index does not list), so a script cannot be added beside the tools without
saying what it measures; `tests/test_benchmark_index.py` runs the check.

Committed results: the index in `benchmarks/README.md`, by `python benchmarks/index.py --write`.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from typing import List, NamedTuple, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/
BEGIN, END = "<!-- index -->", "<!-- /index -->"
RESULTS = "Committed results:"
EXPERIMENTS = "experiments"


# The one-off experiments moved out of benchmarks/ (issue 64): a result JSON written before
# names the script at its old path, `python benchmarks/NAME.py ...`; this is where it is now.
MOVED = {
    f"benchmarks/{name}.py": f"benchmarks/{EXPERIMENTS}/{topic}/{name}.py"
    for topic, names in {
        "attention_cpu": ["attention_cpu"],
        "bf16_divergence": ["bf16_divergence"],
        "ddpm": ["ddpm_tau", "ddpm_tpu"],
        "dflash2": ["dflash2_cost", "silence_selector"],
        "draft_sampling": ["draft_sampling_tau"],
        "moe": ["moe_compiled", "moe_verify_bytes"],
        "quantized": ["quantized_tau"],
        "regen": ["regen_speed"],
        "scan_layers": ["scan_layers_run"],
        "tap_stats": ["tap_stats"],
        "tap_store": ["store_step", "tap_cache"],
        "token_choosers": ["op_costs"],
        "trees": ["tree_budget", "tree_table"],
        "under_load": ["under_load"],
        "unlikelihood": ["unlikelihood_toy"],
    }.items()
    for name in names
}


def script_now(command: str) -> str | None:
    """The script a recorded command runs, as a path from the repository root as it is today
    (`MOVED` applied), or None when the command runs no `benchmarks/` script."""
    m = re.match(r"(?:python\S*\s+)?(benchmarks/\S+\.py)(?:\s|$)", command.strip())
    if not m:
        return None
    return MOVED.get(m.group(1), m.group(1))


class Tool(NamedTuple):
    name: str  # file name in benchmarks/
    measures: str  # the docstring's first paragraph, one line
    results: str  # the `Committed results:` paragraph, one line, without the prefix


class Experiment(NamedTuple):
    topic: str  # folder name in benchmarks/experiments/
    question: str  # the README's first paragraph after its title, one line
    scripts: Tuple[str, ...]


def _paragraphs(text: str) -> List[str]:
    """Blank-line separated paragraphs, each joined into one line."""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _docstring(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read(), path)) or ""


def _scripts(folder: str) -> List[str]:
    """The .py files of a folder, package markers (`__init__.py`) left out, sorted."""
    return sorted(
        f
        for f in os.listdir(folder)
        if f.endswith(".py") and f != "__init__.py" and os.path.isfile(os.path.join(folder, f))
    )


def read_tool(path: str) -> Tuple[Tool, List[str]]:
    """The tool's row and what its docstring lacks (messages naming the file)."""
    name, problems = os.path.basename(path), []
    paras = _paragraphs(_docstring(path))
    if not paras:
        problems.append(f"{name}: no module docstring (say what it measures)")
    results = [p[len(RESULTS) :].strip() for p in paras if p.startswith(RESULTS)]
    if len(results) != 1:
        problems.append(
            f"{name}: {len(results)} `{RESULTS}` paragraphs in its docstring, want 1 (the command "
            "that wrote its committed results, or what it writes instead)"
        )
    if paras and paras[0].startswith(RESULTS):
        problems.append(f"{name}: its docstring starts with `{RESULTS}`, not what it measures")
    measures = paras[0] if paras else ""
    return Tool(name, measures, results[0] if results else ""), problems


def read_experiment(folder: str) -> Tuple[Experiment, List[str]]:
    topic, problems = os.path.basename(folder), []
    scripts = tuple(_scripts(folder))
    readme = os.path.join(folder, "README.md")
    question, text = "", ""
    if not os.path.isfile(readme):
        problems.append(f"{EXPERIMENTS}/{topic}: no README.md (the question, scripts, results)")
    else:
        with open(readme, encoding="utf-8") as f:
            text = f.read()
        paras = [p for p in _paragraphs(text) if not p.startswith("#")]
        question = paras[0] if paras else ""
        if not question:
            problems.append(f"{EXPERIMENTS}/{topic}/README.md: no paragraph (the question)")
    if not scripts:
        problems.append(f"{EXPERIMENTS}/{topic}: no script")
    for s in scripts:
        if text and s not in text:
            problems.append(f"{EXPERIMENTS}/{topic}/{s}: not named in its folder's README.md")
        if not _docstring(os.path.join(folder, s)).strip():
            problems.append(f"{EXPERIMENTS}/{topic}/{s}: no module docstring")
    return Experiment(topic, question, scripts), problems


def collect(root: str = HERE) -> Tuple[List[Tool], List[Experiment], List[str]]:
    """Every tool (a .py file directly in `root`) and experiment folder, and the problems."""
    tools, experiments, problems = [], [], []
    for name in _scripts(root):
        tool, bad = read_tool(os.path.join(root, name))
        tools.append(tool)
        problems += bad
    exp_dir = os.path.join(root, EXPERIMENTS)
    if os.path.isdir(exp_dir):
        for topic in sorted(os.listdir(exp_dir)):
            folder = os.path.join(exp_dir, topic)
            if os.path.isdir(folder) and not topic.startswith(("_", ".")):
                exp, bad = read_experiment(folder)
                experiments.append(exp)
                problems += bad
    return tools, experiments, problems


def render(tools: List[Tool], experiments: List[Experiment]) -> str:
    """The index: the tools' table, then the experiments' (Markdown, between the markers)."""
    lines = [
        "| script | what it measures | command that wrote the committed results |",
        "|---|---|---|",
    ]
    for t in tools:
        lines.append(f"| [`{t.name}`]({t.name}) | {_cell(t.measures)} | {_cell(t.results)} |")
    lines += [
        "",
        f"One-off experiments, each beside its write-up in `{EXPERIMENTS}/<topic>/` (its README: "
        "the question, the command, the result files and the doc section that reports them):",
        "",
        "| experiment | question | scripts |",
        "|---|---|---|",
    ]
    for e in experiments:
        where = f"{EXPERIMENTS}/{e.topic}/"
        scripts = ", ".join(f"`{s}`" for s in e.scripts)
        lines.append(f"| [`{where}`]({where}) | {_cell(e.question)} | {scripts} |")
    return "\n".join(lines) + "\n"


def _block(doc: str) -> str:
    a, b = doc.find(BEGIN), doc.find(END)
    if a < 0 or b < a:
        return ""
    return doc[a + len(BEGIN) : b].strip("\n") + "\n"


def replace_block(doc: str, text: str) -> str:
    """`doc` with the lines between its markers replaced by `text`."""
    a, b = doc.find(BEGIN), doc.find(END)
    if a < 0 or b < a:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return doc[: a + len(BEGIN)] + "\n" + text.strip("\n") + "\n" + doc[b:]


def listed(doc: str) -> List[str]:
    """The scripts the README's index lists (first column of its tools' table)."""
    return re.findall(r"^\| \[`([^`]+\.py)`\]", _block(doc), flags=re.M)


def check(root: str = HERE) -> List[str]:
    """What is wrong with `root`/README.md's index: the scripts' problems, the scripts it does
    not list (or lists but are gone), and whether its block differs from what --write writes."""
    tools, experiments, problems = collect(root)
    readme = os.path.join(root, "README.md")
    with open(readme, encoding="utf-8") as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        return problems + [f"README.md: no {BEGIN} ... {END} block"]
    have = set(listed(doc))
    problems += [f"{t.name}: not in README.md's index" for t in tools if t.name not in have]
    problems += [f"{n}: in README.md's index but not in benchmarks/" for n in sorted(have)
                 if n not in {t.name for t in tools}]  # fmt: skip
    if _block(doc) != render(tools, experiments):
        problems.append(
            "README.md's index differs from the scripts' docstrings: "
            "run `python benchmarks/index.py --write`"
        )
    return problems


def write(root: str = HERE) -> List[str]:
    """Rewrite the README's index; returns the problems that remain (the scripts' own)."""
    tools, experiments, problems = collect(root)
    readme = os.path.join(root, "README.md")
    with open(readme, encoding="utf-8") as f:
        doc = f.read()
    new = replace_block(doc, render(tools, experiments))
    if new != doc:
        with open(readme, "w", encoding="utf-8") as f:
            f.write(new)
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when the index is stale")
    mode.add_argument("--write", action="store_true", help="rewrite the README's index")
    ap.add_argument("--root", default=HERE, help="the benchmarks folder (default: this one)")
    args = ap.parse_args(argv)
    if args.check:
        problems = check(args.root)
    elif args.write:
        problems = write(args.root)
    else:
        tools, experiments, problems = collect(args.root)
        sys.stdout.write(render(tools, experiments))
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
