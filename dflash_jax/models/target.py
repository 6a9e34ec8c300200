"""The target (the verifier of speculative decoding) of any supported family: its module
(`Transformer`, or `HybridTransformer` for a Qwen3.5-style hybrid), empty decoding cache and
random parameters; the user-facing `Target` (config + params + compiled forward); and its
Hugging Face directories, read and written (the tensor names' rule: `checkpoint.py`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models import checkpoint, hub, layer_stack, quantization, safetensors_io
from dflash_jax.models.config import ModelConfig, as_dtype
from dflash_jax.models.hybrid import HybridCache, HybridTransformer
from dflash_jax.models.transformer import KVCache, Transformer


def target_module(cfg: ModelConfig, attention_impl: str = "xla") -> Transformer:
    """The target module of `cfg`: a `HybridTransformer` for a hybrid target."""
    cls = HybridTransformer if cfg.hybrid is not None else Transformer
    return cls(cfg, attention_impl)


def new_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=None, seq_split: bool = False):
    """A target's empty decoding cache: a `KVCache`, or a `HybridCache` for a hybrid target.
    `seq_split`: its K/V split by sequence over a mesh's `tensor` axis where that axis cannot
    split their heads (`attention.splits_context`: the loops of chains; a draft tree's verify
    reads its cache whole, and a scanned stack's [L, B, S, K*D] caches are not split)."""
    stacked = cfg.scans_layers
    if cfg.hybrid is not None:
        cache = HybridCache.create(cfg, batch, capacity, dtype, stacked=stacked)
        return cache.replace(kv=cache.kv.replace(seq_split=seq_split and not stacked))
    cache = KVCache.create(cfg, batch, capacity, dtype, stacked=stacked)
    return cache.replace(seq_split=seq_split and not stacked)


def init_params(cfg: ModelConfig, seed: int = 0):
    """Random parameters (normal, std 0.02 for matrices) as a plain pytree."""
    model = target_module(cfg)
    ids = jnp.zeros((1, 2), jnp.int32)
    return model.init(jax.random.PRNGKey(seed), ids)["params"]


@dataclasses.dataclass
class ForwardOutput:
    """logits: float32 [B, T, V]; taps: [B, T, n*H] when requested, else None."""

    logits: jnp.ndarray
    taps: Optional[jnp.ndarray] = None


@dataclasses.dataclass(eq=False)
class Target:
    """A loaded target: `config` (ModelConfig), `params` (plain pytree), `path` (or None).

    `attention_impl` selects the attention code ("xla", "pallas", "pallas_interpret", "auto";
    default "auto": the Pallas kernels on TPU and GPU, XLA on CPU).
    """

    config: ModelConfig
    params: dict
    path: Optional[str] = None
    attention_impl: str = "auto"

    @property
    def module(self) -> Transformer:
        return target_module(self.config, self.attention_impl)

    def forward(self, input_ids, tap_layers: Sequence[int] = ()) -> ForwardOutput:
        """Full causal forward over `input_ids` [B, T] (no cache). Returns float32 logits."""
        ids = jnp.asarray(np.asarray(input_ids, dtype=np.int32))
        if ids.ndim == 1:
            ids = ids[None]
        _check_ids(ids, self.config.vocab_size)
        logits, taps = _forward(self.module, self.params, ids, tuple(tap_layers))
        return ForwardOutput(logits=logits, taps=taps)

    def init_cache(self, batch: int, capacity: int):
        """An empty decoding cache: a `KVCache`, or a `HybridCache` for a hybrid target."""
        return new_cache(self.config, batch, capacity)


def _check_ids(ids, vocab_size):
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"token ids must be in [0, {vocab_size}); got range "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )


@functools.partial(jax.jit, static_argnums=(0, 3))
def _forward(module, params, ids, tap_layers):
    hidden, _, taps = module.apply({"params": params}, ids, tap_layers=tap_layers)
    logits = module.apply({"params": params}, hidden, method="logits")
    return logits, taps


def load_target(
    path: str,
    dtype: str = "float32",
    param_dtype: Optional[str] = None,
    attention_impl: str = "auto",
    quantize: Optional[str] = None,
    quantize_lm_head: bool = False,
    scan_layers: bool = False,
) -> Target:
    """Loads a Hugging Face `Qwen3ForCausalLM` / `LlamaForCausalLM` directory, or hub id
    (`Qwen/Qwen3-8B`, fetched into the Hugging Face cache by `dflash_jax.models.hub`).

    dtype: compute dtype ("float32" on CPU, "bfloat16" on accelerators); param_dtype defaults
    to dtype. Block-FP8 checkpoints (`quant_method` "fp8", e.g. Qwen/Qwen3-8B-FP8) are
    dequantized at load; int8 ones written by `save_target` stay int8. quantize="int8": the
    decoder linears quantized to int8 per output channel at load (weight-only; the LM head too
    with `quantize_lm_head`, for an untied head). See `dflash_jax/models/quantization.py`.
    scan_layers: the decoder layers stacked and run as one `lax.scan` (one layer body to
    compile whatever the depth; `dflash_jax/models/layer_stack.py`), where the layers repeat
    (dense, experts in every layer, or a hybrid target's pattern of DeltaNet and attention
    layers: one group scanned); the file's per-layer tensors are stacked as they are placed.
    """
    quantize = quantization.check_quantize(quantize)  # refused before any download
    path = hub.local_path(path, what="target")
    cfg, params = _load_params(
        str(path),
        dtype=dtype,
        param_dtype=param_dtype,
        quantize=quantize,
        quantize_lm_head=quantize_lm_head,
    )
    if scan_layers:
        cfg = cfg.replace(scan_layers=True)
        params = layer_stack.to_layout(params, cfg)
    return Target(config=cfg, params=params, path=str(path), attention_impl=attention_impl)


