"""The verifier of any supported target: its module (`Transformer`, or `HybridTransformer` for
a Qwen3.5-style hybrid), its empty decoding cache and random parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.models.config import ModelConfig
from dflash_jax.models.hybrid import HybridCache, HybridTransformer
from dflash_jax.models.transformer import KVCache, Transformer


def target_module(cfg: ModelConfig, attention_impl: str = "xla") -> Transformer:
    """The verifier module of `cfg`: a `HybridTransformer` for a hybrid target."""
    cls = HybridTransformer if cfg.hybrid is not None else Transformer
    return cls(cfg, attention_impl)


def new_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=None):
    """A target's empty decoding cache: a `KVCache`, or a `HybridCache` for a hybrid target."""
    if cfg.hybrid is not None:
        return HybridCache.create(cfg, batch, capacity, dtype, stacked=cfg.scans_layers)
    return KVCache.create(cfg, batch, capacity, dtype, stacked=cfg.scans_layers)


def init_params(cfg: ModelConfig, seed: int = 0):
    """Random parameters (normal, std 0.02 for matrices) as a plain pytree."""
    model = target_module(cfg)
    ids = jnp.zeros((1, 2), jnp.int32)
    return model.init(jax.random.PRNGKey(seed), ids)["params"]
