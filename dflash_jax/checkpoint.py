"""Hugging Face checkpoint I/O for targets (and the shared name mapping used for drafters).

The layout change is written once, as a rule on parameter paths:

  Flax path                                   HF tensor                          transform
  embed_tokens/embedding          [V, H]      model.embed_tokens.weight  [V, H]  none
  layers_i/self_attn/q_proj/kernel [H, N*D]   model.layers.i.self_attn.q_proj.weight [N*D, H]  T
  layers_i/.../*_norm/scale or *_layernorm    model.layers.i....weight           none
  layers_i/mlp/{gate,up,down}_proj/kernel     model.layers.i.mlp.*.weight        T
  norm/scale                                  model.norm.weight                  none
  lm_head/kernel                   [H, V]     lm_head.weight             [V, H]  T

(PyTorch linear weights are stored [out, in]; Flax kernels are [in, out].) Drafters use the same
rule without the `model.` prefix (`layers.i...`, `norm`, `fc`, `hidden_norm`).

Loading builds the whole parameter tree before returning: a missing, mis-shaped or
unknown-dtype tensor raises `CheckpointError` naming the file and the tensor, never a
half-loaded model.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util

from dflash_jax import console
from dflash_jax.config import ModelConfig, as_dtype
from dflash_jax.safetensors_io import CheckpointError, SafetensorsDir, save_sharded

log = logging.getLogger(__name__)

_LEAF_NAMES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}
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
    parts.append(_LEAF_NAMES[path[-1]])
    name = ".".join(parts)
    if path[0] == "lm_head":
        return name  # lm_head lives outside the `model.` prefix
    return prefix + name


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{cfg_path}: missing (is {path} a Hugging Face model directory?)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except ValueError as e:  # UnicodeDecodeError included
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


read_config = _read_config  # config.json of a model directory, as a dict (CheckpointError)


def read_target_config(path: str, dtype="float32", param_dtype=None) -> ModelConfig:
    """The checked `ModelConfig` of a target directory's config.json (no weights read): a
    missing file, bad JSON, an unsupported architecture or a field of the wrong type or range
    is a `CheckpointError` naming the file."""
    hf = _read_config(path)
    as_dtype(dtype)  # a bad dtype name is the caller's error, not the checkpoint's
    try:
        return ModelConfig.from_hf(
            hf, dtype=dtype, param_dtype=param_dtype, source=os.path.join(path, "config.json")
        )
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def load_params(
    path: str,
    abstract_params,
    *,
    prefix: str,
    param_dtype,
    optional: Callable[[str], bool] = lambda name: False,
) -> dict:
    """Reads every parameter of `abstract_params` (a pytree of ShapeDtypeStructs) from `path`.

    Tensors are cast one at a time straight from the memory-mapped file to `param_dtype` and
    moved to the device, so peak host memory is one tensor, not a second copy of the model.
    """
    store = SafetensorsDir(path)
    try:
        flat = traverse_util.flatten_dict(abstract_params)
        out = {}
        for key, spec in console.progress(
            flat.items(), total=len(flat), desc=f"load {path}", unit="tensor"
        ):
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
            arr = store.get(name)
            if arr.dtype.kind not in "fV" and arr.dtype != ml_dtypes.bfloat16:
                raise CheckpointError(
                    f"{store.file_of(name)}: tensor {name!r} has non-float dtype {code}"
                )
            arr = arr.T if transpose else arr
            out[key] = jnp.asarray(np.asarray(arr, dtype=param_dtype))
        known = {flax_path_to_hf(k, prefix) for k in flat}
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
        if key[-1] == "kernel":
            arr = arr.T
        tensors[flax_path_to_hf(key, prefix)] = np.ascontiguousarray(arr.astype(np_dtype))
    return tensors


def dtype_name(dtype) -> str:
    return {
        jnp.dtype(jnp.float32): "float32",
        jnp.dtype(jnp.bfloat16): "bfloat16",
        jnp.dtype(jnp.float16): "float16",
    }[jnp.dtype(dtype)]


# ---------------------------------------------------------------------------- targets


def load_target_params(path: str, dtype="float32", param_dtype=None) -> Tuple[ModelConfig, dict]:
    """(config, params) of a `Qwen3ForCausalLM` / `LlamaForCausalLM` directory."""
    from dflash_jax.model import Transformer

    cfg = read_target_config(path, dtype=dtype, param_dtype=param_dtype)
    model = Transformer(cfg)
    abstract = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
    )
    params = load_params(
        path,
        abstract,
        prefix="model.",
        param_dtype=cfg.param_dtype,
        optional=lambda n: cfg.tie_word_embeddings and n == "lm_head.weight",
    )
    return cfg, params


def save_target_params(
    cfg: ModelConfig, params, path: str, dtype=None, extra_files: Optional[Dict[str, str]] = None
) -> None:
    """Writes `config.json` + safetensors that transformers' `from_pretrained` loads."""
    dtype = cfg.param_dtype if dtype is None else dtype
    os.makedirs(path, exist_ok=True)
    tensors = params_to_hf(params, prefix="model.", dtype=dtype)
    save_sharded(path, tensors)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(torch_dtype=dtype_name(as_dtype(dtype))), f, indent=2)
    for name, src in (extra_files or {}).items():
        if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(
            os.path.join(path, name)
        ):
            with open(src, "rb") as fi, open(os.path.join(path, name), "wb") as fo:
                fo.write(fi.read())
