"""TFDS dataset builders that run without TensorFlow.

Both builders write ``array_record`` shards and are meant to be read back with
``builder.as_data_source(split=...)`` (random access, no ``tf.data``).  Text
fields use ``tfds.features.Text``; its numpy encode/decode path needs no
TensorFlow, and a data source returns the fields as UTF-8 ``bytes``
(use :func:`decode_example` to get ``str``).

* :class:`PythonStdlib` -- one example per ``.py`` file of the Python standard
  library found on this machine (``sysconfig.get_paths()["stdlib"]``), with a
  deterministic held-out ``validation`` split chosen by hashing the relative
  path, so a file is never in both splits.
* :class:`UserFiles` -- user files given by path: plain text (one example per
  file or per blank-line-separated document) and JSONL with ``{"text": ...}``
  or ``{"prompt": ..., "response": ...}`` records.

Builders are configured through their ``BuilderConfig`` (see
:func:`stdlib_config` / :func:`user_files_config`) and the usual ``data_dir``.
:func:`build_python_stdlib` / :func:`build_user_files` build (or reuse) and
return the prepared builder.  Prompts cut from the files are in
:mod:`dflash_jax.data.prompts`.

About 500 lines, over the project's ~450: the two builders share the base
class, the path-hash split, the config fingerprints and the preparation with
progress; one module per builder would make those private helpers cross
module boundaries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import tensorflow_datasets as tfds

from dflash_jax.support import console

__all__ = [
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
]

# Directory names never included in the stdlib corpus.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# The stdlib's own test suites: left out unless ``include_tests`` (they are ~1.6x the size of
# the library code itself).
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_DEFAULT_MAX_FILE_BYTES = 300_000
_DEFAULT_VALIDATION_PERCENT = 3.0


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def _hash_int(salt: str, key: str) -> int:
    digest = hashlib.sha256(f"{salt}\0{key}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def split_of(key: str, validation_percent: float) -> str:
    """Return ``"validation"`` or ``"train"`` for ``key`` (e.g. a relative path).

    Deterministic across processes and machines (SHA-256, not ``hash()``): the
    key falls into one of 10,000 buckets and the lowest
    ``validation_percent * 100`` buckets are held out.
    """
    if not 0.0 <= validation_percent <= 100.0:
        raise ValueError(f"validation_percent must be in [0, 100], got {validation_percent}")
    bucket = _hash_int("split", key) % 10_000
    return "validation" if bucket < round(validation_percent * 100) else "train"


def _fmt_pct(pct: float) -> str:
    return f"{pct:g}".replace(".", "p").replace("-", "m")


def _short_hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:12]


def decode_example(example: dict[str, Any]) -> dict[str, Any]:
    """Turn the ``bytes`` text fields a TFDS data source returns into ``str``."""
    return {k: (v.decode("utf-8") if isinstance(v, bytes) else v) for k, v in example.items()}


def iter_texts(source: Sequence[dict[str, Any]]) -> Iterator[str]:
    """The text of each example of a data source (``prompt + response`` for
    pairs), e.g. to train a tokenizer: ``train_bpe_tokenizer(iter_texts(src))``."""
    for i in range(len(source)):
        ex = decode_example(source[i])
        if ex.get("prompt") or ex.get("response"):
            yield ex.get("prompt", "") + ex.get("response", "")
        else:
            yield ex.get("text", "")


def load_split(builder: tfds.core.DatasetBuilder, split: str = "train"):
    """Random-access data source of a prepared builder's split (no TensorFlow)."""
    return builder.as_data_source(split=split)


