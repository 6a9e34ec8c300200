"""Tests of dflash_jax.data: TFDS builders, tokenizer, packing, batching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import array_record  # noqa: F401 - a runtime dependency (requirements.txt): imported, not skipped
import numpy as np
import pytest
import tensorflow_datasets as tfds
import tokenizers

from dflash_jax import data as D
from dflash_jax.data import builders as B
from dflash_jax.data import prompts as P

tfds.disable_progress_bar()

REPO_ROOT = Path(__file__).resolve().parents[1]
SUBSET = 40
VAL_PCT = 25.0


# ----------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_builder(tmp_path_factory):
    return D.build_python_stdlib(
        tmp_path_factory.mktemp("tfds"), max_files=SUBSET, validation_percent=VAL_PCT
    )


@pytest.fixture(scope="module")
def stdlib_splits(stdlib_builder):
    out = {}
    for split in stdlib_builder.info.splits:
        src = stdlib_builder.as_data_source(split=split)
        out[split] = [D.decode_example(src[i]) for i in range(len(src))]
    return out


@pytest.fixture(scope="module")
def tok(stdlib_splits, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    texts = list(D.iter_texts(stdlib_splits["train"]))
    assert texts == [ex["text"] for ex in stdlib_splits["train"]]
    return D.train_bpe_tokenizer(texts, out, vocab_size=1024), out


# ----------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------


def test_split_of_is_deterministic_and_near_rate():
    keys = [f"pkg/mod_{i}.py" for i in range(4000)]
    first = [B.split_of(k, 5.0) for k in keys]
    assert first == [B.split_of(k, 5.0) for k in keys]
    frac = first.count("validation") / len(keys)
    assert 0.03 < frac < 0.07
    assert all(B.split_of(k, 0.0) == "train" for k in keys[:200])
    assert all(B.split_of(k, 100.0) == "validation" for k in keys[:200])
    # A larger held-out fraction only moves files train -> validation.
    for k in keys[:500]:
        if B.split_of(k, 5.0) == "validation":
            assert B.split_of(k, 10.0) == "validation"
    with pytest.raises(ValueError):
        B.split_of("x", 101.0)


def test_stdlib_file_listing():
    files = B.list_stdlib_files(max_files=SUBSET)
    assert len(files) == SUBSET and files == sorted(files)
    assert files == B.list_stdlib_files(max_files=SUBSET)  # deterministic subset
    full = B.list_stdlib_files()
    assert len(full) > 300 and set(files) <= set(full)
    root = Path(B._default_stdlib_dir())
    for rel in full:
        parts = rel.split("/")
        assert rel.endswith(".py")
        assert not set(parts[:-1]) & {"test", "tests", "idle_test", "site-packages"}
        assert 0 < (root / rel).stat().st_size <= 300_000


def test_stdlib_listing_with_test_suites(tmp_path):
    # A fake stdlib tree: the test suites join only with include_tests, and every library file
    # keeps its split (so a held-out library file stays held out in the larger corpus).
    for rel in (
        "a.py",
        "pkg/b.py",
        "test/test_a.py",
        "pkg/tests/t.py",
        "idlelib/idle_test/x.py",
        "site-packages/dep.py",
        "pkg/empty.py",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("" if rel.endswith("empty.py") else "x = 1\n")
    lib = B.list_stdlib_files(tmp_path)
    both = B.list_stdlib_files(tmp_path, include_tests=True)
    assert lib == ["a.py", "pkg/b.py"]
    assert both == [
        "a.py",
        "idlelib/idle_test/x.py",
        "pkg/b.py",
        "pkg/tests/t.py",
        "test/test_a.py",
    ]
    c0, c1 = B.stdlib_config(), B.stdlib_config(include_tests=True)
    assert c0.name != c1.name and c1.include_tests and not c0.include_tests
    real = B.list_stdlib_files()
    real_all = B.list_stdlib_files(include_tests=True)
    assert set(real) < set(real_all) and len(real_all) > 2 * len(real)


def test_stdlib_split_disjoint_by_file_and_reads_back(stdlib_builder, stdlib_splits):
    assert set(stdlib_splits) == {"train", "validation"}
    train = [ex["path"] for ex in stdlib_splits["train"]]
    val = [ex["path"] for ex in stdlib_splits["validation"]]
    assert len(train) == len(set(train)) and len(val) == len(set(val))
    assert not set(train) & set(val)
    expected = set(B.list_stdlib_files(max_files=SUBSET))
    assert set(train) | set(val) == expected  # (all stdlib files here are UTF-8)
    for p in train:
        assert B.split_of(p, VAL_PCT) == "train"
    for p in val:
        assert B.split_of(p, VAL_PCT) == "validation"
    # The data source returns exactly the file contents that were written.
    root = Path(B._default_stdlib_dir())
    for split in ("train", "validation"):
        for ex in stdlib_splits[split]:
            assert ex["text"] == (root / ex["path"]).read_bytes().decode("utf-8")
    info = stdlib_builder.info
    assert info.splits["train"].num_examples == len(train)
    assert info.splits["validation"].num_examples == len(val)


def test_stdlib_build_is_deterministic_and_reused(stdlib_splits, tmp_path):
    b2 = D.build_python_stdlib(tmp_path, max_files=SUBSET, validation_percent=VAL_PCT)
    for split, exs in stdlib_splits.items():
        src = b2.as_data_source(split=split)
        assert [D.decode_example(src[i])["path"] for i in range(len(src))] == [
            ex["path"] for ex in exs
        ]
    files = sorted(Path(b2.data_dir).glob("*array_record*"))
    assert files
    mtimes = [f.stat().st_mtime_ns for f in files]
    b3 = D.build_python_stdlib(tmp_path, max_files=SUBSET, validation_percent=VAL_PCT)
    assert b3.data_dir == b2.data_dir
    assert [f.stat().st_mtime_ns for f in files] == mtimes  # not rebuilt


def test_empty_split_is_left_out(tmp_path):
    b = D.build_python_stdlib(tmp_path, max_files=3, validation_percent=0.0)
    assert set(b.info.splits) == {"train"}
    assert len(b.as_data_source(split="train")) == 3


def test_builders_do_not_need_tensorflow(tmp_path):
    """Build and read both builders in a fresh process; TF is never imported.

    TensorFlow is not a dependency of this project (and is not installed in
    its CI); checking ``sys.modules`` also holds where it happens to be
    installed, since tensorflow-datasets only imports it lazily.
    """
    (tmp_path / "a.txt").write_text("one doc\n\nanother doc\n")
    script = textwrap.dedent(
        f"""
        import sys
        import tensorflow_datasets as tfds
        tfds.disable_progress_bar()
        from dflash_jax.data import builders as B
        b = B.build_python_stdlib({str(tmp_path / "d")!r}, max_files=5, validation_percent=0)
        src = b.as_data_source(split="train")
        assert len(src) == 5 and isinstance(src[0]["text"], bytes)
        u = B.build_user_files([{str(tmp_path / "a.txt")!r}], {str(tmp_path / "d")!r},
                               text_mode="blank_line")
        texts = sorted(x["text"] for x in u.as_data_source(split="train"))
        assert texts == [b"another doc", b"one doc"], texts
        tf_mods = [m for m in sys.modules if m == "tensorflow" or m.startswith("tensorflow.")]
        assert not tf_mods, f"tensorflow got imported: {{tf_mods[:5]}}"
        print("TF-FREE-OK")
        print("SPLITS", [B.split_of(f"pkg/m{{i}}.py", 50.0) for i in range(64)])
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TF-FREE-OK" in proc.stdout
    # split_of gives the same answer in another process (no salted hash()).
    expected = [B.split_of(f"pkg/m{i}.py", 50.0) for i in range(64)]
    assert f"SPLITS {expected}" in proc.stdout


