"""dflash-jax: DFlash block-diffusion speculative decoding in JAX/Flax.

Public API:
  load_target(path, dtype="float32") -> Target      a Hugging Face Qwen3 / Llama-3 verifier
  save_target(target, path)
  quantize_target(target, "int8") -> Target          int8 weight-only (load_target(quantize=))
  load_drafter(path, target=...) -> Drafter          a z-lab DFlash drafter
  save_drafter(drafter, path)
  generate(target, drafter_or_None, prompts, max_new_tokens, ...) -> GenerationResult
"""

from typing import TYPE_CHECKING

from dflash_jax import lazy as _lazy  # (stdlib only)

# The public names, imported on first use (PEP 562): `import dflash_jax` itself loads no JAX,
# so a command-line tool can arm its Ctrl-C handling (`dflash_jax.interrupts`) before the
# seconds of JAX and Flax imports.
_EXPORTS = {
    "ModelConfig": "config",
    "DFlashDrafter": "drafter",
    "Drafter": "drafter",
    "DrafterConfig": "drafter",
    "init_drafter_params": "drafter",
    "load_drafter": "drafter",
    "make_drafter_config": "drafter",
    "save_drafter": "drafter",
    "GenerationResult": "decoding",
    "generate": "decoding",
    "KVCache": "model",
    "Transformer": "model",
    "CheckpointError": "safetensors_io",
    "ForwardOutput": "target",
    "Target": "target",
    "load_target": "target",
    "quantize_target": "target",
    "save_target": "target",
}


def __getattr__(name):
    """A public name (imported from its module on first use), or a submodule (`dj.model`)."""
    return _lazy.attribute(__name__, _EXPORTS, globals(), name)


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs: the names as plain imports
    from dflash_jax.config import ModelConfig  # noqa: F401
    from dflash_jax.decoding import GenerationResult, generate  # noqa: F401
    from dflash_jax.drafter import (  # noqa: F401
        DFlashDrafter,
        Drafter,
        DrafterConfig,
        init_drafter_params,
        load_drafter,
        make_drafter_config,
        save_drafter,
    )
    from dflash_jax.model import KVCache, Transformer  # noqa: F401
    from dflash_jax.safetensors_io import CheckpointError  # noqa: F401
    from dflash_jax.target import (  # noqa: F401
        ForwardOutput,
        Target,
        load_target,
        quantize_target,
        save_target,
    )

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
