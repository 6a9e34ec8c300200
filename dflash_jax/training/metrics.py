"""Metrics sinks: a JSONL file, TensorBoard event files (written without TensorFlow) and
human progress lines.

TensorBoard's format is a TFRecord stream of `Event` protobufs. We only write scalars, so the
three messages involved are encoded by hand (field numbers from tensorflow/core/util/event.proto
and summary.proto):
  Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
  Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
A record is: uint64 length, uint32 masked_crc32c(length), data, uint32 masked_crc32c(data).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from typing import Dict, Iterator, Optional, Tuple


def _crc32c_table():
    poly = 0x82F63B78
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field_bytes(num: int, payload: bytes) -> bytes:
    return _varint((num << 3) | 2) + _varint(len(payload)) + payload


def encode_event(step: int, wall_time: float, scalars: Optional[Dict[str, float]] = None,
                 file_version: Optional[str] = None) -> bytes:
    msg = _varint((1 << 3) | 1) + struct.pack("<d", wall_time)
    msg += _varint((2 << 3) | 0) + _varint(int(step))
    if file_version is not None:
        msg += _field_bytes(3, file_version.encode())
    if scalars:
        summary = b"".join(
            _field_bytes(1, _field_bytes(1, tag.encode()) + _varint((2 << 3) | 5) +
                         struct.pack("<f", float(value)))
            for tag, value in scalars.items())
        msg += _field_bytes(5, summary)
    return msg


def tfrecord(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return (header + struct.pack("<I", masked_crc32c(header)) + data +
            struct.pack("<I", masked_crc32c(data)))


class EventFileWriter:
    """Appends scalar summaries to `logdir/events.out.tfevents.<time>.<host>`."""

    def __init__(self, logdir: str):
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = os.path.join(logdir, name)
        self._f = open(self.path, "ab")
        self._f.write(tfrecord(encode_event(0, time.time(), file_version="brain.Event:2")))
        self._f.flush()

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        self._f.write(tfrecord(encode_event(step, time.time(), values)))
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_event_scalars(path: str) -> Iterator[Tuple[int, str, float]]:
    """Reads back (step, tag, value) from an event file, checking every CRC (for tests)."""
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i < len(data):
        header = data[i:i + 8]
        (n,) = struct.unpack("<Q", header)
        if struct.unpack("<I", data[i + 8:i + 12])[0] != masked_crc32c(header):
            raise ValueError("bad length crc")
        body = data[i + 12:i + 12 + n]
        if struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] != masked_crc32c(body):
            raise ValueError("bad data crc")
        i += 16 + n
        yield from _decode_event(body)


def _read_varint(buf, i):
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, i


def _fields(buf):
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, i = _read_varint(buf, i)
        elif wire == 1:
            val, i = buf[i:i + 8], i + 8
        elif wire == 5:
            val, i = buf[i:i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            val, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"wire type {wire}")
        yield num, val


def _decode_event(buf):
    step = 0
    summaries = []
    for num, val in _fields(buf):
        if num == 2:
            step = val
        elif num == 5:
            summaries.append(val)
    for s in summaries:
        for num, value_msg in _fields(s):
            tag, v = None, None
            for n2, x in _fields(value_msg):
                if n2 == 1:
                    tag = x.decode()
                elif n2 == 2:
                    v = struct.unpack("<f", x)[0]
            yield step, tag, v


def _row_step(line: str) -> float:
    """The step of a metrics.jsonl row (-inf for a blank or unreadable row: kept)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("-inf")


class MetricsLogger:
    """Writes every record to `workdir/metrics.jsonl` and scalar fields to TensorBoard
    (`workdir/tb/<split>`)."""

    def __init__(self, workdir: str, resume_step: Optional[int] = None, enabled: bool = True):
        """resume_step: the step training continues from; JSONL rows of later steps (written
        by a run that stopped after its last checkpoint, and about to be redone) are dropped
        so every step appears once. enabled: False on all processes but the first of a
        process group (they write nothing)."""
        self.workdir = workdir
        self.enabled = enabled  # False on all processes but the first of a process group
        self._tb: Dict[str, EventFileWriter] = {}
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(workdir, "metrics.jsonl")
        if resume_step is not None and os.path.exists(path):
            with open(path) as f:
                lines = f.readlines()
            # (a row without its newline is a write cut short by a kill: dropped too)
            keep = [l for l in lines if l.endswith("\n") and _row_step(l) <= resume_step]
            if len(keep) != len(lines):
                with open(path + ".tmp", "w") as f:
                    f.writelines(keep)
                os.replace(path + ".tmp", path)
        self._jsonl = open(path, "a")

    def write(self, split: str, step: int, values: Dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in values.items()}
        self._jsonl.write(json.dumps({"split": split, "step": int(step), **clean}) + "\n")
        self._jsonl.flush()
        if split not in self._tb:
            self._tb[split] = EventFileWriter(os.path.join(self.workdir, "tb", split))
        self._tb[split].scalars(step, clean)

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        for w in self._tb.values():
            w.close()


def format_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