def _read_all(builder, split):
    src = builder.as_data_source(split=split)
    return [D.decode_example(src[i]) for i in range(len(src))]


def test_user_files_text_and_jsonl(tmp_path):
    doc_a = "first file\n\twith a tab and unicode: é ☃\n"
    (tmp_path / "a.txt").write_text(doc_a, encoding="utf-8")
    (tmp_path / "b.txt").write_text(
        "doc one\nline 2\n\n\n  \ndoc two\n\ndoc three", encoding="utf-8"
    )
    records = [
        {"text": "plain json text"},
        {"prompt": "Q: 2+2?\n", "response": "A: 4"},
        {"prompt": "Say hi", "completion": " hi"},
    ]
    (tmp_path / "c.jsonl").write_text(
        "\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8"
    )
    paths = [tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.jsonl"]

    per_file = D.build_user_files(paths, tmp_path / "tfds")
    exs = _read_all(per_file, "train")
    texts = sorted(ex["text"] for ex in exs if ex["text"])
    assert texts == sorted(
        [doc_a, "doc one\nline 2\n\n\n  \ndoc two\n\ndoc three", "plain json text"]
    )
    pairs = sorted((ex["prompt"], ex["response"]) for ex in exs if ex["prompt"])
    assert pairs == sorted([("Q: 2+2?\n", "A: 4"), ("Say hi", " hi")])
    assert all(ex["source"] for ex in exs)

    by_doc = D.build_user_files(paths[1:2], tmp_path / "tfds", text_mode="blank_line")
    docs = sorted(ex["text"] for ex in _read_all(by_doc, "train"))
    assert docs == sorted(["doc one\nline 2", "doc two", "doc three"])

    # With a validation split every example is in exactly one split.
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(60)))
    split_b = D.build_user_files([many], tmp_path / "tfds", validation_percent=30.0)
    tr = [ex["text"] for ex in _read_all(split_b, "train")]
    va = [ex["text"] for ex in _read_all(split_b, "validation")]
    assert not set(tr) & set(va)
    assert sorted(tr + va) == sorted(f"doc {i}" for i in range(60))
    assert 5 <= len(va) <= 35

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    with pytest.raises(Exception, match="expected 'text'"):
        D.build_user_files([bad], tmp_path / "tfds")


