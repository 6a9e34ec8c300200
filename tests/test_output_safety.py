"""The output-safety rules of infer.py's `--json_out` (`batch_runner.run_prompts`), as properties
over many existing files and many ways a run can fail:

  * a run that fails (a bad input found by `generate`, an exception before the first batch is
    done) leaves an existing output file byte for byte as it was, and no temporary file;
  * a run interrupted after k batches leaves a valid prefix: complete records of exactly the
    batches done, equal to a clean run's, which `--resume` completes;
  * `--resume` refuses a file it does not recognise as its own record file, without changing it;
  * an output path that resolves to an input (prompt file, model file) is refused;
  * the resume key names a model directory by its real path, a hub id as typed;
  * without a decode step (max_new_tokens=1) no tau or speedup is invented.

One small random pair (no tokenizer: token-id prompts) is shared by the module; tiny
max_new_tokens, one prompt-length bucket, so the programs compile once.
"""

import json
import os
import random
import shutil
import types

import pytest

import dflash_jax as dj
from dflash_jax.decoding.generation import Generator
from dflash_jax.models.target import init_params
from dflash_jax.frontend import batch_runner, infer_flags, infer_run, report

MAX_NEW = 3
BATCH = 2
PROMPTS = [[(5 * i + 3 * j) % 90 + 2 for j in range(3 + i % 5)] for i in range(6)]  # 3 batches


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("output_safety")
    cfg = dj.ModelConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=64,
    )
    target = dj.Target(cfg, init_params(cfg, 0), path=str(root / "target"))
    dj.save_target(target, root / "target")
    dcfg = dj.make_drafter_config(cfg, num_layers=1, num_taps=1, block_size=4, mask_token_id=95)
    drafter = dj.Drafter(dcfg, dj.init_drafter_params(dcfg, 0))
    dj.save_drafter(drafter, root / "drafter")
    target = dj.load_target(str(root / "target"))
    drafter = dj.load_drafter(str(root / "drafter"), target=target)
    return root, target, drafter


@pytest.fixture(scope="module")
def clean(pair):
    """A clean run's records (the reference for prefixes) and its file's bytes."""
    root, target, drafter = pair
    out = str(root / "clean.jsonl")
    rep = batch_runner.run_prompts(
        target, drafter, PROMPTS, batch_size=BATCH, out_path=out, max_new_tokens=MAX_NEW
    )
    return rep.records, open(out, "rb").read()


def _run(pair, out, **kw):
    _, target, drafter = pair
    kw = dict(dict(batch_size=BATCH, max_new_tokens=MAX_NEW, warmup=False), **kw)
    out = None if out is None else str(out)
    return batch_runner.run_prompts(target, drafter, PROMPTS, out_path=out, **kw)


def _existing_files(clean_bytes):
    """Contents a user's file may have: another run's records, notes, JSON, binary, empty."""
    rng = random.Random(0)
    other = clean_bytes.replace(b'"settings": "', b'"settings": "x')
    yield "records_of_another_run", other
    yield "empty", b""
    yield "notes", b"my notes\nthe last line"
    yield "json_no_newline", b'{"a": 1}'
    yield "binary", bytes(rng.randrange(256) for _ in range(200))
    for k in range(3):
        yield (
            f"random_text_{k}",
            "".join(rng.choice('ab{}"\n: 0') for _ in range(rng.randrange(1, 80))).encode(),
        )


def _no_temp_files(folder):
    left = [n for n in os.listdir(folder) if n.endswith(".tmp")]
    assert not left, left


# A run that fails: a bad input `generate` finds, or a fault before the first batch is done.
FAILURES = {
    "denoise_steps": dict(denoise_steps=4),  # block size 4: at most 3
    "context_length": dict(max_new_tokens=100),  # past max_position_embeddings=64
    "stop_id": dict(stop_token_ids=[96]),  # outside the vocabulary
    "seed": dict(seed=2**63),  # beyond int64
}


@pytest.mark.parametrize("failure", sorted(FAILURES) + ["fault_in_first_batch"])
def test_a_failed_run_leaves_an_existing_file_byte_for_byte(
    pair, clean, tmp_path, monkeypatch, failure
):
    if failure == "fault_in_first_batch":

        def broken(*a, **k):
            raise RuntimeError("device lost")

        monkeypatch.setattr(Generator, "__call__", broken)
        kw, error = {}, RuntimeError
    else:
        kw, error = FAILURES[failure], ValueError
    for name, data in _existing_files(clean[1]):
        out = tmp_path / name
        out.write_bytes(data)
        with pytest.raises(error):
            _run(pair, out, **kw)
        assert out.read_bytes() == data, name
    _no_temp_files(tmp_path)


