"""dflash-jax: DFlash block-diffusion speculative decoding in JAX/Flax.

Public API:
  load_target(path, dtype="float32") -> Target      a Hugging Face Qwen3 / Llama-3 verifier
  save_target(target, path)
  quantize_target(target, "int8") -> Target          int8 weight-only (load_target(quantize=))
  load_drafter(path, target=...) -> Drafter          a z-lab DFlash drafter
  save_drafter(drafter, path)
  generate(target, drafter_or_None, prompts, max_new_tokens, ...) -> GenerationResult
"""

from dflash_jax.config import ModelConfig
from dflash_jax.drafter import (
    DFlashDrafter,
    Drafter,
    DrafterConfig,
    init_drafter_params,
    load_drafter,
    make_drafter_config,
    save_drafter,
)
from dflash_jax.decoding import GenerationResult, generate
from dflash_jax.model import KVCache, Transformer
from dflash_jax.safetensors_io import CheckpointError
from dflash_jax.target import ForwardOutput, Target, load_target, quantize_target, save_target

__all__ = [
    "CheckpointError",
    "DFlashDrafter",
    "Drafter",
    "DrafterConfig",
    "GenerationResult",
    "generate",
    "init_drafter_params",
    "load_drafter",
    "make_drafter_config",
    "save_drafter",
    "ForwardOutput",
    "KVCache",
    "ModelConfig",
    "Target",
    "Transformer",
    "load_target",
    "quantize_target",
    "save_target",
]