def test_code_prompts_are_verbatim_slices(stdlib_splits):
    src = textwrap.dedent(
        '''\
        import os


        @decorator
        def f(a, b):
            """Doc."""
            x = a + b
            y = x * 2
            z = y - 1
            w = z ** 2
            return w


        def short():
            return 1
        '''
    )
    out = P.code_prompts(
        [{"text": src, "path": "m.py"}], prompt_body_lines=2, reference_lines=3, context_lines=None
    )
    assert len(out) == 1
    p = out[0]
    assert p["prompt"] == src[: src.index("    y = x * 2")]
    assert p["reference"] == "    y = x * 2\n    z = y - 1\n    w = z ** 2\n"
    assert p["lineno"] == 8

    # Held-out stdlib files.
    prompts = P.code_prompts(stdlib_splits["validation"], reference_lines=6, max_per_file=2)
    assert prompts
    texts = {ex["path"]: ex["text"] for ex in stdlib_splits["validation"]}
    train_paths = {ex["path"] for ex in stdlib_splits["train"]}
    for p in prompts:
        assert p["path"] in texts and p["path"] not in train_paths
        assert p["prompt"] + p["reference"] in texts[p["path"]]
        assert p["prompt"].endswith("\n")
        assert p["reference"].count("\n") == 6


def test_regeneration_prompt_sources_come_from_training_files(stdlib_splits, tok):
    """The drafter's regeneration prompts ("functions" and "mixed"): completion prompts cut from
    the training files only, trailing whitespace removed, at most prompt_len tokens each."""
    tokenizer, _ = tok
    train = stdlib_splits["train"]
    rng = np.random.RandomState(0)
    fn = P.function_prompts(train, tokenizer, 20, 48, 2, 5, rng)
    assert 0 < len(fn) <= 20
    assert all(0 < len(p) <= 48 for p in fn)
    train_text = "".join(ex["text"] for ex in train)
    for p in fn:
        text = tokenizer.decode(p)
        assert text == text.rstrip() and text in train_text
    # A prompt is the end of a def's first body lines: its last line is indented code.
    assert all(tokenizer.decode(p).rsplit("\n", 1)[-1].startswith(" ") for p in fn)
    assert P.function_prompts(train, tokenizer, 0, 48, 2, 5, rng) == []
    win = P.window_prompts(train, lambda ex: D.tokenize_example(ex, tokenizer), 7, 32, rng)
    assert len(win) == 7 and all(len(p) == 32 for p in win)


# ----------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------

ROUND_TRIP = [
    "",
    "def f(x):\n\treturn x  # tab\n",
    "  leading spaces and trailing   \n\n\n",
    "unicode: héllo wörld ☃ 日本語 😀🚀 \u200b zero-width",
    "windows\r\nline endings\r\n",
    "literal special tokens <|endoftext|> and <|mask|> inside text",
    "\x00\x01 control chars \x7f",
    # Not NFC/NFKC-normalized: any normalizer would change these.
    "decomposed e\u0301 vs \u00e9, ligature \ufb01, \u2460, \uff46\uff55\uff4c\uff4c, nbsp\u00a0, \u212b",
]


