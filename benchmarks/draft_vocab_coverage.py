"""How much of the target's own answers a frequency-ranked draft vocabulary holds, per size K:
the measurement to make before choosing `drafter.draft_vocab_size` (FR-Spec's idea;
`dflash_jax/drafters/draft_vocab.py`).

  python benchmarks/draft_vocab_coverage.py --responses=runs/smollm2/responses6.jsonl \
      --target=smollm2-135m-instruct --datasets=mt_bench,humaneval --num_prompts=16 \
      --max_new_tokens=256 --batch_size=16 --answers_cache=runs/smollm2/coverage_answers.json \
      --json_out=benchmarks/results/smollm2/draft_vocab_coverage.json \
      --md_out=benchmarks/results/smollm2/draft_vocab_coverage.md

- Counts: the answer (loss-masked) tokens of the regenerated training records (`--responses`,
  one or more JSONL files read in order, as `dflash_jax.training.regenerate` writes them),
  without the held-out tail the trainer keeps for evaluation (`--holdout_fraction`, the
  config's `regen.holdout_fraction`: the last max(1, round(f * records)) records; 0 keeps all).
  The draft vocabulary of size K is the K most frequent (`draft_vocab.top_tokens`).
- Answers: the target's own greedy answers to the first `--num_prompts` rows of each dataset
  (MT-Bench turn 1, HumanEval in z-lab's instruction; `benchmarks/eval_tau.py`), through its
  chat template, autoregressive, stopped at the stop ids `compare_drafters.py` uses (the stop
  token, when written, counts as an answer token, as in the training records). Or the prompts
  of `--prompts_file` (JSONL: {"prompt": text} through the chat template, or {"ids": [...]}).
  `--answers_cache` keeps them: a rerun with the same target, prompts, max_new_tokens and stop
  ids reads them instead of generating.
- Coverage: the fraction of the answer tokens inside the top K. A drafter whose head holds only
  those K rows can propose the target's token at exactly those positions, so this is the
  ceiling on its per-position accuracy against the full head. Also given for the training
  answers the counts come from, and for the held-out tail (answers of the same distribution
  that the counts did not see).

Bad input (a missing file, a size outside [1, vocabulary], an unwritable output) is one
`error: ...` line and exit status 2, before any compute. Writes `--json_out` (provenance,
every figure) and `--md_out` (the table).

Committed results: `python benchmarks/draft_vocab_coverage.py
--responses=runs/smollm2/responses6.jsonl --target=smollm2-135m-instruct
--datasets=mt_bench,humaneval --num_prompts=16 --max_new_tokens=256 --batch_size=16
--answers_cache=runs/smollm2/coverage_answers.json
--json_out=benchmarks/results/smollm2/draft_vocab_coverage.json
--md_out=benchmarks/results/smollm2/draft_vocab_coverage.md`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import drafter_grid, eval_tau  # noqa: E402

FLAGS = flags.FLAGS
TRAINING, HELD_OUT = "training", "held_out"


def define_flags():
    """The flags (defined when run as a script, so tests can import this module)."""
    flags.DEFINE_list("responses", None, "Regenerated training JSONL file(s), comma-separated.")
    flags.DEFINE_float(
        "holdout_fraction", 0.02, "Tail of the records held out of the counts (regen's)."
    )
    flags.DEFINE_string("target", "smollm2-135m-instruct", "Target directory, GGUF or name.")
    flags.DEFINE_list("datasets", ["mt_bench", "humaneval"], "Datasets (eval_tau's sources).")
    flags.DEFINE_string(
        "prompts_file", None, 'Instead of --datasets: JSONL of {"prompt": text} or {"ids": [...]}.'
    )
    flags.DEFINE_integer("num_prompts", 16, "Rows per dataset (the first ones).")
    flags.DEFINE_integer("max_new_tokens", 256, "Tokens per answer.")
    flags.DEFINE_integer("batch_size", 16, "Prompts per generate call.")
    flags.DEFINE_list("sizes", ["4096", "8192", "16384", "32768"], "Draft vocabulary sizes K.")
    flags.DEFINE_string(
        "answers_cache", None, "JSON of the generated answers (read if it matches)."
    )
    flags.DEFINE_string("json_out", None, "Write the results here (JSON).")
    flags.DEFINE_string("md_out", None, "Write the table here (Markdown).")


def parse_sizes(values: Sequence[str], vocab_size: Optional[int] = None) -> List[int]:
    """--sizes as distinct integers in [1, vocab_size] (one line for a bad one)."""
    from dflash_jax.support import checks

    out = []
    for v in values:
        try:
            k = int(str(v).strip())
        except ValueError:
            raise ValueError(f"--sizes: {v!r} is not an integer") from None
        out.append(checks.int_param("--sizes", k, lo=1, hi=vocab_size))
    if not out or len(set(out)) != len(out):
        raise ValueError(f"--sizes: give one or more distinct sizes, got {list(values)}")
    return out


def holdout_count(n_records: int, fraction: float) -> int:
    """Records the trainer holds out at the end (`experiment`'s rule; 0 for a fraction of 0)."""
    return 0 if fraction == 0 else max(1, int(round(fraction * n_records)))


def read_training(paths: Sequence[str], vocab_size: int, fraction: float):
    """(training records, held-out records) of the response files, concatenated in order."""
    from dflash_jax.training.regenerate import read_records

    records = [r for p in paths for r in read_records(p, vocab_size=vocab_size)]
    n_eval = holdout_count(len(records), fraction)
    if len(records) - n_eval < 1:
        raise ValueError(
            f"--responses: {len(records)} record(s), {n_eval} held out: none left to count"
        )
    return records[: len(records) - n_eval], records[len(records) - n_eval :]


def answer_counts(answers: Sequence[Sequence[int]], vocab_size: int) -> np.ndarray:
    """int64 [V]: how often each token occurs in the answers."""
    flat = np.fromiter((t for a in answers for t in a), np.int64)
    return np.bincount(flat, minlength=vocab_size)[:vocab_size].astype(np.int64)


def coverage_rows(counts: np.ndarray, answers: Dict[str, np.ndarray], sizes: Sequence[int]):
    """[{"k", <name>: coverage, ...}] per size: the fraction of each set of answer-token counts
    inside the top k of `counts`."""
    from dflash_jax.drafters import draft_vocab as dv

    rows = []
    for k in sizes:
        vocab = dv.top_tokens(counts, k)
        rows.append(dict(k=k, **{name: dv.coverage(c, vocab) for name, c in answers.items()}))
    return rows


def markdown(rows: List[dict], names: List[str], tokens: Dict[str, int], vocab_size: int) -> str:
    head = "| K | K / V | " + " | ".join(f"{n} ({tokens[n]:,} tokens)" for n in names) + " |"
    lines = [head, "|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = [f"{r['k']:,}", f"{r['k'] / vocab_size:.3f}"] + [f"{r[n]:.4f}" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _load_cache(path: Optional[str], key: dict) -> dict:
    """{dataset: entry} of a cache written with the same `key` ({} if absent or another key)."""
    if not path or not os.path.exists(path):
        return {}
    from dflash_jax.support import checks

    cache = checks.json_object_file(path)
    if not isinstance(cache.get("datasets"), dict):
        raise ValueError(f"--answers_cache {path}: no 'datasets' object")
    return cache["datasets"] if cache.get("key") == key else {}


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def generate_answers(target, prompts, max_new_tokens, batch_size, stop) -> List[List[int]]:
    """The target's greedy answers (autoregressive), in fixed-size batches (the last padded)."""
    from dflash_jax import generate

    out = []
    for b0 in range(0, len(prompts), batch_size):
        batch = prompts[b0 : b0 + batch_size]
        padded = batch + [batch[-1]] * (batch_size - len(batch))  # one program per shape
        res = generate(target, None, padded, max_new_tokens, stop_token_ids=stop)
        out += [[int(t) for t in r] for r in res.tokens[: len(batch)]]
    return out


def main(argv):
    del argv
    from dflash_jax.models import hub
    from dflash_jax.models.checkpoint import read_target_config
    from dflash_jax.support import checks, provenance

    if not FLAGS.responses:
        raise ValueError("--responses: give one or more regenerated JSONL files")
    checks.int_param("--num_prompts", FLAGS.num_prompts, lo=1)
    checks.int_param("--max_new_tokens", FLAGS.max_new_tokens, lo=1)
    checks.int_param("--batch_size", FLAGS.batch_size, lo=1)
    frac = checks.float_param("--holdout_fraction", FLAGS.holdout_fraction, 0.0, 1.0)
    parse_sizes(FLAGS.sizes)
    if FLAGS.prompts_file and FLAGS["datasets"].present:
        raise ValueError("give --datasets or --prompts_file, not both")
    for p in FLAGS.responses:
        if not os.path.isfile(p):
            raise ValueError(f"--responses: {p}: no such file")
    if FLAGS.prompts_file and not os.path.isfile(FLAGS.prompts_file):
        raise ValueError(f"--prompts_file: {FLAGS.prompts_file}: no such file")
    for name in ("json_out", "md_out", "answers_cache"):
        if FLAGS[name].value:
            checks.writable_file(FLAGS[name].value, f"--{name}")
    target_dir = hub.resolve_or_exit(FLAGS.target, what="--target")
    vocab_size = read_target_config(target_dir).vocab_size
    sizes = parse_sizes(FLAGS.sizes, vocab_size)
    train, held = read_training(FLAGS.responses, vocab_size, frac)

    from dflash_jax.data import load_tokenizer, prompting
    from dflash_jax.data.chat import template_renderer
    from dflash_jax.drafters import draft_vocab as dv
    from dflash_jax.training.regenerate import record_tokens

    tok = load_tokenizer(target_dir)
    render, how = template_renderer(target_dir, True)
    stop = eval_tau._stop_ids(target_dir, tok)
    if FLAGS.prompts_file:
        items, labels = prompting.read_prompt_file(FLAGS.prompts_file, with_labels=True)
        items, labels = items[: FLAGS.num_prompts], labels[: FLAGS.num_prompts]
        name = os.path.splitext(os.path.basename(FLAGS.prompts_file))[0]
        ids = prompting.encode_prompts(items, tok, target_dir, True, vocab_size, labels)
        prompts = {name: (ids, FLAGS.prompts_file)}
    else:
        prompts = {}
        for d in FLAGS.datasets:
            turns, source = eval_tau.load_prompts(d, None, "auto", FLAGS.num_prompts)
            prompts[d] = (drafter_grid.chat_prompts(tok, render, turns), source)
    key = dict(target=os.path.abspath(target_dir), max_new_tokens=FLAGS.max_new_tokens)
    key["stop_ids"] = list(stop)
    cached = _load_cache(FLAGS.answers_cache, key)

    answers, target = {}, None
    for d, (ids, source) in prompts.items():
        entry = cached.get(d)
        if entry is not None and entry.get("prompts") == ids:
            answers[d] = entry["answers"]
            print(f"{d}: {len(ids)} answers from {FLAGS.answers_cache}", flush=True)
            continue
        if target is None:
            from dflash_jax.models.target import load_target
            from dflash_jax.support import console

            console.cli_startup()
            target = load_target(target_dir)
        answers[d] = generate_answers(target, ids, FLAGS.max_new_tokens, FLAGS.batch_size, stop)
        print(f"{d}: generated {len(ids)} answers", flush=True)
        cached[d] = dict(prompts=ids, answers=answers[d], source=source)
        if FLAGS.answers_cache:
            _write_json(FLAGS.answers_cache, dict(key=key, datasets=cached))

    counts = dv.token_counts(train, record_tokens, vocab_size)
    measured = {d: answer_counts(a, vocab_size) for d, a in answers.items()}
    measured[TRAINING] = counts
    if held:
        measured[HELD_OUT] = dv.token_counts(held, record_tokens, vocab_size)
    names = list(measured)
    rows = coverage_rows(counts, measured, sizes)
    tokens = {n: int(c.sum()) for n, c in measured.items()}
    table = markdown(rows, names, tokens, vocab_size)
    table += (
        f"\nCoverage: the fraction of each set's answer tokens inside the K most frequent "
        f"answer tokens of {len(train):,} training records ({len(held)} held out; "
        f"V = {vocab_size:,}). Target answers: greedy, {FLAGS.max_new_tokens} new tokens at "
        f"most, {FLAGS.num_prompts} prompts per dataset.\n"
    )
    print("\n" + table)
    stats = {
        d: dict(
            answers=len(a),
            tokens=tokens[d],
            distinct=int((measured[d] > 0).sum()),
            stopped=sum(1 for x in a if x and x[-1] in stop),
            source=prompts[d][1],
        )
        for d, a in answers.items()
    }
    rec = dict(
        provenance.record(),
        target=FLAGS.target,
        vocab_size=vocab_size,
        responses=list(FLAGS.responses),
        holdout_fraction=frac,
        training_records=len(train),
        held_out_records=len(held),
        training_tokens=tokens[TRAINING],
        training_distinct=int((counts > 0).sum()),
        prompts=how,
        num_prompts=FLAGS.num_prompts,
        max_new_tokens=FLAGS.max_new_tokens,
        stop_ids=list(stop),
        answers_cache=FLAGS.answers_cache,
        datasets=stats,
        sizes=sizes,
        coverage=rows,
    )
    if FLAGS.json_out:
        _write_json(FLAGS.json_out, rec)
    if FLAGS.md_out:
        with open(FLAGS.md_out, "w") as f:
            f.write(table)
    written = [p for p in (FLAGS.json_out, FLAGS.md_out) if p]
    if written:
        print("wrote " + ", ".join(written))


if __name__ == "__main__":
    from dflash_jax.support import cli

    define_flags()
    cli.run(main)
