"""benchmarks/draft_vocab_coverage.py end to end on the bundled tiny target: the coverage it
reports equals a NumPy count of the saved answers against the top K of the training records'
answer tokens (held-out tail left out), a rerun reads the answers cache, and bad input is one
line, exit 2, nothing written."""

import json
import os
import subprocess
import sys

import _pair
import numpy as np
import pytest

ROOT = _pair.ROOT
TARGET = os.path.join(_pair.PAIR, "target")
SCRIPT = os.path.join(ROOT, "benchmarks", "draft_vocab_coverage.py")


def _run(*args):
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def _files(tmp_path):
    """A prompts file (one text prompt, one of ids) and 10 regenerated records (both formats),
    answers: code the tokenizer encodes, the last two records a token repeated many times (held
    out at --holdout_fraction=0.2, so it must not enter the counts)."""
    from dflash_jax.data import load_tokenizer

    tok = load_tokenizer(TARGET)
    prompts = tmp_path / "code.jsonl"
    prompts.write_text(
        json.dumps({"prompt": _pair.CODE[0]}) + "\n"
        + json.dumps({"ids": list(tok.encode(_pair.CODE[3]))}) + "\n"
    )  # fmt: skip
    with open(os.path.join(ROOT, "benchmarks", "draft_vocab_coverage.py")) as f:
        text = f.read()
    chunks = [text[i : i + 400] for i in range(0, 3200, 400)]
    lines = []
    for i, c in enumerate(chunks):
        p, r = list(tok.encode(f"# {i}\n")), list(tok.encode(c))
        if i % 2:
            mask = [0] * len(p) + [1] * len(r)
            lines.append({"input_ids": p + r, "loss_mask": mask, "prompt_ids": p})
        else:
            lines.append({"prompt_ids": p, "response_ids": r})
    for _ in range(2):
        lines.append({"prompt_ids": [5], "response_ids": [7] * 500})
    responses = tmp_path / "responses.jsonl"
    responses.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(prompts), str(responses), lines


def _reference(lines, answers, k, vocab=4096):
    counts = np.zeros(vocab, np.int64)
    for rec in lines:
        if "input_ids" in rec:
            ids = np.asarray(rec["input_ids"])[np.asarray(rec["loss_mask"]) == 1]
        else:
            ids = np.asarray(rec["response_ids"])
        np.add.at(counts, ids, 1)
    top = np.argsort(-counts, kind="stable")[:k]  # ties: the lower id first
    flat = np.concatenate([np.asarray(a) for a in answers])
    return np.isin(flat, top).mean()


@pytest.mark.once  # a script end to end
def test_coverage_equals_a_numpy_count_and_the_cache_is_reused(tmp_path):
    prompts, responses, lines = _files(tmp_path)
    cache, out, md = tmp_path / "answers.json", tmp_path / "c.json", tmp_path / "c.md"
    args = [
        f"--responses={responses}", f"--target={TARGET}", f"--prompts_file={prompts}",
        "--num_prompts=2", "--max_new_tokens=12", "--batch_size=2", "--sizes=4,16",
        "--holdout_fraction=0.2", f"--answers_cache={cache}", f"--json_out={out}",
        f"--md_out={md}",
    ]  # fmt: skip
    ok = _run(*args)
    assert ok.returncode == 0, ok.stderr
    assert "code: generated 2 answers" in ok.stdout
    answers = json.loads(cache.read_text())["datasets"]["code"]["answers"]
    assert len(answers) == 2 and all(0 < len(a) <= 12 for a in answers)
    rec = json.loads(out.read_text())
    assert rec["command"].startswith("python benchmarks/draft_vocab_coverage.py") and rec["commit"]
    assert (rec["training_records"], rec["held_out_records"]) == (8, 2)
    by_k = {r["k"]: r for r in rec["coverage"]}
    train, held = lines[:8], lines[8:]
    for k in (4, 16):
        assert by_k[k]["code"] == pytest.approx(_reference(train, answers, k))
        train_answers = [
            np.asarray(r["input_ids"])[np.asarray(r["loss_mask"]) == 1]
            if "input_ids" in r
            else r["response_ids"]
            for r in train
        ]
        assert by_k[k]["training"] == pytest.approx(_reference(train, train_answers, k))
        held_answers = [r["response_ids"] for r in held]
        assert by_k[k]["held_out"] == pytest.approx(_reference(train, held_answers, k))
    assert by_k[4]["training"] < by_k[16]["training"] < 1 and by_k[16]["code"] > 0
    assert rec["datasets"]["code"]["tokens"] == sum(map(len, answers))
    assert "| 16 |" in md.read_text()
    again = _run(*args)  # the cache matches: no generation
    assert again.returncode == 0, again.stderr
    assert "code: 2 answers from" in again.stdout
    assert json.loads(out.read_text())["coverage"] == rec["coverage"]


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path):
    out, responses = tmp_path / "c.json", tmp_path / "r.jsonl"
    responses.write_text(json.dumps({"prompt_ids": [1], "response_ids": [2]}) + "\n")
    for args, words in (
        ([f"--responses={responses}", "--sizes=4,0"], "--sizes must be >= 1, got 0"),
        ([f"--responses={tmp_path / 'gone.jsonl'}"], "gone.jsonl: no such file"),
        ([f"--responses={responses}", "--sizes=5000"], "--sizes must be in [1, 4096]"),
    ):
        bad = _run(*args, f"--target={TARGET}", f"--json_out={out}")
        assert bad.returncode == 2, bad.stderr
        assert bad.stderr.startswith("error: ") and words in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and not out.exists()
