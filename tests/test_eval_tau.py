"""benchmarks/eval_tau.py: datasets in their own schemas, both tau definitions, the table."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "eval_tau.py")

# A benchmark script end to end over the public API the other files test on both jax versions:
# once, in the oldest jax's suite.
pytestmark = pytest.mark.once
PAIR = os.path.join(ROOT, "assets", "tiny-code")

from benchmarks import eval_tau

# One small file per dataset, each in the dataset's own schema (extra fields as the real sets
# have them).
FIXTURES = {
    "gsm8k": [{"question": "Tom has 3 apples and buys 2. How many?", "answer": "#### 5"}],
    "math500": [{"problem": "Compute $1+1$.", "answer": "2"}],
    "humaneval": [{"task_id": "HumanEval/0", "prompt": 'def add(a, b):\n    """Sum."""\n'}],
    "mbpp": [{"task_id": 1, "text": "Write a function to reverse a list.", "code": ""}],
    "mt_bench": [{"turns": ["Write a loop over a list.", "Now make it a while loop."]}],
    "alpaca": [{"instruction": "Sort these numbers.", "input": "3, 1, 2", "output": ""}],
}
TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant\n{% endif %}"
)


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")


def _write_fixtures(d, names=FIXTURES):
    os.makedirs(d, exist_ok=True)
    for name in names:
        with open(os.path.join(d, f"{name}.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in FIXTURES[name]))


def test_tau_definitions_by_hand():
    acc = [[1, 1, 4], [3], []]
    assert eval_tau.tau_per_prompt(acc) == pytest.approx((2 + 3) / 2)  # z-lab
    assert eval_tau.tau_all_steps(acc) == pytest.approx(9 / 4)


def test_each_schema_becomes_the_benchmark_prompt(tmp_path):
    _write_fixtures(str(tmp_path))
    got = {n: eval_tau.load_prompts(n, str(tmp_path))[0] for n in FIXTURES}
    assert got["gsm8k"][0][0].startswith("Tom has 3") and "\\boxed{}" in got["gsm8k"][0][0]
    assert got["math500"][0][0].startswith("Compute $1+1$.\nPlease reason step by step")
    assert "```python\ndef add(a, b):" in got["humaneval"][0][0]
    assert got["mbpp"][0] == ["Write a function to reverse a list."]
    assert got["mt_bench"][0] == FIXTURES["mt_bench"][0]["turns"]
    assert got["alpaca"][0] == ["Sort these numbers.\n\n3, 1, 2"]
    src = eval_tau.load_prompts("mbpp", str(tmp_path))[1]
    assert src == f"JSONL file {tmp_path / 'mbpp.jsonl'}"


@pytest.fixture(scope="module")
def templated_pair(tmp_path_factory):
    """The bundled pair, its target given a chat template (MT-Bench is multi-turn)."""
    d = str(tmp_path_factory.mktemp("pair"))
    shutil.copytree(os.path.join(PAIR, "target"), os.path.join(d, "target"))
    path = os.path.join(d, "target", "tokenizer_config.json")
    cfg = json.load(open(path))
    cfg["chat_template"] = TEMPLATE
    json.dump(cfg, open(path, "w"))
    return os.path.join(d, "target"), os.path.join(PAIR, "drafter")


def test_eval_reports_both_taus_speedup_and_table(templated_pair, tmp_path):
    target, drafter = templated_pair
    data = str(tmp_path / "data")
    _write_fixtures(data)
    out_json, out_md = str(tmp_path / "tau.json"), str(tmp_path / "tau.md")
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            f"--target={target}",
            f"--drafter={drafter}",
            "--datasets=" + ",".join(FIXTURES),
            "--temperature=0",
            "--max_new_tokens=12",
            f"--data_dir={data}",
            f"--json_out={out_json}",
            f"--md_out={out_md}",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in FIXTURES:  # the source of each dataset is named
        assert f"{name}: 1 rows from JSONL file {os.path.join(data, name)}.jsonl" in proc.stdout
    assert "prompts: chat template of" in proc.stdout
    res = json.load(open(out_json))
    assert list(res["datasets"]) == list(FIXTURES) and res["block_size"] == 16
    for name, r in res["datasets"].items():
        per = r["per_response"]
        assert r["responses"] == len(per) == (2 if name == "mt_bench" else 1)
        acc = [p["acceptance"] for p in per]
        # Both definitions from the per-step acceptance the run returned, by hand.
        by_prompt = sum(sum(a) / len(a) for a in acc) / len(acc)
        by_step = sum(map(sum, acc)) / sum(map(len, acc))
        assert r["tau"] == pytest.approx(by_prompt) and r["tau_steps"] == pytest.approx(by_step)
        assert r["steps"] == sum(map(len, acc))
        for p in per:
            assert all(1 <= a <= 16 for a in p["acceptance"])
            # Tokens after prefill's first one come from the steps (the last may pass a stop).
            assert sum(p["acceptance"]) >= p["new_tokens"] - 1
            assert p["same_tokens"] and p["ar_new_tokens"] == p["new_tokens"]  # lossless, T=0
        timed = [p for p in per if p["tpot_s"] and p["ar_tpot_s"]]
        expect = sum(p["ar_tpot_s"] for p in timed) / sum(p["tpot_s"] for p in timed)
        assert r["speedup"] == pytest.approx(expect)
    # MT-Bench's second turn saw the first answer: its prompt is longer than turn 1's + answer.
    mt = res["datasets"]["mt_bench"]["per_response"]
    assert mt[1]["prompt_tokens"] > mt[0]["prompt_tokens"] + mt[0]["new_tokens"]
    table = open(out_md).read()
    assert "| Dataset | Speedup | tau | tau (steps) |" in table and "| **Average** |" in table
    for name, r in res["datasets"].items():
        assert f"| {name} | {r['speedup']:.2f}x | {r['tau']:.2f} | {r['tau_steps']:.2f} |" in table
    assert table in proc.stdout


class _FakeHFDataset:
    """The part of `datasets.Dataset` eval_tau uses: len, select, rows as mappings."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def select(self, indices):
        return _FakeHFDataset([self.rows[i] for i in indices])

    def __iter__(self):
        return iter(self.rows)


