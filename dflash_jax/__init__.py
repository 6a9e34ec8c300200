"""dflash-jax: DFlash block-diffusion speculative decoding in JAX/Flax.

Public API:
  load_target(path, dtype="float32", scan_layers=False) -> Target
                                                     a Hugging Face / GGUF target: Qwen3, Llama-3,
                                                     SmolLM2, Qwen3-MoE, hybrid Qwen3.5 / 3.6
  save_target(target, path)
  quantize_target(target, "int8") -> Target          int8 weight-only (load_target(quantize=))
  load_drafter(path, target=...) -> Drafter          a z-lab DFlash drafter (DFlash 2, sliding
                                                     windows and draft vocabularies from its config)
  PromptLookup(block_size=8, max_ngram=3)            n-gram drafting from the context
  load_eagle3(path, target=...) -> Eagle3            an EAGLE-3 drafter (save_eagle3)
  save_drafter(drafter, path)
  generate(target, drafter_or_None, prompts, max_new_tokens, ...) -> GenerationResult
  Generator(target, drafter_or_None, Settings(...))(prompts, max_new_tokens, seed=None)
                                                     the settings checked once, called per batch

Subpackages, lowest first (each imports only those before it; tests/test_layering.py):
  support    console, provenance, Ctrl-C handling, lazy attributes, the CLI error policy, checks
  models     config, transformer, attention, MoE, quantization, Target, checkpoint formats,
             sampling
  data       tokenizers, packing, TFDS builders, prompt files and chat templates
  parallel   partition rules, process groups, the multi-process launcher
  drafters   the drafter kinds and their registry (DFlash, DFlash 2, EAGLE-3, prompt lookup;
             draft trees, draft vocabularies)
  decoding   the speculative step and its programs, request checks
  training   the drafter trainer (Optax, Orbax)
  frontend   the pieces of infer.py: batch runner, report, text generation, flag checks
  dry_run    the real programs compiled for TPU / GPU topologies on this machine
"""

from typing import TYPE_CHECKING

from dflash_jax.support import lazy as _lazy  # (stdlib only)

# The public names, imported on first use (PEP 562): `import dflash_jax` itself loads no JAX,
# so a command-line tool can arm its Ctrl-C handling (`dflash_jax.support.interrupts`) before the
# seconds of JAX and Flax imports.
_EXPORTS = {
    "ModelConfig": "models.config",
    "DFlashDrafter": "drafters.dflash",
    "Drafter": "drafters.dflash",
    "DrafterConfig": "drafters.dflash",
    "init_drafter_params": "drafters.dflash",
    "load_drafter": "drafters.dflash",
    "make_drafter_config": "drafters.dflash",
    "save_drafter": "drafters.dflash",
    "PromptLookup": "drafters.prompt_lookup",
    "Eagle3": "drafters.eagle3",
    "load_eagle3": "drafters.eagle3",
    "save_eagle3": "drafters.eagle3",
    "GenerationResult": "decoding.generation",
    "Generator": "decoding.generation",
    "Settings": "decoding.request",
    "generate": "decoding.generation",
    "KVCache": "models.transformer",
    "Transformer": "models.transformer",
    "CheckpointError": "models.safetensors_io",
    "ForwardOutput": "models.target",
    "Target": "models.target",
    "load_target": "models.target",
    "quantize_target": "models.target",
    "save_target": "models.target",
}


def __getattr__(name):
    """A public name (imported from its module on first use), or a subpackage (`dj.models`)."""
    return _lazy.attribute(__name__, _EXPORTS, globals(), name)


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs: the names as plain imports
    from dflash_jax.decoding.generation import GenerationResult, Generator, generate  # noqa: F401
    from dflash_jax.decoding.request import Settings  # noqa: F401
    from dflash_jax.drafters.dflash import (  # noqa: F401
        DFlashDrafter,
        Drafter,
        DrafterConfig,
        init_drafter_params,
        load_drafter,
        make_drafter_config,
        save_drafter,
    )
    from dflash_jax.drafters.eagle3 import Eagle3, load_eagle3, save_eagle3  # noqa: F401
    from dflash_jax.drafters.prompt_lookup import PromptLookup  # noqa: F401
    from dflash_jax.models.config import ModelConfig  # noqa: F401
    from dflash_jax.models.safetensors_io import CheckpointError  # noqa: F401
    from dflash_jax.models.target import (  # noqa: F401
        ForwardOutput,
        Target,
        load_target,
        quantize_target,
        save_target,
    )
    from dflash_jax.models.transformer import KVCache, Transformer  # noqa: F401

__all__ = [
    "CheckpointError",
    "DFlashDrafter",
    "Drafter",
    "DrafterConfig",
    "Eagle3",
    "GenerationResult",
    "Generator",
    "Settings",
    "generate",
    "init_drafter_params",
    "load_drafter",
    "load_eagle3",
    "make_drafter_config",
    "save_drafter",
    "save_eagle3",
    "ForwardOutput",
    "KVCache",
    "ModelConfig",
    "PromptLookup",
    "Target",
    "Transformer",
    "load_target",
    "quantize_target",
    "save_target",
]