def test_tokenizer_special_tokens_and_files(tok):
    t, out = tok
    assert t.vocab_size == 1024
    assert t.eos_id == t.token_to_id("<|endoftext|>") == 0
    assert t.pad_id == t.eos_id
    assert t.mask_id == t.token_to_id("<|mask|>") == 1
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == cfg["pad_token"] == "<|endoftext|>"
    assert cfg["mask_token"] == "<|mask|>"
    raw = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert raw.get_vocab_size() == 1024
    s = "for i in range(10):\n    print(i)\n"
    assert raw.encode(s).ids == t.encode(s)
    # Merges were learned: common code compresses well below one token per byte.
    assert len(t.encode(s)) < len(s.encode()) / 2


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizer_round_trips_exactly(tok, text):
    t, out = tok
    ids = t.encode(text)
    assert all(0 <= i < t.vocab_size for i in ids)
    assert t.decode(ids) == text
    loaded = D.load_tokenizer(out)
    assert loaded.encode(text) == ids and loaded.decode(ids) == text


def test_tokenizer_round_trips_stdlib_files(tok, stdlib_splits):
    t, _ = tok
    for ex in stdlib_splits["validation"]:
        assert t.decode(t.encode(ex["text"])) == ex["text"]
    assert t.encode("<|endoftext|>") == [t.eos_id]
    assert t.encode("<|mask|>") == [t.mask_id]


def test_load_tokenizer_from_model_dir(tok, tmp_path):
    t, out = tok
    # A Qwen-style model directory: eos as an AddedToken dict, ids in config.json.
    (tmp_path / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|endoftext|>", "special": True}})
    )
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    loaded = D.load_tokenizer(tmp_path)
    assert (loaded.eos_id, loaded.pad_id, loaded.mask_id) == (0, 0, 1)

    # No special tokens in the configs and no mask token in the vocabulary.
    plain = tmp_path / "plain"
    small = D.train_bpe_tokenizer(
        ["some text for a tiny tokenizer"] * 5, vocab_size=300, extra_special_tokens=["</s>"]
    )
    raw = small.tokenizer
    raw_json = json.loads(raw.to_str())
    raw_json["added_tokens"] = [a for a in raw_json["added_tokens"] if a["content"] != "<|mask|>"]
    raw_json["added_tokens"] = [
        a for a in raw_json["added_tokens"] if a["content"] != "<|endoftext|>"
    ]
    vocab = raw_json["model"]["vocab"]
    del vocab["<|mask|>"], vocab["<|endoftext|>"]
    plain.mkdir()
    (plain / "tokenizer.json").write_text(json.dumps(raw_json))
    loaded = D.load_tokenizer(plain)
    assert loaded.eos_id == raw.token_to_id("</s>") and loaded.mask_id is None
    with pytest.raises(FileNotFoundError):
        D.load_tokenizer(tmp_path / "missing")


# ----------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------


def _random_docs(rng, n, max_len, eos=1, pair_frac=0.5):
    """Docs of (ids, mask); pairs have a masked prompt. Token values >= 2."""
    docs = []
    for _ in range(n):
        length = int(rng.integers(1, max_len))
        ids = rng.integers(2, 1000, size=length).astype(np.int32)
        ids = np.append(ids, eos).astype(np.int32)
        mask = np.ones(len(ids), np.int32)
        if rng.random() < pair_frac:
            mask[: int(rng.integers(0, length))] = 0
        docs.append((ids, mask))
    return docs


def _pieces(rows, pad_id):
    """Split rows into (ids, mask, starts_row) pieces by segment id."""
    out = []
    for row in rows:
        ids, mask, seg = row["input_ids"], row["loss_mask"], row["segment_ids"]
        n = int((seg > 0).sum())
        # Padding only at the end, with pad id and zero loss.
        assert (seg[:n] > 0).all() and (seg[n:] == 0).all()
        assert (ids[n:] == pad_id).all() and (mask[n:] == 0).all()
        # Segment ids are 1, 2, ... and increase by one at each boundary.
        if n:
            assert seg[0] == 1
            steps = np.diff(seg[:n])
            assert set(np.unique(steps)) <= {0, 1}
        for s in np.unique(seg[:n]):
            sel = np.flatnonzero(seg == s)
            assert (np.diff(sel) == 1).all()  # contiguous
            out.append((ids[sel], mask[sel], sel[0] == 0))
    return out