def test_hugging_face_source_reads_each_schema(monkeypatch, tmp_path):
    """No JSONL file: `datasets.load_dataset` (a stand-in module: no hub here) is asked for the
    paper's set, and its rows (mt_bench's as the hub stores them, in "prompt") become the same
    prompts as the JSONL fixtures; `limit` is honoured and the source is named."""
    calls = []
    hub_rows = dict(FIXTURES, mt_bench=[{"prompt": FIXTURES["mt_bench"][0]["turns"]}])

    def load_dataset(path, *config, split):
        calls.append((path, config, split))
        name = next(n for n, src in eval_tau.SOURCES.items() if src[0][0] == path)
        return _FakeHFDataset(hub_rows[name] * 3)

    fake = type(sys)("datasets")
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    _write_fixtures(tmp_path / "jsonl")
    for name in FIXTURES:
        want = eval_tau.load_prompts(name, str(tmp_path / "jsonl"))[0]
        got, src = eval_tau.load_prompts(name, str(tmp_path / "empty"), source="hf", limit=2)
        assert got == want * 2, name
        path, config, split = eval_tau.SOURCES[name][0]
        assert src.startswith(f"Hugging Face datasets {path}") and src.endswith(split), src
        assert calls[-1] == (path, (config,) if config else (), split)


def test_installed_packages_serve_mt_bench_and_humaneval():
    """No --data_dir: MT-Bench's 80 two-turn questions and HumanEval's 164 problems come from
    their installed packages, HumanEval wrapped in the benchmark's instruction."""
    mt, src = eval_tau.load_prompts("mt_bench", None)
    assert len(mt) == 80 and all(len(t) == 2 for t in mt) and src.endswith("question.jsonl")
    he, src = eval_tau.load_prompts("humaneval", None, limit=5)
    assert len(he) == 5 and src.endswith("HumanEval.jsonl.gz")
    assert he[0][0].startswith("Write a solution") and "def has_close_elements" in he[0][0]
    assert len(eval_tau.load_prompts("humaneval", None)[0]) == 164


