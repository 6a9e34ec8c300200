"""The verifier as a user-facing object: config + params + compiled forward."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models import checkpoint, hub, layer_stack
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.verifier import new_cache, target_module
from dflash_jax.models.transformer import Transformer


@dataclasses.dataclass
class ForwardOutput:
    """logits: float32 [B, T, V]; taps: [B, T, n*H] when requested, else None."""

    logits: jnp.ndarray
    taps: Optional[jnp.ndarray] = None


@dataclasses.dataclass(eq=False)
class Target:
    """A loaded verifier: `config` (ModelConfig), `params` (plain pytree), `path` (or None).

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
    from dflash_jax.models import quantization

    quantization.check_quantize(quantize)  # a bad request is refused before any download
    path = hub.local_path(path, what="target")
    cfg, params = checkpoint.load_target_params(
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

    from dflash_jax.models import quantization

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
    checkpoint.save_target_params(
        target.config, target.params, str(path), dtype=dtype, extra_files=extra
    )