@pytest.mark.parametrize("allow_split", [True, False])
def test_packing_conserves_tokens_and_marks_boundaries(allow_split):
    rng = np.random.default_rng(0)
    seq_len, pad_id = 64, -1
    docs = _random_docs(rng, 60, max_len=150)
    rows = list(D.pack_documents(docs, seq_len, pad_id=pad_id, allow_split=allow_split))
    assert all(
        r["input_ids"].shape == (seq_len,) and r["input_ids"].dtype == np.int32 for r in rows
    )
    pieces = _pieces(rows, pad_id)
    # Concatenating the unpadded segments gives back the documents (+eos).
    np.testing.assert_array_equal(
        np.concatenate([p[0] for p in pieces]), np.concatenate([d[0] for d in docs])
    )
    np.testing.assert_array_equal(
        np.concatenate([p[1] for p in pieces]), np.concatenate([d[1] for d in docs])
    )
    # Segment boundaries are exactly document boundaries, plus row starts when a
    # document continues into the next row.
    doc_starts = set(np.cumsum([0] + [len(d[0]) for d in docs[:-1]]).tolist())
    pos = 0
    for ids, _, at_row_start in pieces:
        assert pos in doc_starts or at_row_start
        pos += len(ids)
    if not allow_split:
        # Documents that fit in a row are never cut across rows.
        lens = [len(d[0]) for d in docs]
        assert sum(1 for p in pieces) == sum(max(1, -(-n // seq_len)) for n in lens)
    else:
        # Only the last row has padding.
        assert all((r["segment_ids"] > 0).all() for r in rows[:-1])


def test_loss_mask_zero_exactly_on_prompt_and_padding(tok):
    t, _ = tok
    examples = [
        {"prompt": "def add(a, b):\n", "response": "    return a + b\n"},
        {"text": "x = 1\n"},
        {"prompt": b"# bytes prompt\n", "response": b"pass\n"},
        {"prompt": "only prompt", "response": ""},
    ]
    docs = [D.tokenize_example(ex, t) for ex in examples]
    for ex, (ids, mask) in zip(examples, docs):
        assert ids[-1] == t.eos_id and mask[-1] == 1
        prompt = ex.get("prompt", "")
        prompt = prompt.decode() if isinstance(prompt, bytes) else prompt
        n_prompt = len(t.encode(prompt)) if prompt else 0
        assert (mask[:n_prompt] == 0).all() and (mask[n_prompt:] == 1).all()
        assert t.decode(ids[n_prompt:-1]) == (
            ex.get("response", ex.get("text")).decode()
            if isinstance(ex.get("response", ex.get("text")), bytes)
            else ex.get("response", ex.get("text"))
        )
    rows = list(D.pack_documents(docs, 16, pad_id=t.pad_id))
    flat_mask = np.concatenate([r["loss_mask"][r["segment_ids"] > 0] for r in rows])
    np.testing.assert_array_equal(flat_mask, np.concatenate([m for _, m in docs]))
    for r in rows:
        assert (r["loss_mask"][r["segment_ids"] == 0] == 0).all()


def test_segment_positions():
    seg = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(
        D.segment_positions(seg),
        [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]],
    )


# ----------------------------------------------------------------------------
# Batching: determinism, resumption, host sharding
# ----------------------------------------------------------------------------


def _id_docs(n, rng):
    """Examples whose tokens identify them: doc i -> [i+2]*len + [eos=1]."""
    return [{"id": i, "len": int(rng.integers(1, 40))} for i in range(n)]


def _id_tokenize(ex):
    ids = np.array([ex["id"] + 2] * ex["len"] + [1], np.int32)
    return ids, np.ones(len(ids), np.int32)


def _collect(it, n):
    return [next(it) for _ in range(n)]


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize("allow_split", [True, False])
def test_resume_from_saved_state_matches_uninterrupted(allow_split):
    rng = np.random.default_rng(1)
    source = _id_docs(37, rng)
    kw = dict(seq_len=32, batch_size=3, seed=7, allow_split=allow_split, pad_id=0)
    full = _collect(D.PackedBatchIterator(source, _id_tokenize, **kw), 40)  # > 3 epochs
    for k in (1, 5, 13, 29):
        it = D.PackedBatchIterator(source, _id_tokenize, **kw)
        head = _collect(it, k)
        state = json.loads(json.dumps(it.get_state()))  # as stored in a checkpoint
        resumed = D.PackedBatchIterator(source, _id_tokenize, state=state, **kw)
        _assert_batches_equal(head + _collect(resumed, 40 - k), full)
        # set_state on a used iterator works too.
        other = D.PackedBatchIterator(source, _id_tokenize, **kw)
        _collect(other, 3)
        other.set_state(state)
        _assert_batches_equal(_collect(other, 40 - k), full[k:])
    # The stream really crossed epochs and some states were mid-document.
    it = D.PackedBatchIterator(source, _id_tokenize, **kw)
    states = [(_collect(it, 1), it.get_state())[1] for _ in range(40)]
    assert states[-1]["epoch"] >= 2
    if allow_split:
        assert any(s["offset"] > 0 for s in states)


def test_shuffle_is_seeded_and_changes_per_epoch():
    source = _id_docs(50, np.random.default_rng(2))
    a = D.PackedBatchIterator(source, _id_tokenize, seq_len=16, batch_size=2, seed=3)
    b = D.PackedBatchIterator(source, _id_tokenize, seq_len=16, batch_size=2, seed=3)
    c = D.PackedBatchIterator(source, _id_tokenize, seq_len=16, batch_size=2, seed=4)
    _assert_batches_equal(_collect(a, 10), _collect(b, 10))
    assert not np.array_equal(a.epoch_order(0), c.epoch_order(0))
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))
    assert sorted(a.epoch_order(1)) == list(range(50))
    ordered = D.PackedBatchIterator(source, _id_tokenize, seq_len=16, batch_size=2, shuffle=False)
    assert list(ordered.epoch_order(0)) == list(range(50))