def test_tfds_source_when_hugging_face_is_missing(monkeypatch):
    """Without the `datasets` package, gsm8k comes from TFDS (its builder module imported first:
    without TensorFlow the catalog holds only imported builders); TFDS data mocked offline."""
    import tensorflow_datasets as tfds  # a runtime dependency (requirements.txt)

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with tfds.testing.mock_data(num_examples=5):
        rows, src = eval_tau.load_prompts("gsm8k", None, limit=3)
    assert src == "TFDS gsm8k, test" and len(rows) == 3
    assert all(len(r) == 1 and r[0].endswith("within \\boxed{}.") for r in rows)
    with pytest.raises(ValueError, match="math500: no source .*TFDS: not in the TFDS catalog"):
        eval_tau.load_prompts("math500", None)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--datasets=math500"], "error: dataset math500: no source ("),
        (["--datasets=gsm8k,nope"], "error: unknown dataset 'nope'"),
        (["--datasets=gsm8k", "BAD"], ":2: needs a non-empty string 'question'"),
    ],
)
def test_missing_or_bad_data_is_one_line_exit_2(tmp_path, args, message):
    data = tmp_path / "data"
    data.mkdir()
    if "BAD" in args:
        args = [a for a in args if a != "BAD"]
        (data / "gsm8k.jsonl").write_text(
            json.dumps({"question": "ok"}) + "\n" + json.dumps({"answer": "no question"}) + "\n"
        )
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            f"--target={PAIR}/target",
            f"--drafter={PAIR}/drafter",
            f"--data_dir={data}",
            *args,
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    if "no source" in message:  # says what was tried and how to fix it
        assert "math500.jsonl: no such file" in lines[0] and "'problem' per line" in lines[0]


def test_batched_responses_match_batch_one():
    """--batch_size > 1: turn k of all rows in one generate call (padded to the batch), turn 2
    over the row's own turn-1 answer; the same responses and tokens as batch 1 (greedy), every
    one equal to autoregressive decoding, the drafter accepted; no timing."""
    import dflash_jax as dj
    from dflash_jax.data import load_tokenizer

    target = dj.load_target(os.path.join(PAIR, "target"))
    drafter = dj.load_drafter(os.path.join(PAIR, "drafter"), target=target)
    tok = load_tokenizer(os.path.join(PAIR, "target"))
    rows = [
        ["def add(a, b):", "def sub(a, b):"],
        ["import os\n\n\ndef read(path):"],
        ["class Stack:\n    def push(self, x):", "    def pop(self):"],
    ]
    render = lambda msgs: "\n".join(m["content"] for m in msgs)  # noqa: E731
    kw = dict(temperature=0.0, max_new_tokens=24, stop_ids=(tok.eos_id,), seed=0)
    one = eval_tau.evaluate_dataset(target, drafter, rows, render, tok.encode, tok.decode, **kw)
    two = eval_tau.evaluate_dataset(
        target, drafter, rows, render, tok.encode, tok.decode, batch_size=2, **kw
    )
    assert two["speedup"] is None and one["speedup"] is not None
    key = lambda r: (r["row"], r["turn"])  # noqa: E731
    a = sorted(one["per_response"], key=key)
    b = sorted(two["per_response"], key=key)
    assert [key(r) for r in a] == [key(r) for r in b] and len(b) == 5
    assert all(r["same_tokens"] for r in a + b)
    assert [(r["prompt_tokens"], r["new_tokens"]) for r in a] == [
        (r["prompt_tokens"], r["new_tokens"]) for r in b
    ]
    second = next(r for r in b if key(r) == (0, 1))
    first = next(r for r in b if key(r) == (0, 0))
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["new_tokens"] - 1
    assert max(x for r in b for x in r["acceptance"]) >= 3  # the drafter is accepted
    assert abs(two["tau"] - one["tau"]) < 0.25
