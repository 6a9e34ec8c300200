"""The models and their checkpoints: the config, the transformer (layers, attention, MoE,
int8 weight-only quantization), the target (`Target`), and the formats they load from and write
to (Hugging Face safetensors, GGUF, hub directories).

Submodules import on first use (`dflash_jax.models.<name>`); importing the package loads nothing."""

from dflash_jax.support import lazy as _lazy  # (stdlib only)


def __getattr__(name):
    return _lazy.attribute(__name__, {}, globals(), name)