def _docs_seen(batches):
    ids = np.concatenate([b["input_ids"][b["segment_ids"] > 0] for b in batches])
    return ids[ids >= 2] - 2


def test_host_sharding_disjoint_and_covering():
    rng = np.random.default_rng(3)
    source = _id_docs(23, rng)
    num_hosts = 3
    seen = []
    for host in range(num_hosts):
        it = D.PackedBatchIterator(
            source,
            _id_tokenize,
            seq_len=24,
            batch_size=2,
            seed=5,
            num_epochs=1,
            host_id=host,
            num_hosts=num_hosts,
            drop_remainder=False,
        )
        batches = list(it)
        assert all(b["input_ids"].shape == (2, 24) for b in batches)
        got = _docs_seen(batches)
        # Every token of each of this host's documents is present exactly once.
        docs = set(got.tolist())
        for d in docs:
            assert (got == d).sum() == source[d]["len"]
        assert docs == set(it.epoch_order(0).tolist())
        seen.append(docs)
        with pytest.raises(StopIteration):
            next(it)
    for i in range(num_hosts):
        for j in range(i + 1, num_hosts):
            assert not seen[i] & seen[j]
    assert set().union(*seen) == set(range(len(source)))
    # Per-epoch shards stay disjoint and covering in later epochs too.
    orders = [
        D.PackedBatchIterator(
            source, _id_tokenize, seq_len=8, batch_size=1, seed=5, host_id=h, num_hosts=num_hosts
        ).epoch_order(4)
        for h in range(num_hosts)
    ]
    assert sorted(np.concatenate(orders).tolist()) == list(range(len(source)))
    with pytest.raises(ValueError):
        D.PackedBatchIterator(source, _id_tokenize, seq_len=8, batch_size=1, host_id=3, num_hosts=3)