class _LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base class: a builder defined in this module, not registered with TFDS.

    ``GeneratorBasedBuilder.code_path`` (used to look for a ``checksums.tsv``
    next to the builder's code) references ``importlib_resources``, which
    tensorflow-datasets 4.9.x only declares as a dependency for Python < 3.9,
    so on 3.11+ it raises ``ModuleNotFoundError`` for any builder that lives in
    a package.  Our builders download nothing, so point it at this file.
    """

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        from etils import epath

        return epath.Path(__file__)


# ----------------------------------------------------------------------------
# Python standard library corpus
# ----------------------------------------------------------------------------


def _default_stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_stdlib_files(
    stdlib_dir: str | os.PathLike | None = None,
    *,
    max_files: int | None = None,
    max_file_bytes: int = _DEFAULT_MAX_FILE_BYTES,
    include_tests: bool = False,
) -> list[str]:
    """Sorted relative (POSIX) paths of the stdlib ``.py`` files in the corpus.

    Skips ``site-packages``/``__pycache__`` directories, the test suites
    (``test``/``tests``/``idle_test``) unless ``include_tests``, files larger
    than ``max_file_bytes`` and empty files.  Files
    that are not valid UTF-8 are dropped later, when they are read.  With
    ``max_files`` a deterministic subset spread across the tree is returned
    (the files with the smallest hash of their relative path).
    """
    root = Path(stdlib_dir or _default_stdlib_dir())
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib directory not found: {root}")
    skip = _SKIP_DIRS if include_tests else _SKIP_DIRS | _TEST_DIRS
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            full = Path(dirpath) / fn
            try:
                size = full.stat().st_size
            except OSError:
                continue
            if size == 0 or size > max_file_bytes:
                continue
            out.append(full.relative_to(root).as_posix())
    out.sort()
    if max_files is not None and max_files < len(out):
        out = sorted(sorted(out, key=lambda p: _hash_int("subset", p))[:max_files])
    return out


@dataclasses.dataclass(eq=False)
class StdlibConfig(tfds.core.BuilderConfig):
    """Options of the :class:`PythonStdlib` builder (see :func:`stdlib_config`)."""

    stdlib_dir: str | None = None
    max_files: int | None = None
    max_file_bytes: int = _DEFAULT_MAX_FILE_BYTES
    validation_percent: float = _DEFAULT_VALIDATION_PERCENT
    include_tests: bool = False


def stdlib_config(
    *,
    max_files: int | None = None,
    validation_percent: float = _DEFAULT_VALIDATION_PERCENT,
    max_file_bytes: int = _DEFAULT_MAX_FILE_BYTES,
    stdlib_dir: str | os.PathLike | None = None,
    include_tests: bool = False,
) -> StdlibConfig:
    """A :class:`StdlibConfig` whose name encodes every option.

    The name includes the Python version (``py311``) because the corpus is the
    running interpreter's stdlib; a custom ``stdlib_dir`` adds a hash of the
    path.  Distinct options therefore never share a prepared directory.
    Splits go by a hash of each file's path, so with ``include_tests`` every
    library file keeps the split it has without them: the held-out library
    files stay held out.
    """
    split_of("", validation_percent)  # validates the range
    parts = [
        f"py{sys.version_info.major}{sys.version_info.minor}",
        f"files{max_files}" if max_files is not None else "all",
        f"val{_fmt_pct(validation_percent)}",
        f"max{max_file_bytes}",
    ]
    if include_tests:
        parts.append("tests")
    if stdlib_dir is not None:
        stdlib_dir = os.fspath(Path(stdlib_dir).resolve())
        parts.append("dir" + _short_hash(stdlib_dir))
    return StdlibConfig(
        name="-".join(parts),
        description="Python standard library sources, one example per file.",
        stdlib_dir=stdlib_dir,
        max_files=max_files,
        max_file_bytes=max_file_bytes,
        validation_percent=validation_percent,
        include_tests=include_tests,
    )


class PythonStdlib(_LocalBuilder, skip_registration=True):
    """Python stdlib ``.py`` files: features ``text`` and ``path`` (relative).

    Splits: ``train`` and ``validation`` (by hash of the relative path); a
    split that would be empty (tiny ``max_files`` subsets) is left out.
    Construct with ``PythonStdlib(config=stdlib_config(...), data_dir=...,
    file_format="array_record")`` or use :func:`build_python_stdlib`.
    """

    name = "python_stdlib"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [stdlib_config()]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Python standard library source files (code corpus).",
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "path": tfds.features.Text()}
            ),
            supervised_keys=None,
        )

    def _split_generators(self, dl_manager):
        cfg: StdlibConfig = self.builder_config
        root = cfg.stdlib_dir or _default_stdlib_dir()
        files = list_stdlib_files(
            root,
            max_files=cfg.max_files,
            max_file_bytes=cfg.max_file_bytes,
            include_tests=cfg.include_tests,
        )
        by_split: dict[str, list[str]] = {"train": [], "validation": []}
        for rel in files:
            by_split[split_of(rel, cfg.validation_percent)].append(rel)
        # TFDS refuses to write an empty split, so leave empty ones out (e.g. a
        # tiny ``max_files`` subset may have no validation file).
        return {
            name: self._generate_examples(root=root, files=rels)
            for name, rels in by_split.items()
            if rels
        }

    def _generate_examples(self, root: str, files: Sequence[str]):
        for rel in console.progress(files, desc="stdlib corpus", unit="file"):
            try:
                raw = (Path(root) / rel).read_bytes()
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue  # unreadable or not UTF-8
            if "\x00" in text:
                continue
            yield rel, {"text": text, "path": rel}


def build_python_stdlib(
    data_dir: str | os.PathLike,
    *,
    max_files: int | None = None,
    validation_percent: float = _DEFAULT_VALIDATION_PERCENT,
    max_file_bytes: int = _DEFAULT_MAX_FILE_BYTES,
    stdlib_dir: str | os.PathLike | None = None,
    include_tests: bool = False,
) -> PythonStdlib:
    """Build (or reuse, if already prepared under ``data_dir``) the stdlib corpus."""
    config: StdlibConfig | str = stdlib_config(
        max_files=max_files,
        validation_percent=validation_percent,
        max_file_bytes=max_file_bytes,
        stdlib_dir=stdlib_dir,
        include_tests=include_tests,
    )
    # TFDS rejects a custom config named like a predefined one: use the name.
    if any(c.name == config.name for c in PythonStdlib.BUILDER_CONFIGS):
        config = config.name
    builder = PythonStdlib(
        config=config,
        data_dir=os.fspath(data_dir),
        file_format="array_record",
    )
    _prepare(builder)
    return builder


def _prepare(builder) -> None:
    """Writes the dataset unless it is there. Progress comes from `console.progress` over the
    source files (with an ETA); TFDS's own bars (example counts, no ETA) are turned off."""
    tfds.display_progress_bar(False)
    builder.download_and_prepare()


# ----------------------------------------------------------------------------
# User files
# ----------------------------------------------------------------------------

_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


@dataclasses.dataclass(eq=False)
class UserFilesConfig(tfds.core.BuilderConfig):
    """Options of the :class:`UserFiles` builder (see :func:`user_files_config`)."""

    paths: tuple[str, ...] = ()
    text_mode: str = "file"  # "file" | "blank_line"
    validation_percent: float = 0.0


def _fingerprint(paths: Sequence[str]) -> list[Any]:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append([p, st.st_size, st.st_mtime_ns])
    return out


def user_files_config(
    paths: Sequence[str | os.PathLike],
    *,
    text_mode: str = "file",
    validation_percent: float = 0.0,
    name: str | None = None,
) -> UserFilesConfig:
    """A :class:`UserFilesConfig` for ``paths``.

    ``text_mode``: ``"file"`` (one example per text file) or ``"blank_line"``
    (one per blank-line-separated document).  ``validation_percent`` > 0 adds a
    ``validation`` split chosen by hashing each example's key.  The default
    name hashes the options and each file's path, size and mtime, so editing
    a file leads to a fresh build instead of a stale cache.
    """
    if text_mode not in ("file", "blank_line"):
        raise ValueError(f"text_mode must be 'file' or 'blank_line', got {text_mode!r}")
    split_of("", validation_percent)
    resolved = tuple(os.fspath(Path(p).resolve()) for p in paths)
    if not resolved:
        raise ValueError("user_files_config needs at least one path")
    for p in resolved:
        if not os.path.isfile(p):
            raise FileNotFoundError(p)
    if name is None:
        name = "files-" + _short_hash([_fingerprint(resolved), text_mode, validation_percent])
    return UserFilesConfig(
        name=name,
        description="User-provided text / JSONL files.",
        paths=resolved,
        text_mode=text_mode,
        validation_percent=validation_percent,
    )


def _read_user_file(path: str, text_mode: str) -> Iterator[tuple[str, dict[str, str]]]:
    """Yield ``(key_suffix, example)`` for one user file."""
    if path.lower().endswith(_JSONL_SUFFIXES):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from e
                if not isinstance(rec, dict):
                    raise ValueError(f"{path}:{lineno}: expected a JSON object")
                response = rec.get("response", rec.get("completion"))
                if "prompt" in rec and response is not None:
                    ex = {"text": "", "prompt": str(rec["prompt"]), "response": str(response)}
                elif "text" in rec:
                    ex = {"text": str(rec["text"]), "prompt": "", "response": ""}
                else:
                    raise ValueError(
                        f"{path}:{lineno}: expected 'text' or 'prompt'+'response' keys"
                    )
                yield f"L{lineno}", ex
        return
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    if text_mode == "file":
        if text:
            yield "file", {"text": text, "prompt": "", "response": ""}
        return
    # A document boundary is a line break followed by one or more blank lines.
    docs = re.split(r"\r?\n(?:[ \t]*\r?\n)+", text)
    for i, doc in enumerate(d.strip("\r\n") for d in docs):
        if doc.strip():
            yield f"D{i}", {"text": doc, "prompt": "", "response": ""}


class UserFiles(_LocalBuilder, skip_registration=True):
    """User text/JSONL files: features ``text``, ``prompt``, ``response``, ``source``.

    Plain-text examples have ``text`` set and empty ``prompt``/``response``;
    pair examples have empty ``text``.  ``source`` is ``"<path>#<where>"``.
    Splits: ``train``, plus ``validation`` when ``validation_percent > 0``
    (a split that would be empty is left out).  Needs a config: ``UserFiles(config=
    user_files_config(paths), data_dir=..., file_format="array_record")``.
    """

    name = "user_files"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="User-provided text documents and prompt/response pairs.",
            features=tfds.features.FeaturesDict(
                {
                    "text": tfds.features.Text(),
                    "prompt": tfds.features.Text(),
                    "response": tfds.features.Text(),
                    "source": tfds.features.Text(),
                }
            ),
        )

    def _split_generators(self, dl_manager):
        cfg: UserFilesConfig = self.builder_config
        if cfg is None or not cfg.paths:
            raise ValueError("UserFiles needs config=user_files_config(paths)")
        # First pass over the keys only: TFDS refuses to write an empty split.
        present = set()
        for path in cfg.paths:
            for where, _ in _read_user_file(path, cfg.text_mode):
                present.add(split_of(f"{path}#{where}", cfg.validation_percent))
        if not present:
            raise ValueError(f"no examples found in {cfg.paths}")
        return {
            name: self._generate_examples(split=name)
            for name in ("train", "validation")
            if name in present
        }

    def _generate_examples(self, split: str):
        cfg: UserFilesConfig = self.builder_config
        for path in console.progress(cfg.paths, desc=f"{split} files", unit="file"):
            for where, ex in _read_user_file(path, cfg.text_mode):
                key = f"{path}#{where}"
                if split_of(key, cfg.validation_percent) != split:
                    continue
                yield key, {**ex, "source": key}


def build_user_files(
    paths: Sequence[str | os.PathLike],
    data_dir: str | os.PathLike,
    *,
    text_mode: str = "file",
    validation_percent: float = 0.0,
    name: str | None = None,
) -> UserFiles:
    """Build (or reuse) a :class:`UserFiles` dataset under ``data_dir``."""
    builder = UserFiles(
        config=user_files_config(
            paths, text_mode=text_mode, validation_percent=validation_percent, name=name
        ),
        data_dir=os.fspath(data_dir),
        file_format="array_record",
    )
    _prepare(builder)
    return builder
