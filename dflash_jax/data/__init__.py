"""Training data pipeline: TFDS builders, tokenizers, packing and batching, prompt pools.

``tokenizer`` and ``packing`` need only ``tokenizers`` and numpy.  The TFDS
builders (``builders``) and the prompt pools cut from their files (``prompts``)
need ``tensorflow-datasets`` and ``array_record`` but not TensorFlow; they are
imported lazily, on first use of one of their names.
"""

from __future__ import annotations

import importlib
from typing import Any

from .packing import (
    PackedBatchIterator,
    make_batch_iterator,
    pack_documents,
    segment_positions,
    tokenize_example,
)
from .tokenizer import (
    EOS_TOKEN,
    MASK_TOKEN,
    TextTokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)

_LAZY_BUILDERS = (
    "PythonStdlib",
    "StdlibConfig",
    "UserFiles",
    "UserFilesConfig",
    "build_python_stdlib",
    "build_user_files",
    "decode_example",
    "iter_texts",
    "list_stdlib_files",
    "load_split",
    "split_of",
    "stdlib_config",
    "user_files_config",
)
_LAZY_PROMPTS = ("code_prompts", "stdlib_prompts")

__all__ = [
    "EOS_TOKEN",
    "MASK_TOKEN",
    "PackedBatchIterator",
    "TextTokenizer",
    "load_tokenizer",
    "make_batch_iterator",
    "pack_documents",
    "segment_positions",
    "tokenize_example",
    "train_bpe_tokenizer",
    *_LAZY_BUILDERS,
    *_LAZY_PROMPTS,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY_BUILDERS:
        module = importlib.import_module(".builders", __name__)
        return getattr(module, name)
    if name in _LAZY_PROMPTS:
        module = importlib.import_module(".prompts", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
