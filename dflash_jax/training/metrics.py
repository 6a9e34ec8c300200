"""Metrics sinks: a JSONL file and TensorBoard event files (tensorboardX, no TensorFlow).

`workdir/metrics.jsonl` holds one row per record (`{"split", "step", ...}`); TensorBoard gets
the same scalars under `workdir/tb/<split>`, one event file per run and split.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import sys
from typing import Dict, Iterator, Optional, Tuple

_WRITER_IDS = itertools.count()  # two writers of one process in one second get two files


def _summary_writer_class():
    """`tensorboardX.SummaryWriter`. tensorboardX imports torch when torch is installed, only
    to accept torch tensors (we pass floats); that import takes seconds at a run's first log
    line. Unless torch is already loaded, it is hidden for that one import (tensorboardX
    catches the ImportError) and visible again right after."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def read_event_scalars(path: str) -> Iterator[Tuple[int, str, float]]:
    """Reads back (step, tag, value) from an event file, checking every record's CRC (tests).

    The file is a TFRecord stream of `Event` protobufs: uint64 length, uint32 masked crc32c
    of the length, the data, uint32 masked crc32c of the data."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i < len(data):
        header = data[i : i + 8]
        (n,) = struct.unpack("<Q", header)
        if struct.unpack("<I", data[i + 8 : i + 12])[0] != masked_crc32c(header):
            raise ValueError(f"{path}: bad length crc at byte {i}")
        body = data[i + 12 : i + 12 + n]
        if struct.unpack("<I", data[i + 12 + n : i + 16 + n])[0] != masked_crc32c(body):
            raise ValueError(f"{path}: bad data crc at byte {i}")
        i += 16 + n
        event = event_pb2.Event.FromString(body)
        for value in event.summary.value:
            yield int(event.step), value.tag, float(value.simple_value)


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
        self._tb: Dict[str, object] = {}  # split -> tensorboardX.SummaryWriter
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
            self._tb[split] = _summary_writer_class()(
                os.path.join(self.workdir, "tb", split),
                filename_suffix=f".{os.getpid()}.{next(_WRITER_IDS)}",
            )
        writer = self._tb[split]
        for tag, value in clean.items():
            writer.add_scalar(tag, value, global_step=int(step))
        writer.flush()  # a record per log line: TensorBoard sees it now, a kill loses none

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
