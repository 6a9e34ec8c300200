"""Model locations: a local directory, or a Hugging Face hub id (`Qwen/Qwen3-8B`).

    resolve("path/to/dir")               -> "path/to/dir" (unchanged when it is a directory)
    resolve("z-lab/Qwen3-8B-DFlash-b16") -> the local snapshot directory of that repository
    resolve("model.gguf")                -> a directory derived from the GGUF (`gguf_io`): its
                                            config and tokenizer, weights read from the file
    resolve("smollm2-135m-instruct")     -> the same for the GGUF of an installed package

Hub ids go through `huggingface_hub.snapshot_download`, fetching only the files the loaders read
(config, safetensors and their index, tokenizer and generation config), so the usual cache
(`HF_HOME` / `HF_HUB_CACHE`), `HF_HUB_OFFLINE=1` (cache only) and `HF_TOKEN` (gated or private
repositories) behave as with transformers. Every failure is one `HubError` line that names the
id, the reason and the fix; `resolve_or_exit` turns it into exit status 2 for the CLIs.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Optional

# The files `load_target` / `load_drafter` / the tokenizer loader read; nothing else is fetched
# (no PyTorch .bin weights, no remote code, no README assets).
ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

# Hugging Face repository ids: "name" or "namespace/name" of [A-Za-z0-9._-], optionally
# "@revision". Anything else (absolute or relative paths with more parts) is a local path.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?(@[\w./-]+)?$")


class HubError(ValueError):
    """A model location that is neither a local directory nor an obtainable hub repository."""


def looks_like_repo_id(name: str) -> bool:
    """True for "org/name" (or "name", optionally "@revision") that is not a local path."""
    name = str(name)
    return (
        bool(_REPO_ID.match(name))
        and not name.startswith(".")
        and ".." not in name
        and not name.endswith((".json", ".safetensors"))
    )


def resolve(name_or_path, *, what: str = "model") -> str:
    """A local directory for `name_or_path`: itself if it is a directory, else the snapshot of
    the hub repository it names (downloaded or taken from the cache). Raises `HubError`."""
    path = os.fspath(name_or_path)
    gguf_dir = _gguf_dir(path, what)
    if gguf_dir is not None:
        return gguf_dir
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise HubError(
            f"{what} {path!r} is a file; expected a Hugging Face model directory "
            "(config.json + safetensors) or a hub id such as Qwen/Qwen3-8B"
        )
    if not looks_like_repo_id(path):
        raise HubError(
            f"{what} directory {path!r} not found (and it is not a hub id of the "
            "form org/name); check the path"
        )
    repo_id, _, revision = path.partition("@")
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise HubError(
            f"{what} {path!r} is not a local directory, and resolving it as a hub id "
            "needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    offline = _offline()
    try:
        local = huggingface_hub.snapshot_download(
            repo_id, revision=revision or None, allow_patterns=list(ALLOW_PATTERNS)
        )
    except errors.GatedRepoError:
        raise HubError(
            f"{what} {path!r}: the hub repository is gated; accept its terms on "
            "huggingface.co and set HF_TOKEN (or run `hf auth login`)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise HubError(
            f"{what} {path!r}: no such hub repository (or it is private: set "
            "HF_TOKEN); check the id, or pass a local directory"
        ) from None
    except errors.RevisionNotFoundError:
        raise HubError(
            f"{what} {path!r}: the hub repository has no revision {revision!r}"
        ) from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, OSError) as e:
        if offline:
            reason = "HF_HUB_OFFLINE is set and it is not in the local cache"
            fix = "unset HF_HUB_OFFLINE on a connected machine once, or pass a local directory"
        else:
            reason = f"the hub could not be reached and it is not cached ({_first_line(e)})"
            fix = "check connectivity (or HF_ENDPOINT), or pass a local directory"
        raise HubError(
            f"{what} {path!r} is not a local directory and could not be fetched "
            f"from the Hugging Face hub: {reason}; fix: {fix}"
        ) from None
    if not os.path.exists(os.path.join(local, "config.json")):
        raise HubError(
            f"{what} {path!r}: the hub repository has no config.json; it is not a "
            "Hugging Face model (or DFlash drafter) repository"
        )
    return local


def resolve_or_exit(name_or_path, *, what: str = "model") -> str:
    """`resolve` for command-line tools: a failure is one line on stderr and exit status 2."""
    try:
        return resolve(name_or_path, what=what)
    except HubError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def local_path(name_or_path, *, what: str = "model") -> str:
    """What the loaders call: an existing path, or anything that cannot be a hub id, is returned
    unchanged (the loader reports a missing directory in its own terms); a hub id is resolved."""
    path = os.fspath(name_or_path)
    gguf_dir = _gguf_dir(path, what)
    if gguf_dir is not None:
        return gguf_dir
    if os.path.exists(path) or not looks_like_repo_id(path):
        return path
    return resolve(path, what=what)


def _gguf_dir(path: str, what: str) -> Optional[str]:
    """The model directory derived from a GGUF file (`dflash_jax.models.gguf_io`) when `path` is one,
    a directory holding one, or a known model name; else None."""
    from dflash_jax.models import gguf_io

    try:
        return gguf_io.as_model_dir(path)
    except gguf_io.GGUFError as e:
        raise HubError(f"{what}: {e}") from None


def resolve_optional(name_or_path: Optional[str], *, what: str = "model") -> Optional[str]:
    return None if not name_or_path else resolve(name_or_path, what=what)


def _offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:
        return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:160]
