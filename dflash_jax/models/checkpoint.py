"""Hugging Face checkpoint I/O for targets (and the shared name mapping used for drafters).

The layout change is written once, as a rule on parameter paths:

  Flax path                                   HF tensor                          transform
  embed_tokens/embedding          [V, H]      model.embed_tokens.weight  [V, H]  none
  layers_i/self_attn/q_proj/kernel [H, N*D]   model.layers.i.self_attn.q_proj.weight [N*D, H]  T
  layers_i/.../*_norm/scale or *_layernorm    model.layers.i....weight           none
  layers_i/mlp/{gate,up,down}_proj/kernel     model.layers.i.mlp.*.weight        T
  norm/scale                                  model.norm.weight                  none
  lm_head/kernel                   [H, V]     lm_head.weight             [V, H]  T

  layers_i/mlp/gate/kernel        [H, E]      model.layers.i.mlp.gate.weight [E, H]  T (router)
  layers_i/mlp/experts/P/kernel  [E, I, H]   model.layers.i.mlp.experts.e.P.weight [out, in]
                                              for e < E, P in gate/up/down_proj   stacked;
                                              gate/up as stored, down T

(PyTorch linear weights are stored [out, in]; Flax kernels are [in, out].) Drafters use the same
rule without the `model.` prefix (`layers.i...`, `norm`, `fc`, `hidden_norm`).

Quantized targets (`dflash_jax/models/quantization.py`): a block-FP8 linear (`weight` float8_e4m3fn +
`weight_scale_inv`) is dequantized as it is read; an int8 target's linears are
`.../kernel` int8 [in, out] + `.../kernel_scale` float32 [out] in Flax and `weight` int8
[out, in] + `weight_scale` [out] in the file; `quantize="int8"` quantizes each float (or
dequantized FP8) linear as it is read, one tensor at a time.

Loading builds the whole parameter tree before returning: a missing, mis-shaped or
unknown-dtype tensor raises `CheckpointError` naming the file and the tensor, never a
half-loaded model.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util

from dflash_jax.models import quantization
from dflash_jax.models.config import ModelConfig, as_dtype
from dflash_jax.models.safetensors_io import CheckpointError, SafetensorsDir
from dflash_jax.support import checks, console

log = logging.getLogger(__name__)

_LEAF_NAMES = {
    "kernel": "weight",
    "scale": "weight",
    "embedding": "weight",
    "bias": "bias",
    "kernel_scale": "weight_scale",  # an int8 kernel's per-output-channel scale
}
# Parameters stored under their own name, as they are (DFlash 2's convolution kernels and
# selector codebooks: `...attention_conv.base_kernel`, `candidate_selector.successor_codebook`).
_RAW_LEAVES = ("base_kernel", "predecessor_codebook", "successor_codebook", "A_log", "dt_bias")
# Leaves stored under another name, as they are (a hybrid target's depthwise convolution).
_RENAMED_LEAVES = {"conv1d": "conv1d.weight"}
_FP8_SCALE = "_scale_inv"  # `<linear>.weight_scale_inv` of a block-FP8 checkpoint
# Tensors that Hugging Face checkpoints may carry but the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def flax_path_to_hf(path: Tuple[str, ...], prefix: str = "") -> str:
    """('layers_3', 'self_attn', 'q_proj', 'kernel') -> prefix + 'layers.3.self_attn.q_proj.weight'."""
    parts = []
    for p in path[:-1]:
        if p.startswith("layers_") and p[len("layers_") :].isdigit():
            parts += ["layers", p[len("layers_") :]]
        else:
            parts.append(p)
    leaf = path[-1]
    parts.append(leaf if leaf in _RAW_LEAVES else _RENAMED_LEAVES.get(leaf) or _LEAF_NAMES[leaf])
    name = ".".join(parts)
    if path[0] == "lm_head":
        return name  # lm_head lives outside the `model.` prefix
    return prefix + name


def _is_experts(key) -> bool:
    """A stacked expert kernel [E, I, H] (`moe.SparseMoE`): one HF tensor per expert."""
    return len(key) >= 3 and key[-3] == "experts" and key[-1] == "kernel"


def _expert_as_stored(key) -> bool:
    """Whether stacked expert kernel `key` holds each expert as the file does ([out, in]: gate
    and up, [I, H]) rather than transposed (down: [I, H] against the file's [H, I])."""
    return key[-2] in ("gate_proj", "up_proj")


def expert_names(key, prefix: str, num_experts: int):
    """HF names of the per-expert tensors of stacked kernel `key`, expert 0 first."""
    base = flax_path_to_hf(key, prefix)  # ...mlp.experts.gate_proj.weight
    head, proj = base[: -len(".weight")].rsplit(".", 1)
    return [f"{head}.{e}.{proj}.weight" for e in range(num_experts)]


def read_config(path: str) -> dict:
    """config.json of a model directory, as a dict (`CheckpointError`: no directory, no file,
    not a JSON object)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{cfg_path}: missing (is {path} a Hugging Face model directory?)")
    return checks.json_object_file(cfg_path, error=CheckpointError)


def read_target_config(path: str, dtype="float32", param_dtype=None) -> ModelConfig:
    """The checked `ModelConfig` of a target directory's config.json (no weights read): a
    missing file, bad JSON, an unsupported architecture or a field of the wrong type or range
    is a `CheckpointError` naming the file."""
    hf = read_config(path)
    as_dtype(dtype)  # a bad dtype name is the caller's error, not the checkpoint's
    try:
        return ModelConfig.from_hf(
            hf, dtype=dtype, param_dtype=param_dtype, source=os.path.join(path, "config.json")
        )
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _is_fp8(dtype) -> bool:
    return np.dtype(dtype).kind == "V" and np.dtype(dtype).itemsize == 1


def _read_weight(store: SafetensorsDir, name: str, code: str, fp8_block) -> np.ndarray:
    """Tensor `name` as stored ([out, in] for a linear), a block-FP8 one dequantized to
    float32 with its `weight_scale_inv`; an FP8 tensor without one is refused."""
    where = store.file_of(name)
    inv = name + _FP8_SCALE
    arr = store.get(name)
    if inv in store:
        if fp8_block is None:
            raise CheckpointError(
                f"{where}: tensor {inv!r}, but config.json has no fp8 quantization_config"
            )
        if not _is_fp8(arr.dtype):
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {code}, expected F8_E4M3")
        try:
            return quantization.dequantize_fp8_blocks(arr, store.get(inv), fp8_block)
        except ValueError as e:
            raise CheckpointError(f"{store.file_of(inv)}: tensor {inv!r}: {e}") from None
    if _is_fp8(arr.dtype):
        raise CheckpointError(f"{where}: tensor {name!r} is {code} without {inv!r}")
    if arr.dtype.kind not in "fV":
        raise CheckpointError(f"{where}: tensor {name!r} has non-float dtype {code}")
    return arr


def load_params(
    path: str,
    abstract_params,
    *,
    prefix: str,
    param_dtype,
    optional: Callable[[str], bool] = lambda name: False,
    fp8_block=None,
) -> dict:
    """Reads every parameter of `abstract_params` (a pytree of ShapeDtypeStructs) from `path`.

    Tensors are cast one at a time straight from the memory-mapped file to `param_dtype` and
    moved to the device, so peak host memory is one tensor, not a second copy of the model.
    `fp8_block` [b0, b1]: the checkpoint is block-FP8 (`weight_scale_inv` tensors). An int8
    kernel of `abstract_params` (with its `kernel_scale`) is read as stored (an int8 file) or
    quantized per output channel from the float (or dequantized FP8) tensor.
    """
    store = open_store(path)
    try:
        flat = traverse_util.flatten_dict(abstract_params)
        out = {}
        for key, spec in console.progress(
            flat.items(), total=len(flat), desc=f"load {path}", unit="tensor"
        ):
            if key[-1] == "kernel_scale":
                continue  # read with its kernel
            if _is_experts(key):
                out[key] = _read_experts(store, path, key, spec, prefix, param_dtype, fp8_block)
                continue
            name = flax_path_to_hf(key, prefix)
            if name not in store:
                if optional(name):
                    continue
                raise CheckpointError(f"{path}: missing tensor {name!r}")
            code, shape = store.info(name)
            transpose = key[-1] == "kernel"
            want = tuple(reversed(spec.shape)) if transpose else tuple(spec.shape)
            if tuple(shape) != want:
                raise CheckpointError(
                    f"{store.file_of(name)}: tensor {name!r} has shape {tuple(shape)}, "
                    f"expected {want}"
                )
            if transpose and spec.dtype == jnp.int8:
                skey = key[:-1] + ("kernel_scale",)
                out[key], out[skey] = _read_int8(store, name, code, want, fp8_block, prefix, skey)
                continue
            arr = _read_weight(store, name, code, fp8_block)
            arr = arr.T if transpose else arr
            out[key] = jnp.asarray(np.asarray(arr, dtype=param_dtype))
        known = set()
        for k, spec in flat.items():
            if _is_experts(k):
                known.update(expert_names(k, prefix, spec.shape[0]))
            else:
                known.add(flax_path_to_hf(k, prefix))
        known |= {n + _FP8_SCALE for n in known}
        extra = [
            n
            for n in store.names()
            if n not in known and not n.endswith(_IGNORED_SUFFIXES) and not optional(n)
        ]
        if extra:
            log.warning("%s: ignoring %d unexpected tensors, e.g. %s", path, len(extra), extra[:3])
        return traverse_util.unflatten_dict(out)
    finally:
        store.close()


def open_store(path: str):
    """The tensors of a model directory: its safetensors, or the GGUF file its config.json
    names (a directory that `gguf_io.model_dir` derived from a GGUF file)."""
    from dflash_jax.models import gguf_io

    if os.path.exists(os.path.join(path, "config.json")):
        src = gguf_io.gguf_source(path, read_config(path))
        if src is not None:
            return gguf_io.GGUFStore(src)
    return SafetensorsDir(path)


def _read_experts(store, path, key, spec, prefix, param_dtype, fp8_block):
    """A stacked expert kernel [E, I, H] from its E tensors [out, in], one at a time."""
    as_stored = _expert_as_stored(key)
    want = tuple(spec.shape[1:]) if as_stored else (spec.shape[2], spec.shape[1])
    out = np.empty(spec.shape, dtype=param_dtype)
    for e, name in enumerate(expert_names(key, prefix, spec.shape[0])):
        if name not in store:
            raise CheckpointError(f"{path}: missing tensor {name!r}")
        code, shape = store.info(name)
        if tuple(shape) != want:
            raise CheckpointError(
                f"{store.file_of(name)}: tensor {name!r} has shape {tuple(shape)}, expected {want}"
            )
        one = np.asarray(_read_weight(store, name, code, fp8_block), dtype=param_dtype)
        out[e] = one if as_stored else one.T
    return jnp.asarray(out)


def _read_int8(store, name, code, shape, fp8_block, prefix, scale_key):
    """(int8 kernel [in, out], float32 scale [out]) of linear `name` ([out, in] in the file)."""
    if code == "I8":
        sname = flax_path_to_hf(scale_key, prefix)
        if sname not in store:
            raise CheckpointError(f"{store.file_of(name)}: int8 tensor {name!r} without {sname!r}")
        scale = store.get(sname)
        if tuple(scale.shape) != (shape[0],) or scale.dtype.kind not in "fV":
            raise CheckpointError(
                f"{store.file_of(sname)}: tensor {sname!r} has shape {tuple(scale.shape)} "
                f"and dtype {scale.dtype}, expected float ({shape[0]},)"
            )
        q, s = store.get(name).T, np.asarray(scale, np.float32)
    else:
        w = _read_weight(store, name, code, fp8_block)
        q, s = quantization.quantize_int8(np.asarray(w, np.float32).T)
    return jnp.asarray(np.ascontiguousarray(q)), jnp.asarray(s)


def params_to_hf(params, *, prefix: str, dtype) -> Dict[str, np.ndarray]:
    """The inverse of `load_params`: a name -> numpy tensor dict in Hugging Face layout."""
    np_dtype = (
        np.dtype(ml_dtypes.bfloat16)
        if as_dtype(dtype) == jnp.bfloat16
        else np.dtype(as_dtype(dtype))
    )
    tensors = {}
    flat = traverse_util.flatten_dict(params)
    for key, value in console.progress(flat.items(), total=len(flat), desc="export", unit="tensor"):
        arr = np.asarray(jax.device_get(value))
        if _is_experts(key):  # stacked [E, I, H] -> one [out, in] tensor per expert
            as_stored = _expert_as_stored(key)
            for name, one in zip(expert_names(key, prefix, arr.shape[0]), arr):
                one = one if as_stored else one.T
                tensors[name] = np.ascontiguousarray(one.astype(np_dtype))
            continue
        if key[-1] == "kernel":
            arr = arr.T
        if arr.dtype == np.int8 or key[-1] == "kernel_scale":  # int8 kernels and their scales
            tensors[flax_path_to_hf(key, prefix)] = np.ascontiguousarray(arr)
            continue
        tensors[flax_path_to_hf(key, prefix)] = np.ascontiguousarray(arr.astype(np_dtype))
    return tensors


def dtype_name(dtype) -> str:
    return {
        jnp.dtype(jnp.float32): "float32",
        jnp.dtype(jnp.bfloat16): "bfloat16",
        jnp.dtype(jnp.float16): "float16",
    }[jnp.dtype(dtype)]
