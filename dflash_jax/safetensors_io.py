"""A small, dependency-free reader and writer of the safetensors format.

Reading is memory-mapped: a tensor is viewed in place and cast straight to the requested dtype,
so loading a bfloat16 checkpoint never holds a second full float32 copy of the model. Every error
names the file and the tensor.

Format: 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Dict, Iterable, Mapping, Optional, Tuple

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the tensor."""


class SafetensorsFile:
    """Random access to the tensors of one `.safetensors` file (memory-mapped)."""

    def __init__(self, path: str):
        self.path = str(path)
        try:
            self._fh = open(self.path, "rb")
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from e
        size = os.fstat(self._fh.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"{self.path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", self._fh.read(8))
        if n > size - 8:
            raise CheckpointError(f"{self.path}: corrupt header (length {n} > file size)")
        try:
            header = json.loads(self._fh.read(n))
        except ValueError as e:
            raise CheckpointError(f"{self.path}: corrupt JSON header ({e})") from e
        self.metadata = header.pop("__metadata__", None) or {}
        self._header = header
        self._data_start = 8 + n
        self._size = size
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def keys(self):
        return list(self._header)

    def __contains__(self, name):
        return name in self._header

    def info(self, name) -> Tuple[str, tuple]:
        entry = self._header[name]
        return entry["dtype"], tuple(entry["shape"])

    def get(self, name: str, dtype=None) -> np.ndarray:
        """The tensor as a numpy array; a zero-copy view unless `dtype` asks for a cast."""
        if name not in self._header:
            raise CheckpointError(f"{self.path}: tensor {name!r} not found")
        entry = self._header[name]
        code = entry.get("dtype")
        if code not in DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has unknown dtype {code!r}; "
                f"supported: {sorted(DTYPES)}")
        np_dtype = DTYPES[code]
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        expected = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
        if end - begin != expected or self._data_start + end > self._size:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} is truncated or mis-sized "
                f"({end - begin} bytes for shape {shape} {code})")
        arr = np.frombuffer(self._mm, dtype=np_dtype, count=expected // np_dtype.itemsize,
                            offset=self._data_start + begin).reshape(shape)
        if dtype is not None and np.dtype(dtype) != np_dtype:
            arr = arr.astype(dtype)
        return arr

    def close(self):
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # arrays still view the mapping; it is unmapped when the last one dies
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray],
                      metadata: Optional[Dict[str, str]] = None) -> None:
    """Writes tensors (numpy arrays; bfloat16 via ml_dtypes) to one safetensors file.

    Written to a temporary name and renamed, so an interrupted save never leaves a torn file.
    """
    header = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(np.asarray(tensors[name]))
        if arr.dtype not in _NAMES:
            raise CheckpointError(f"{path}: cannot store tensor {name!r} of dtype {arr.dtype}")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
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
                if (not isinstance(fname, str) or not fname or os.path.isabs(fname)
                        or os.path.realpath(os.path.join(root, fname)) !=
                        os.path.join(root, os.path.normpath(fname))
                        or os.path.normpath(fname).split(os.sep)[0] == os.pardir):
                    raise CheckpointError(f"{index}: tensor {name!r} names the file {fname!r} "
                                          "outside the model directory; refusing it")
                self._where[name] = os.path.join(self.directory, fname)
        elif os.path.exists(single):
            f = self._open(single)
            for name in f.keys():
                self._where[name] = single
        else:
            raise CheckpointError(
                f"{self.directory}: no model.safetensors or model.safetensors.index.json")

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

    def info(self, name):
        return self._open(self._where[name]).info(name)

    def get(self, name, dtype=None) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"{self.directory}: missing tensor {name!r}")
        f = self._open(self._where[name])
        if name not in f:
            raise CheckpointError(f"{f.path}: missing tensor {name!r} (listed in the index)")
        return f.get(name, dtype)

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()


def save_sharded(directory: str, tensors: Mapping[str, np.ndarray],
                 max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes `model.safetensors`, or shards plus `model.safetensors.index.json` when large."""
    os.makedirs(directory, exist_ok=True)
    total = sum(np.asarray(t).nbytes for t in tensors.values())
    if total <= max_shard_bytes:
        write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
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
    from dflash_jax import console

    weight_map = {}
    for i, shard in enumerate(console.progress(shards, desc=f"write {directory}", unit="shard")):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(directory, fname), shard)
        weight_map.update({name: fname for name in shard})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": int(total)}, "weight_map": weight_map}, f, indent=2)
