"""dflash-jax: DFlash block-diffusion speculative decoding in JAX/Flax.

Public API:
  load_target(path, dtype="float32") -> Target      a Hugging Face Qwen3 / Llama-3 verifier
  save_target(target, path)
"""

from dflash_jax.config import ModelConfig
from dflash_jax.model import KVCache, Transformer
from dflash_jax.safetensors_io import CheckpointError
from dflash_jax.target import ForwardOutput, Target, load_target, save_target

__all__ = [
    "CheckpointError",
    "ForwardOutput",
    "KVCache",
    "ModelConfig",
    "Target",
    "Transformer",
    "load_target",
    "save_target",
]