@pytest.mark.parametrize("stop_at", [1, 2, 3])
def test_an_interrupted_run_leaves_the_old_file_or_a_valid_prefix(
    pair, clean, tmp_path, monkeypatch, stop_at
):
    """Generation raises on batch `stop_at` (the 1st: before any result): the file is the old
    one, or the records of the batches done, equal to a clean run's; --resume completes it."""
    records, _ = clean
    real = Generator.__call__
    calls = []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return real(*a, **k)

    out = tmp_path / "out.jsonl"
    old = b'{"old": "a file the user had"}\n'
    out.write_bytes(old)
    monkeypatch.setattr(Generator, "__call__", flaky)
    with pytest.raises(KeyboardInterrupt):
        _run(pair, out)
    monkeypatch.setattr(Generator, "__call__", real)
    _no_temp_files(tmp_path)
    if stop_at == 1:
        assert out.read_bytes() == old
        return
    data = out.read_bytes()
    assert data.endswith(b"\n")
    kept = [json.loads(line) for line in data.splitlines()]
    assert sorted(r["batch"] for r in kept) == sorted([b for b in range(stop_at - 1)] * BATCH)
    for r in kept:
        assert r["tokens"] == records[r["index"]]["tokens"]
        assert r["settings"] == records[r["index"]]["settings"]
    # Killed in the middle of the next write: a torn line, dropped and replaced by --resume.
    with open(out, "ab") as f:
        f.write(batch_runner.RECORD_START + b'4, "prompt_sha": "12')
    rep = _run(pair, out, resume=True)
    assert rep.resumed == len(kept)
    assert [r["tokens"] for r in rep.records] == [r["tokens"] for r in records]
    lines = [json.loads(line) for line in out.read_bytes().splitlines()]
    assert sorted(r["index"] for r in lines) == list(range(len(PROMPTS)))


def test_resume_refuses_a_file_that_is_not_its_record_file_without_changing_it(
    pair, clean, tmp_path
):
    records_bytes = clean[1]
    first = records_bytes.splitlines(keepends=True)[0]
    cases = dict(_existing_files(records_bytes))
    del cases["empty"]  # nothing to lose: resumed as a file with no records
    cases.update(
        {
            "records_then_notes": first + b"a note\n",
            "records_then_a_json_line": first + b'{"a": 1}',
            "an_index_but_not_ours": b'{"index": 0}',
            "an_index_but_not_ours_newline": b'{"index": 0}\n',
            "a_torn_line_of_someone_else": first + b'{"name": "x", "va',
            "other_prompts": first.replace(b'"prompt_sha": "', b'"prompt_sha": "0'),
        }
    )
    for name, data in cases.items():
        out = tmp_path / name
        out.write_bytes(data)
        with pytest.raises(ValueError, match="not a record|different prompt|other generation"):
            _run(pair, out, resume=True)
        assert out.read_bytes() == data, name
    # Its own file with a torn last line is recognised, and read without being changed.
    torn = first + batch_runner.RECORD_START + b"1"
    out = tmp_path / "torn"
    out.write_bytes(torn)
    settings = json.loads(first)["settings"]
    done, keep = batch_runner.read_records(str(out), PROMPTS, settings)
    assert list(done) == [json.loads(first)["index"]] and keep == len(first)
    assert out.read_bytes() == torn
    _no_temp_files(tmp_path)


def test_an_output_that_resolves_to_an_input_is_refused(pair, tmp_path, monkeypatch):
    root = pair[0]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"ids": [1, 2]}\n')
    (tmp_path / "sub").mkdir()
    os.symlink(prompts, tmp_path / "link.jsonl")
    monkeypatch.chdir(tmp_path / "sub")
    for same in ("../p.jsonl", str(tmp_path / "sub" / ".." / "p.jsonl"), "../link.jsonl"):
        with pytest.raises(ValueError, match="is the --prompt_file"):
            infer_flags.output_not_input(same, "--json_out", {"--prompt_file": str(prompts)})
    infer_flags.output_not_input("../other.jsonl", "--json_out", {"--prompt_file": str(prompts)})
    # A model directory's files, also through a link (a hub snapshot links to its blobs).
    model = tmp_path / "model"
    model.mkdir()
    os.symlink(root / "target" / "config.json", model / "config.json")
    dirs = {"--target": str(model)}
    for bad in (str(model / "config.json"), str(root / "target" / "config.json")):
        with pytest.raises(ValueError, match="is a file of the --target"):
            infer_flags.output_not_input(bad, "--json_out", dirs=dirs)
    (model / "out.jsonl").write_text("an earlier run's output\n")
    for fine in (model / "new.jsonl", model / "out.jsonl"):  # not a file the loaders read
        infer_flags.output_not_input(str(fine), "--json_out", dirs=dirs)


