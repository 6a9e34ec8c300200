"""Safetensors files and Hugging Face model directories, read and written with `safetensors`.

What this module adds to the package: `model.safetensors.index.json` shards (confined to the
model directory), reading one tensor at a time with an optional cast (so loading a bfloat16
checkpoint never holds a second full copy of the model), atomic writes, and errors that name the
file and the tensor (`CheckpointError`). bfloat16 arrays are `ml_dtypes.bfloat16`.
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Dict, Iterable, Mapping, Optional, Tuple

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the tensor."""


def _diagnose(path: str, err: Exception) -> str:
    """One line for a file `safetensors` refused. The package's message names no tensor, so
    for an unknown dtype (a new or misspelled code) the header is read to name it."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, entry in header.items():
            code = entry.get("dtype") if isinstance(entry, dict) else None
            if name != "__metadata__" and code is not None and code not in _KNOWN_CODES:
                return f"{path}: tensor {name!r} has unknown dtype {code!r}"
    except (OSError, ValueError, struct.error, AttributeError):
        pass
    return f"{path}: not a readable safetensors file ({err})"


# Dtype codes of the format (safetensors' Dtype enum); numpy reads the float/int ones.
_KNOWN_CODES = {
    "BOOL",
    "U8",
    "I8",
    "U16",
    "I16",
    "U32",
    "I32",
    "U64",
    "I64",
    "F16",
    "BF16",
    "F32",
    "F64",
    "C64",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
}


# Codes that safetensors' numpy reader maps to dtypes numpy does not have: read as ml_dtypes.
_RAW_CODES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


class SafetensorsFile:
    """Random access to the tensors of one `.safetensors` file (`safetensors.safe_open`)."""

    def __init__(self, path: str):
        self.path = str(path)
        if not os.path.exists(self.path):
            raise CheckpointError(f"{self.path}: cannot open (no such file)")
        try:
            self._f = safetensors.safe_open(self.path, framework="numpy")
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e})") from e
        except Exception as e:  # noqa: BLE001 - SafetensorError: a corrupt header or size
            raise CheckpointError(_diagnose(self.path, e)) from e
        self.metadata = self._f.metadata() or {}
        self._keys = list(self._f.keys())
        self._header = None  # (data start, header dict): read on the first raw tensor

    def keys(self):
        return list(self._keys)

    def __contains__(self, name):
        return name in self._keys

    def info(self, name) -> Tuple[str, tuple]:
        """(dtype code such as 'BF16', shape) without reading the tensor."""
        s = self._f.get_slice(name)
        return s.get_dtype(), tuple(s.get_shape())

    def get(self, name: str, dtype=None) -> np.ndarray:
        """The tensor as a numpy array, cast to `dtype` when given."""
        if name not in self._keys:
            raise CheckpointError(f"{self.path}: tensor {name!r} not found")
        try:
            code = self._f.get_slice(name).get_dtype()
            if code in _RAW_CODES:  # dtypes numpy lacks: read from the file's bytes
                arr = self._get_raw(name, _RAW_CODES[code])
            else:
                arr = self._f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a dtype numpy cannot hold (F4, F8_E8M0, ...)
            raise CheckpointError(f"{self.path}: tensor {name!r} cannot be read ({e})") from e
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            arr = arr.astype(dtype)
        return arr

    def _get_raw(self, name: str, dtype) -> np.ndarray:
        """Tensor `name` as `dtype` (an ml_dtypes type) straight from the file (memory-mapped):
        the header's data_offsets, after the 8-byte header length and the header."""
        if self._header is None:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self._header = (8 + n, json.loads(f.read(n)))
        base, header = self._header
        entry = header[name]
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has a size that is not its shape's"
            )
        raw = np.memmap(
            self.path, dtype=np.uint8, mode="r", offset=base + begin, shape=(end - begin,)
        )
        return np.asarray(raw).view(dtype).reshape(shape)

    def close(self):
        self._f.__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_safetensors(
    path: str, tensors: Mapping[str, np.ndarray], metadata: Optional[Dict[str, str]] = None
) -> None:
    """Writes tensors (numpy arrays; bfloat16 via ml_dtypes) to one safetensors file.

    Written to a temporary name and renamed, so an interrupted save never leaves a torn file.
    """
    arrays = {name: np.ascontiguousarray(np.asarray(t)) for name, t in tensors.items()}
    tmp = f"{path}.tmp"
    try:
        safetensors.numpy.save_file(arrays, tmp, metadata=dict(metadata or {"format": "pt"}))
    except Exception as e:  # noqa: BLE001 - an unsupported dtype (object, str, ...)
        if os.path.exists(tmp):
            os.remove(tmp)
        bad = [f"{n!r} ({a.dtype})" for n, a in arrays.items() if a.dtype.kind in "OUSMm"]
        raise CheckpointError(f"{path}: cannot store tensors {', '.join(bad)} ({e})") from e
    # The safetensors library creates the file owner-only (0600); a checkpoint is shared like
    # any file the user writes: the permissions their umask gives.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