def test_finite_epochs_and_drop_remainder():
    source = _id_docs(10, np.random.default_rng(4))
    total = sum(d["len"] + 1 for d in source)
    kw = dict(seq_len=16, batch_size=4, num_epochs=2, seed=0)
    kept = list(D.PackedBatchIterator(source, _id_tokenize, drop_remainder=False, **kw))
    dropped = list(D.PackedBatchIterator(source, _id_tokenize, drop_remainder=True, **kw))
    n_rows = -(-2 * total // 16)
    assert len(kept) == -(-n_rows // 4)
    assert len(dropped) == n_rows // 4
    assert sum(int((b["segment_ids"] > 0).sum()) for b in kept) == 2 * total
    _assert_batches_equal(dropped, kept[: len(dropped)])


def test_end_to_end_from_tfds_source(stdlib_builder, tok):
    t, _ = tok
    src = stdlib_builder.as_data_source(split="train")
    it = D.make_batch_iterator(src, t, seq_len=128, batch_size=4, seed=0, include_positions=True)
    batches = _collect(it, 5)
    for b in batches:
        assert set(b) == {"input_ids", "loss_mask", "segment_ids", "positions"}
        for v in b.values():
            assert v.shape == (4, 128) and v.dtype == np.int32
        assert ((b["input_ids"] >= 0) & (b["input_ids"] < t.vocab_size)).all()
    # The first document of the epoch, decoded from the packed rows, is the file.
    first = D.decode_example(src[int(it.epoch_order(0)[0])])["text"]
    flat = np.concatenate([b["input_ids"].reshape(-1) for b in batches])
    n = len(t.encode(first))
    if n + 1 <= flat.size:
        assert t.decode(flat[:n]) == first and flat[n] == t.eos_id
    state = it.get_state()
    again = D.make_batch_iterator(
        src, t, seq_len=128, batch_size=4, seed=0, include_positions=True, state=state
    )
    fresh = D.make_batch_iterator(src, t, seq_len=128, batch_size=4, seed=0, include_positions=True)
    _collect(fresh, 5)
    _assert_batches_equal(_collect(again, 2), _collect(fresh, 2))


@pytest.mark.parametrize("allow_split", [True, False])
def test_doc_keys_name_each_position_s_document_and_offset(allow_split):
    """include_doc_keys (the tap cache's keys): at every real position, the document named by
    doc_key holds the row's token at doc_offset (NumPy statement over the source); padding is
    -1; an epoch's positions reach every token of every document; the other fields are
    those of an iterator without keys. Without allow_split, a piece starts at offset 0 or at a
    multiple of seq_len (pieces repeat across epochs)."""
    rng = np.random.default_rng(3)
    source = _id_docs(23, rng)
    kw = dict(seq_len=32, batch_size=3, seed=5, allow_split=allow_split, pad_id=0)

    def tokenize(ex):  # each token names its document and offset
        ids = np.array([100 * ex["id"] + 2 + j for j in range(ex["len"])] + [1], np.int32)
        return ids, np.ones(len(ids), np.int32)

    keyed = D.PackedBatchIterator(source, tokenize, include_doc_keys=True, **kw)
    plain = D.PackedBatchIterator(source, tokenize, **kw)
    seen = {}
    while keyed.epoch == 0:
        batch, ref = next(keyed), next(plain)
        for k in ref:
            np.testing.assert_array_equal(batch[k], ref[k])
        real = batch["segment_ids"] > 0
        assert (batch["doc_key"][~real] == -1).all() and (batch["doc_key"][real] >= 0).all()
        for b, t in zip(*np.nonzero(real)):
            key, off = int(batch["doc_key"][b, t]), int(batch["doc_offset"][b, t])
            assert tokenize(source[key])[0][off] == batch["input_ids"][b, t]
            seen.setdefault(key, []).append(off)
            if not allow_split and (
                t == 0 or batch["segment_ids"][b, t - 1] != batch["segment_ids"][b, t]
            ):
                assert off % 32 == 0, (key, off)
    # (the last batch may run into the second epoch: count the first epoch's offsets once)
    for key in range(len(source)):
        n = len(tokenize(source[key])[0])
        assert sorted(set(seen[key])) == list(range(n)), key


@pytest.mark.parametrize("allow_split", [True, False])
def test_rows_for_counts_the_rows_the_packer_fills(allow_split):
    """rows_for(lengths) (steps per epoch) equals the rows PackedBatchIterator fills with the
    same documents in the same order, padding included, long documents too."""
    rng = np.random.default_rng(11)
    source = [{"id": i, "len": int(rng.integers(1, 80))} for i in range(41)]
    it = D.PackedBatchIterator(
        source, _id_tokenize, seq_len=32, batch_size=1, shuffle=False, num_epochs=1,
        allow_split=allow_split, drop_remainder=False,
    )  # fmt: skip
    rows = sum(1 for _ in it)
    lengths = [len(_id_tokenize(ex)[0]) for ex in source]
    assert D.packing.rows_for(lengths, 32, allow_split) == rows
    assert allow_split or rows > -(-sum(lengths) // 32)  # the padding showed
