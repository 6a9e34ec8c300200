"""GGUF targets (llama.cpp's single-file format), read as Hugging Face model directories.

A GGUF file holds what a Hugging Face directory spreads over config.json, tokenizer.json,
tokenizer_config.json, generation_config.json and safetensors. `model_dir(path)` derives the
first four from the file's metadata into a small cache directory (a "sidecar", a few MB: no
weights) whose config.json names the GGUF (`gguf_file`, with the file's size and mtime);
`checkpoint.load_params` reads that directory's tensors from the GGUF through `GGUFStore`
(dequantized to float32 with the `gguf` package; llama.cpp's Q/K row permutation undone for
llama). So every loader that takes a directory (targets, tokenizers, chat templates, stop ids,
train.py, infer.py, the benchmarks) takes a GGUF target as it is:

    dj.load_target("model.gguf")               # a file
    dj.load_target("dir/")                      # a directory holding one .gguf (no config.json)
    dj.load_target("smollm2-135m-instruct")    # a known name: the GGUF of an installed package

Architectures: llama, qwen3, qwen3moe. Every GGML type the `gguf` package dequantizes (F32, F16,
BF16, Q4_0 ... Q8_0, the K-quants, the IQ types). What is wrong with a file is one `GGUFError`
line naming the .gguf, before any weight is read and before the sidecar is written
(`check_file`): bad magic, a truncated file, another architecture, a tensor type this reader
cannot dequantize (the integer types among them), metadata that is missing, of the wrong kind or
out of range (a head count of 0, a rotary dimension other than the head size), metadata that
contradicts the tensors' shapes (head counts, head size, widths, layers, vocabulary), a token id
outside the vocabulary, a malformed merge. A NaN or infinite weight is refused as its tensor is
dequantized (a float32 sum per tensor, the exact test only when that sum is not finite): on
SmolLM2-135M about 45 ms over its 134.5M values, against 0.8 s of dequantizing and 3 s of
`load_target` (the exact test alone, np.isfinite(a).all(), takes 180 ms).

The sidecar cache lives in $DFLASH_JAX_CACHE/gguf (default ~/.cache/dflash_jax/gguf), one
directory per (file, size, mtime); it is written atomically and rebuilt when the file changes.

The package, one role a module: `common` (constants, `GGUFError`), `locate` (known models, a
directory's .gguf), `reader` (metadata as a config.json dict, tensor checks, `GGUFStore`),
`tokenizer` (the tokenizer files) and `sidecar` (the derived directory). Their names are
re-exported here.
"""

from dflash_jax.models.gguf_io.common import (  # noqa: F401
    GGUF_MAGIC,
    ARCHITECTURES,
    KNOWN_MODELS,
    DEFAULT_DRAFTERS,
    SIDECAR_VERSION,
    _GPT2_SPLIT,
    _LLAMA3_SPLIT,
    _QWEN2_SPLIT,
    PRE_TOKENIZERS,
    _TOKEN_CONTROL,
    _TOKEN_USER_DEFINED,
    GGUFError,
)
from dflash_jax.models.gguf_io.locate import (  # noqa: F401
    known_model_path,
    known_name,
    find_gguf,
)
from dflash_jax.models.gguf_io.reader import (  # noqa: F401
    _identity,
    _reader_cached,
    open_reader,
    _open_reader,
    _field,
    _f32,
    architecture,
    _int_field,
    _Meta,
    _head_dim,
    _rope_scaling,
    hf_config,
    _GLOBAL_NAMES,
    _LAYER_NAMES,
    _EXPERT_NAMES,
    unpermute_rows,
    expected_shapes,
    check_tensors,
    readable_types,
    check_finite,
    GGUFStore,
)
from dflash_jax.models.gguf_io.tokenizer import (  # noqa: F401
    _bytes_to_unicode,
    build_tokenizer,
    _TOKEN_ID_KEYS,
    check_tokenizer,
    tokenizer_files,
)
from dflash_jax.models.gguf_io.sidecar import (  # noqa: F401
    cache_root,
    model_dir,
    check_file,
    as_model_dir,
    gguf_source,
    describe,
)