class SafetensorsDir:
    """The tensors of a Hugging Face model directory: one file or shards with an index."""

    def __init__(self, directory: str):
        self.directory = str(directory)
        index = os.path.join(self.directory, "model.safetensors.index.json")
        single = os.path.join(self.directory, "model.safetensors")
        self._files: Dict[str, SafetensorsFile] = {}
        self._where: Dict[str, str] = {}
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: 'weight_map' is not an object")
            root = os.path.realpath(self.directory)
            for name, fname in weight_map.items():
                # Model directories come from strangers: a shard must be a plain file name
                # inside the directory, never an absolute path or a '..' escape.
                if (
                    not isinstance(fname, str)
                    or not fname
                    or os.path.isabs(fname)
                    or os.path.realpath(os.path.join(root, fname))
                    != os.path.join(root, os.path.normpath(fname))
                    or os.path.normpath(fname).split(os.sep)[0] == os.pardir
                ):
                    raise CheckpointError(
                        f"{index}: tensor {name!r} names the file {fname!r} "
                        "outside the model directory; refusing it"
                    )
                self._where[name] = os.path.join(self.directory, fname)
        elif os.path.exists(single):
            f = self._open(single)
            for name in f.keys():
                self._where[name] = single
        else:
            raise CheckpointError(
                f"{self.directory}: no model.safetensors or model.safetensors.index.json"
            )

    def _open(self, path) -> SafetensorsFile:
        if path not in self._files:
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: shard named in the index does not exist")
            self._files[path] = SafetensorsFile(path)
        return self._files[path]

    def names(self) -> Iterable[str]:
        return self._where.keys()

    def __contains__(self, name):
        return name in self._where

    def file_of(self, name) -> str:
        return self._where.get(name, self.directory)

    def _file_with(self, name) -> "SafetensorsFile":
        if name not in self._where:
            raise CheckpointError(f"{self.directory}: missing tensor {name!r}")
        f = self._open(self._where[name])
        if name not in f:
            raise CheckpointError(f"{f.path}: missing tensor {name!r} (listed in the index)")
        return f

    def info(self, name):
        return self._file_with(name).info(name)

    def get(self, name, dtype=None) -> np.ndarray:
        return self._file_with(name).get(name, dtype)

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()


def save_sharded(
    directory: str, tensors: Mapping[str, np.ndarray], max_shard_bytes: int = 5 * 2**30
) -> None:
    """Writes `model.safetensors`, or shards plus `model.safetensors.index.json` when large.
    Weight files of an earlier checkpoint in `directory` that the new one does not use (the
    other layout's, or shards of another count) are removed once the new files are written, so
    a loader never reads stale weights beside the new ones."""
    os.makedirs(directory, exist_ok=True)
    total = sum(np.asarray(t).nbytes for t in tensors.values())
    if total <= max_shard_bytes:
        write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
        _remove_stale_weights(directory, keep={"model.safetensors"})
        return
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = np.asarray(tensors[name]).nbytes
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    from dflash_jax.support import console

    weight_map = {}
    for i, shard in enumerate(console.progress(shards, desc=f"write {directory}", unit="shard")):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(directory, fname), shard)
        weight_map.update({name: fname for name in shard})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": int(total)}, "weight_map": weight_map}, f, indent=2)
    _remove_stale_weights(
        directory, keep=set(weight_map.values()) | {"model.safetensors.index.json"}
    )


_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def _remove_stale_weights(directory: str, keep) -> None:
    """Deletes the safetensors weight files and index in `directory` not in `keep`."""
    for name in os.listdir(directory):
        if name not in keep and _WEIGHT_FILE.fullmatch(name):
            os.remove(os.path.join(directory, name))