def test_the_resume_key_is_the_models_real_path(pair, tmp_path, monkeypatch, capsys):
    """The same model by another relative path resumes; another model at the same relative
    path elsewhere is refused before it is loaded."""
    root = pair[0]
    a, b = tmp_path / "a", tmp_path / "b"
    for base in (a, b):  # two copies of the pair, each at models/ under its own directory
        for d in ("target", "drafter"):
            shutil.copytree(root / d, base / "models" / d)
    out = str(tmp_path / "out.jsonl")
    items = [{"ids": p} for p in PROMPTS[:2]]

    def run(cwd, target, drafter):
        monkeypatch.chdir(cwd)
        return infer_run.run_and_report(
            target, drafter, items, out_path=out, resume=True, max_new_tokens=MAX_NEW
        )

    first = run(a, "models/target", "models/drafter")
    assert first.resumed == 0
    again = run(a / "models", "./target", "../models/drafter")  # the same models
    assert again.resumed == 2
    before = open(out, "rb").read()
    with pytest.raises(ValueError, match="other generation settings"):
        run(b, "models/target", "models/drafter")  # other models at the same relative path
    assert open(out, "rb").read() == before
    assert batch_runner.model_identity("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"  # hub ids as typed
    capsys.readouterr()


def test_one_infer_run_reads_each_config_once(pair, monkeypatch, capsys):
    """`run_and_report` (infer.py's run) takes each model's config.json off the disk once:
    the pre-load checks and both loaders share the read (`checks.reading_once`); outside a
    run, every read is a read of the file as it is now."""
    import builtins

    from dflash_jax.support import checks

    root = pair[0]
    reads = []
    real_open = builtins.open

    def counting_open(file, mode="r", *a, **k):
        if str(file).endswith("config.json") and "r" in mode:
            reads.append(os.path.relpath(str(file), root))
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", counting_open)
    items = [{"ids": p} for p in PROMPTS[:2]]
    rep = infer_run.run_and_report(
        str(root / "target"), str(root / "drafter"), items, max_new_tokens=MAX_NEW
    )
    assert len(rep.records) == 2
    want = [os.path.join(m, "config.json") for m in ("drafter", "target")]
    assert sorted(reads) == want, reads  # (this pair has no generation_config.json)
    path = str(root / "target" / "config.json")
    reads.clear()
    with checks.reading_once():
        first = checks.json_object_file(path)
        first["vocab_size"] = -1  # a caller's change is its own
        assert checks.json_object_file(path)["vocab_size"] == 96 and len(reads) == 1
    checks.json_object_file(path)
    assert len(reads) == 2
    capsys.readouterr()


def test_no_decode_step_reports_no_tau_and_no_speedup(pair):
    """max_new_tokens=1: the one token comes from the prefill; tau and the speedup are n/a,
    not 0.00 and 0.00x."""
    rep = _run(pair, None, max_new_tokens=1, compare_ar=True)
    t = rep.totals
    assert t["new_tokens"] == len(PROMPTS) and t["tau"] is None and t["speedup"] is None
    assert all(r["tau"] is None for r in rep.records)
    lines = "\n".join(report.totals_lines(t, batch_size=BATCH, with_drafter=True))
    assert "tau n/a" in lines and "speedup n/a" in lines and "0.00" not in lines
    header = report.prompt_header(0, rep.records[0], BATCH)
    assert "tau n/a" in header and "tok/s" not in header


def test_sampled_comparison_says_what_was_compared():
    """At T > 0 DFlash equals autoregressive sampling in distribution: other tokens for the same
    seed are not reported as a failure ("!!!", "outputs identical: False"); greedy still is."""
    import io

    totals = dict(
        prompts=1, new_tokens=8, tau=2.0, tau_per_prompt=None, decode_tokens_per_s=10.0,
        prefill_s=0.01, speedup=1.5, ar_decode_tokens_per_s=6.7, identical_to_ar=False,
    )  # fmt: skip
    record = dict(totals, tokens=[1, 2], tokens_per_s=10.0)
    rep = types.SimpleNamespace(totals=totals, records=[record], resumed=0)
    for sampled in (True, False):
        out = io.StringIO()
        report.print_run(
            rep, [[1]], tokenizer=None, batch_size=1, with_drafter=True, json_out="x.jsonl",
            out=out, sampled=sampled,
        )  # fmt: skip
        text = out.getvalue()
        if sampled:
            assert "!!!" not in text and "outputs identical" not in text, text
            assert "other tokens" in text and "in distribution" in text, text
        else:
            assert "!!! speculative output differs" in text, text
            assert "outputs identical: False" in text, text
