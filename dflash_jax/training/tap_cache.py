"""The frozen target's taps kept across epochs (`config.data.cache_taps`).

Drafter training runs the frozen target over every packed row to get the hidden states the
drafter reads (its taps): on SmolLM2-135M with a 2-layer DFlash drafter that pass is about a
third of a step's work, and every epoch repeats it on the same documents. The target's
attention stays within a document (`segment_ids`) and RoPE depends only on the distance
between positions, so the taps of a document piece depend on the piece alone, wherever it is
packed. With `data.allow_split=False` the pieces are fixed (whole documents, and the
`seq_len`-sized pieces of longer ones), so after its first epoch every batch is assembled
from the taps kept here and the train step skips the target (the losses read `batch["taps"]`).

Kept in host memory as float32 (or `data.cache_taps_dtype`): documents x tokens x the taps'
width (SmolLM2, 3 taps of 576: 6.9 KB a token, 2.1 GB for the 1,024 regenerated conversations).
"""

from __future__ import annotations

import jax
import numpy as np

from dflash_jax.support.checks import ConfigError


def check_tap_cache(config) -> None:
    """The settings a tap cache needs, each a one-line ConfigError (preflight)."""
    d = config.data
    if not d.get("cache_taps", False):
        return
    why = None
    if config.mode != "drafter":
        why = f"mode={config.mode!r} trains the target itself (its pass is not frozen)"
    elif d.allow_split:
        why = (
            "data.allow_split=True packs a different piece of a document into each epoch's rows "
            "(set --config.data.allow_split=False: pieces then repeat, so their taps do)"
        )
    elif config.loss != "ce":  # (an EAGLE-3 drafter trains with "ce" only)
        why = f"loss={config.loss!r} also needs the target's logits, which are not kept"
    elif int(d.get("num_shards", 0)) > 1 or jax.process_count() > 1:
        why = "several processes or data shards (one process keeps them)"
    elif d.get("cache_taps_dtype", "float32") not in ("float32", "bfloat16"):
        why = f"cache_taps_dtype must be 'float32' or 'bfloat16', got {d.cache_taps_dtype!r}"
    if why:
        raise ConfigError(f"data.cache_taps: {why}")


class TapCache:
    """Taps of document pieces keyed by (document index, offset of the piece's first token),
    filled from batches of `PackedBatchIterator(include_doc_keys=True)`."""

    def __init__(self, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self._pieces: dict = {}
        self._out = None  # (width, dtype) of the taps stored: what lookup returns
        self.hits = self.misses = 0
        self.nbytes = 0

    @staticmethod
    def _segments(batch):
        """(row, start, end, document index, offset) of every piece of the batch."""
        seg, key, off = batch["segment_ids"], batch["doc_key"], batch["doc_offset"]
        for b in range(seg.shape[0]):
            row = seg[b]
            cut = np.flatnonzero(row[1:] != row[:-1]) + 1
            for s, e in zip(np.r_[0, cut], np.r_[cut, row.shape[0]]):
                if row[s] != 0:
                    yield b, int(s), int(e), int(key[b, s]), int(off[b, s])

    def lookup(self, batch):
        """The batch's taps [B, T, F] in the dtype they were stored from (zeros in the padding)
        if every piece is kept, else None."""
        if self._out is None:  # nothing kept yet
            self.misses += 1
            return None
        width, dtype = self._out
        out = np.zeros(batch["segment_ids"].shape + (width,), dtype)
        for b, s, e, k, o in self._segments(batch):
            piece = self._pieces.get((k, o))
            if piece is None or piece.shape[0] < e - s:
                self.misses += 1
                return None
            out[b, s:e] = piece[: e - s]
        self.hits += 1
        return out

    def store(self, batch, taps_BTF) -> None:
        """Keeps the pieces of `batch` from its computed taps (the longest seen per key: a
        causal pass's prefix is the shorter piece's taps)."""
        taps_BTF = np.asarray(taps_BTF)
        self._out = (taps_BTF.shape[-1], taps_BTF.dtype)
        for b, s, e, k, o in self._segments(batch):
            kept = self._pieces.get((k, o))
            if kept is None or kept.shape[0] < e - s:
                piece = np.array(taps_BTF[b, s:e], self.dtype)
                self.nbytes += piece.nbytes - (0 if kept is None else kept.nbytes)
                self._pieces[(k, o)] = piece

    def __len__(self) -> int:
        return len(self._pieces)


def make_taps_fn(tmod, tap_layers):
    """jit(frozen, input_ids, segment_ids) -> taps [B, T, F]: the target pass of the losses
    (`Transformer.taps`, the same arguments)."""
    tap_layers = tuple(tap_layers)

    def taps(frozen, ids, seg):
        return tmod.apply({"params": frozen}, ids, tap_layers, segment_ids_BT=seg, method="taps")

    return jax.jit(taps)
