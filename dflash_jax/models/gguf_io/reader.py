"""A GGUF file read: its metadata (checked, as a Hugging Face config.json dict), its tensors
checked against that config, and `GGUFStore`, the safetensors-like store the loaders read
dequantized tensors from."""

from __future__ import annotations

import functools
import os
from typing import Dict, Iterable, Optional, Tuple

import numpy as np

from dflash_jax.models.safetensors_io import CheckpointError
from dflash_jax.models.gguf_io.common import (
    ARCHITECTURES,
    GGUFError,
    GGUF_MAGIC,
)


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
