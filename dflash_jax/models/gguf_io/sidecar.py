"""The sidecar: the small model directory derived from a GGUF file (config.json, tokenizer
files, generation_config.json; no weights), cached per (file, size, mtime), written
atomically; `check_file` checks a file before it is written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Dict, List, Optional


from dflash_jax.models.gguf_io.common import (
    GGUFError,
    SIDECAR_VERSION,
)
from dflash_jax.models.gguf_io.locate import (
    find_gguf,
)
from dflash_jax.models.gguf_io.reader import (
    GGUFStore,
    _identity,
    architecture,
    check_tensors,
    hf_config,
    open_reader,
)
from dflash_jax.models.gguf_io.tokenizer import (
    check_tokenizer,
    tokenizer_files,
)


def cache_root() -> str:
    root = os.environ.get("DFLASH_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "dflash_jax"
    )
    return os.path.join(root, "gguf")


def model_dir(path: str) -> str:
    """The sidecar directory of GGUF file `path` (built on first use, cached): config.json
    (with `gguf_file`), tokenizer.json, tokenizer_config.json (chat template, special tokens),
    generation_config.json (stop ids). Every check of the file runs before it is written."""
    ident = _identity(path)
    key = hashlib.sha1(json.dumps([ident, SIDECAR_VERSION], sort_keys=True).encode()).hexdigest()[
        :12
    ]
    stem = os.path.splitext(os.path.basename(path))[0]
    out = os.path.join(cache_root(), f"{stem}-{key}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    cfg = check_file(path)  # every check, before anything is written
    reader = open_reader(path)
    cfg.update(ident)
    files, why = tokenizer_files(reader)
    files["config.json"] = cfg
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{stem}-", dir=cache_root())
    try:
        for name, obj in files.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(
                    obj, f, ensure_ascii=False, indent=None if name == "tokenizer.json" else 2
                )
        if why is not None:
            with open(os.path.join(tmp, "NO_TOKENIZER.txt"), "w") as f:
                f.write(f"{path}: no tokenizer.json: {why}\n")
        try:
            os.rename(tmp, out)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_file(path: str) -> dict:
    """Every check of GGUF file `path` that needs no weight read, in order: the header
    (`open_reader`), the metadata (`hf_config`), the config's rules (`ModelConfig.from_hf`,
    as for any config.json), the tensors' types and shapes against the metadata
    (`check_tensors`), the tokenizer metadata (`check_tokenizer`). Returns the config dict;
    every failure is one GGUFError line naming `path` (never the derived directory). The
    weights' values (NaN, infinity) are checked as they are dequantized (`GGUFStore.get`)."""
    from dflash_jax.models.config import ModelConfig

    reader = open_reader(path)
    cfg = hf_config(reader)
    try:
        ModelConfig.from_hf(cfg, source=f"{path} (metadata)")
    except ValueError as e:
        raise GGUFError(str(e)) from None
    GGUFStore(path, cfg)  # every tensor's type
    check_tensors(reader, cfg)
    check_tokenizer(reader, cfg["vocab_size"])
    return cfg


def as_model_dir(name_or_path) -> Optional[str]:
    """The sidecar directory when `name_or_path` names a GGUF model, else None."""
    gguf_path = find_gguf(os.fspath(name_or_path))
    return None if gguf_path is None else model_dir(gguf_path)


def gguf_source(model_directory: str, hf: dict) -> Optional[str]:
    """The GGUF file a sidecar's config.json names (None for an ordinary directory); GGUFError
    when it is gone or has changed since the sidecar was written."""
    src = hf.get("gguf_file")
    if src is None:
        return None
    if not isinstance(src, str) or not os.path.isfile(src):
        raise GGUFError(f"{model_directory}: its GGUF file {src!r} no longer exists")
    ident = _identity(src)
    if (ident["gguf_size"], ident["gguf_mtime_ns"]) != (
        hf.get("gguf_size"),
        hf.get("gguf_mtime_ns"),
    ):
        raise GGUFError(
            f"{model_directory}: {src} changed since this directory was derived from it; "
            "load the .gguf file itself"
        )
    return src


def describe(path: str) -> List[str]:
    """Lines about a GGUF file (architecture, tensor types) for logs and `infer.py`."""
    reader = open_reader(path)
    counts: Dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    types = ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda x: -x[1]))
    return [f"{path}: GGUF {architecture(reader)}, {len(reader.tensors)} tensors ({types})"]