def quantize_target(target: Target, quantize: str = "int8", lm_head: bool = False) -> Target:
    """An in-memory target's decoder linears (and its untied LM head with `lm_head`)
    quantized to int8 per output channel, as `load_target(path, quantize="int8")` does at
    load: a new Target (the original is left as it is)."""
    from flax import traverse_util

    quantization.check_quantize(quantize)
    if target.config.quantization is not None:
        raise ValueError("the target is already quantized")
    cfg = target.config.replace(quantization="int8", quantize_lm_head=bool(lm_head))
    names = set(quantization.LINEAR_NAMES) | ({"lm_head"} if lm_head else set())
    out = {}
    params = layer_stack.unstack_layers(target.params)  # quantized per layer, as at load
    for key, value in traverse_util.flatten_dict(params).items():
        if key[-1] == "kernel" and key[-2] in names:
            q, s = quantization.quantize_int8(np.asarray(jax.device_get(value), np.float32))
            out[key], out[key[:-1] + ("kernel_scale",)] = jnp.asarray(q), jnp.asarray(s)
        else:
            out[key] = value
    params = layer_stack.to_layout(traverse_util.unflatten_dict(out), cfg)
    return Target(cfg, params, target.path, target.attention_impl)


def save_target(target: Target, path: str, dtype: Optional[str] = None) -> None:
    """Writes the target as a Hugging Face directory (config.json + safetensors).

    An int8 target is written in the `dflash_int8` format (`dflash_jax/models/quantization.py`: int8
    `weight` [out, in] + float32 `weight_scale` [out] per quantized linear, the config's
    `quantization_config` saying so) that `load_target` reads back as int8; `dtype` casts the
    other tensors only. Tokenizer files of the source directory are copied along, so the result is self-contained.
    """
    extra = {}
    if target.path:
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "generation_config.json",
        ):
            extra[name] = os.path.join(target.path, name)
    _save_params(target.config, target.params, str(path), dtype=dtype, extra_files=extra)


# ------------------------------------------------------------------ Hugging Face directories


def _load_params(
    path: str,
    dtype="float32",
    param_dtype=None,
    quantize: Optional[str] = None,
    quantize_lm_head: bool = False,
) -> Tuple[ModelConfig, dict]:
    """(config, params) of a `Qwen3ForCausalLM` / `LlamaForCausalLM` / `Qwen3MoeForCausalLM`
    directory (a MoE layer's per-expert tensors stacked to [E, ...]).

    A block-FP8 checkpoint is dequantized into `param_dtype`; an int8 one (`save_target` of an
    int8 target) stays int8. quantize (checked by `load_target`) "int8": the decoder linears
    (and the LM head with `quantize_lm_head`) quantized per output channel as they are read.
    The settings against the config and its quantization_config are checked before any weight
    is read.
    """
    cfg = checkpoint.read_target_config(path, dtype=dtype, param_dtype=param_dtype)
    spec = quantization.parse_quantization_config(
        checkpoint.read_config(path), os.path.join(path, "config.json")
    )
    if quantize is not None or quantize_lm_head:
        if quantize is None and cfg.quantization is None:
            raise ValueError("quantize_lm_head needs quantize='int8' (or an int8 checkpoint)")
        cfg = cfg.replace(
            quantization="int8", quantize_lm_head=bool(quantize_lm_head or cfg.quantize_lm_head)
        )
    model = target_module(cfg)
    abstract = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
    )
    prefix, skip = "model.", ()
    if cfg.is_hybrid:  # a published Qwen3.5 checkpoint is the vision-language model
        store = checkpoint.open_store(path)
        try:
            if "model.language_model.embed_tokens.weight" in store:
                prefix = "model.language_model."
        finally:
            store.close()
        skip = ("model.visual.", "mtp.")  # the vision tower, the multi-token-prediction head
    params = checkpoint.load_params(
        path,
        abstract,
        prefix=prefix,
        param_dtype=cfg.param_dtype,
        optional=lambda n: (
            (cfg.tie_word_embeddings and n == "lm_head.weight") or n.startswith(skip)
        ),
        fp8_block=spec.block_size if spec is not None and spec.method == "fp8" else None,
    )
    return cfg, params


def _save_params(
    cfg: ModelConfig, params, path: str, dtype=None, extra_files: Optional[Dict[str, str]] = None
) -> None:
    """Writes `config.json` + safetensors that transformers' `from_pretrained` loads."""
    dtype = cfg.param_dtype if dtype is None else dtype
    os.makedirs(path, exist_ok=True)
    tensors = checkpoint.params_to_hf(
        layer_stack.unstack_layers(params), prefix="model.", dtype=dtype
    )
    safetensors_io.save_sharded(path, tensors)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(torch_dtype=checkpoint.dtype_name(as_dtype(dtype))), f, indent=2)
    for name, src in (extra_files or {}).items():
        if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(
            os.path.join(path, name)
        ):
            with open(src, "rb") as fi, open(os.path.join(path, name), "wb") as fo:
                fo.write(fi.read())
