"""Packing tokenized documents into fixed-length rows with loss masks.

Every document is tokenized with an eos token appended (so documents are
eos-separated once packed), then rows of ``seq_len`` tokens are filled in
order.  Each row carries

* ``input_ids``   int32 ``[L]`` -- tokens, ``pad_id`` in the padding;
* ``loss_mask``   int32 ``[L]`` -- 1 where the token is a training target
  (text tokens, response tokens, the appended eos), 0 on prompt tokens and
  padding;
* ``segment_ids`` int32 ``[L]`` -- 1, 2, ... for the successive document
  pieces in the row, 0 for padding, so attention can be kept within a
  document (``segment_ids[q] == segment_ids[k] != 0``).

With ``allow_split=True`` (default) a document that does not fit in the rest
of a row continues at the start of the next one (no padding except at the very
end of a finite stream).  With ``allow_split=False`` a document that does not
fit starts a fresh row instead; only documents longer than ``seq_len`` are
cut, into ``seq_len``-sized pieces.  Either way no token is dropped: the
non-padding tokens of all rows, concatenated, are exactly the documents
(each followed by eos) in reading order.

:class:`PackedBatchIterator` reads a random-access source (a list, or a TFDS
``as_data_source``) in a seeded per-epoch shuffled order, shards it across
hosts, packs and batches it, and exposes a resumable integer state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

__all__ = [
    "PackedBatchIterator",
    "make_batch_iterator",
    "pack_documents",
    "segment_positions",
    "tokenize_example",
]

Doc = tuple[np.ndarray, np.ndarray]  # (input_ids, loss_mask), both int32 [n]


class _Encoder(Protocol):
    eos_id: int

    def encode(self, text: str) -> list[int]: ...


def _as_str(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray) and value.shape == ():
        return _as_str(value.item())
    return str(value)


def tokenize_example(example: Mapping[str, Any], tokenizer: _Encoder) -> Doc:
    """Tokenize one example into ``(input_ids, loss_mask)`` with eos appended.

    An example with a non-empty ``prompt`` or ``response`` is a pair: the ids
    are ``encode(prompt) + encode(response) + [eos]`` with loss mask 0 on the
    prompt tokens and 1 on the response and eos.  Otherwise ``text`` is used
    with loss on every token.  Fields may be ``str`` or UTF-8 ``bytes`` (as a
    TFDS data source returns them).
    """
    eos = int(tokenizer.eos_id)
    prompt = _as_str(example.get("prompt"))
    response = _as_str(example.get("response"))
    if prompt or response:
        p = tokenizer.encode(prompt) if prompt else []
        r = tokenizer.encode(response) if response else []
        ids = np.asarray(p + r + [eos], dtype=np.int32)
        mask = np.ones(len(ids), dtype=np.int32)
        mask[: len(p)] = 0
        return ids, mask
    t = tokenizer.encode(_as_str(example.get("text")))
    ids = np.asarray(t + [eos], dtype=np.int32)
    return ids, np.ones(len(ids), dtype=np.int32)


def segment_positions(segment_ids: np.ndarray) -> np.ndarray:
    """Position of each token within its row segment (0 at each segment start).

    Works on ``[L]`` or ``[B, L]``; padding (segment 0) gets positions too
    (counting within the padding run) and should be masked by the consumer.
    """
    seg = np.asarray(segment_ids)
    idx = np.broadcast_to(np.arange(seg.shape[-1]), seg.shape)
    starts = np.ones(seg.shape, dtype=bool)
    starts[..., 1:] = seg[..., 1:] != seg[..., :-1]
    start_idx = np.where(starts, idx, 0)
    start_idx = np.maximum.accumulate(start_idx, axis=-1)
    return (idx - start_idx).astype(np.int32)


class _Cursor(Protocol):
    """Reading position in a stream of documents."""

    offset: int  # tokens of the current document already emitted

    def current(self) -> Doc | None:  # None once the stream is exhausted
        ...

    def advance(self) -> None:  # move to the next document, offset = 0
        ...


def _fill_row(cursor: _Cursor, seq_len: int, pad_id: int, allow_split: bool, keys: bool = False):
    """Fill one row from ``cursor``; ``None`` if the stream had no tokens left. With ``keys``
    (a cursor with ``key()``: its document's index in the source) the row also carries
    ``doc_key`` (that index at each position, -1 in the padding) and ``doc_offset`` (the
    position's index within its document)."""
    ids = np.full(seq_len, pad_id, dtype=np.int32)
    mask = np.zeros(seq_len, dtype=np.int32)
    seg = np.zeros(seq_len, dtype=np.int32)
    if keys:
        doc_key = np.full(seq_len, -1, dtype=np.int32)
        doc_off = np.zeros(seq_len, dtype=np.int32)
    pos = 0
    nseg = 0
    while pos < seq_len:
        doc = cursor.current()
        if doc is None:
            break
        doc_ids, doc_mask = doc
        n = len(doc_ids)
        off = cursor.offset
        remaining = n - off
        if remaining <= 0:
            cursor.advance()
            continue
        space = seq_len - pos
        if not allow_split and off == 0 and remaining > space and pos > 0:
            break  # start this document on a fresh row
        take = min(remaining, space)
        ids[pos : pos + take] = doc_ids[off : off + take]
        mask[pos : pos + take] = doc_mask[off : off + take]
        nseg += 1
        seg[pos : pos + take] = nseg
        if keys:
            doc_key[pos : pos + take] = cursor.key()
            doc_off[pos : pos + take] = np.arange(off, off + take, dtype=np.int32)
        pos += take
        cursor.offset = off + take
        if cursor.offset >= n:
            cursor.advance()
    if pos == 0:
        return None
    row = {"input_ids": ids, "loss_mask": mask, "segment_ids": seg}
    if keys:
        row.update(doc_key=doc_key, doc_offset=doc_off)
    return row


class _IterCursor:
    def __init__(self, docs: Iterable[Doc]):
        self._it = iter(docs)
        self._cur: Doc | None = None
        self._done = False
        self.offset = 0

    def current(self) -> Doc | None:
        if self._cur is None and not self._done:
            try:
                ids, mask = next(self._it)
            except StopIteration:
                self._done = True
                return None
            ids = np.asarray(ids, dtype=np.int32)
            mask = np.asarray(mask, dtype=np.int32)
            if ids.shape != mask.shape or ids.ndim != 1:
                raise ValueError("each document needs 1-D input_ids and loss_mask of equal length")
            self._cur = (ids, mask)
        return self._cur

    def advance(self) -> None:
        self._cur = None
        self.offset = 0


def pack_documents(
    docs: Iterable[Doc],
    seq_len: int,
    *,
    pad_id: int = 0,
    allow_split: bool = True,
) -> Iterator[dict[str, np.ndarray]]:
    """Pack ``(input_ids, loss_mask)`` documents (eos already appended) into rows.

    Yields dicts of int32 ``[seq_len]`` arrays ``input_ids``, ``loss_mask``,
    ``segment_ids``; the last row is padded.  See the module docstring for
    ``allow_split``.
    """
    if seq_len <= 0:
        raise ValueError("seq_len must be positive")
    cursor = _IterCursor(docs)
    while (row := _fill_row(cursor, seq_len, pad_id, allow_split)) is not None:
        yield row


def rows_for(lengths, seq_len: int, allow_split: bool = True) -> int:
    """Rows that documents of these lengths (eos included), read in this order, fill: the
    packing rule of `_fill_row` on lengths alone. With allow_split it is the tokens over
    seq_len, rounded up; without, a document that does not fit the rest of a row starts the
    next one (the padding counts)."""
    if allow_split:
        return -(-int(sum(lengths)) // seq_len)
    rows, used = 0, seq_len  # `used` of the current row; none open yet
    for n in lengths:
        n = int(n)
        if n <= 0:
            continue
        if used + n <= seq_len:
            used += n
            continue
        # a fresh row (a longer document fills whole rows, its tail opens the last one)
        k = -(-n // seq_len)
        rows, used = rows + k, n - (k - 1) * seq_len
    return rows


class PackedBatchIterator:
    """Deterministic, resumable, host-sharded iterator of packed batches.

    Each epoch visits the documents of ``source`` in the order of a
    permutation drawn from ``np.random.default_rng([seed, epoch])`` (identity
    if ``shuffle=False``); host ``host_id`` of ``num_hosts`` takes every
    ``num_hosts``-th document of that order, starting at ``host_id``, so the
    hosts' documents are disjoint and together cover the source each epoch.
    Epochs run back to back (a row may span an epoch boundary); with
    ``num_epochs=None`` the stream is infinite.

    ``next(it)`` returns ``{"input_ids", "loss_mask", "segment_ids"}`` (plus
    ``"positions"`` if ``include_positions``, and ``"doc_key"`` / ``"doc_offset"``, each
    position's source index and offset within it, if ``include_doc_keys``), int32
    ``[batch_size, seq_len]``.
    ``get_state()`` is a small dict of ints (``epoch``, ``index``,
    ``offset``: the next unread token) that can go into a checkpoint;
    ``set_state`` / the ``state=`` argument continue exactly from there.
    The state is per host: each host saves and restores its own.

    ``tokenize_fn(example) -> (input_ids, loss_mask)`` must be deterministic
    and append the eos itself (see :func:`tokenize_example`).
    """

    def __init__(
        self,
        source: Sequence[Any],
        tokenize_fn: Callable[[Any], Doc],
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
        host_id: int = 0,
        num_hosts: int = 1,
        pad_id: int = 0,
        allow_split: bool = True,
        drop_remainder: bool = True,
        include_positions: bool = False,
        include_doc_keys: bool = False,
        state: Mapping[str, int] | None = None,
    ):
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError("seq_len and batch_size must be positive")
        if num_hosts <= 0 or not 0 <= host_id < num_hosts:
            raise ValueError(f"need 0 <= host_id < num_hosts, got {host_id}, {num_hosts}")
        if num_epochs is not None and num_epochs < 0:
            raise ValueError("num_epochs must be >= 0 or None")
        self.source = source
        self.tokenize_fn = tokenize_fn
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.num_epochs = num_epochs
        self.host_id = int(host_id)
        self.num_hosts = int(num_hosts)
        self.pad_id = int(pad_id)
        self.allow_split = bool(allow_split)
        self.drop_remainder = bool(drop_remainder)
        self.include_positions = bool(include_positions)
        self.include_doc_keys = bool(include_doc_keys)
        self._num_source = len(source)
        self.docs_per_epoch = len(range(self.host_id, self._num_source, self.num_hosts))
        if self.docs_per_epoch == 0:
            raise ValueError(
                f"host {host_id} of {num_hosts} gets no documents from a source of "
                f"{self._num_source}"
            )
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._cur: Doc | None = None
        self.epoch = 0
        self.index = 0
        self.offset = 0
        if state is not None:
            self.set_state(state)

    # -- document order -----------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        """Source indices this host reads in ``epoch``, in reading order."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        if self.shuffle:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self._num_source)
        else:
            perm = np.arange(self._num_source)
        order = perm[self.host_id :: self.num_hosts]
        self._order_cache = (epoch, order)
        return order

    def _finished(self) -> bool:
        return self.num_epochs is not None and self.epoch >= self.num_epochs

    # -- cursor protocol used by _fill_row ---------------------------------
    def current(self) -> Doc | None:
        if self._finished():
            return None
        if self._cur is None:
            src_idx = int(self.epoch_order(self.epoch)[self.index])
            ids, mask = self.tokenize_fn(self.source[src_idx])
            ids = np.asarray(ids, dtype=np.int32)
            mask = np.asarray(mask, dtype=np.int32)
            if ids.shape != mask.shape or ids.ndim != 1:
                raise ValueError(f"tokenize_fn returned mismatched arrays for document {src_idx}")
            self._cur = (ids, mask)
        return self._cur

    def key(self) -> int:
        """The source index of the current document."""
        return int(self.epoch_order(self.epoch)[self.index])

    def advance(self) -> None:
        self._cur = None
        self.offset = 0
        self.index += 1
        if self.index >= self.docs_per_epoch:
            self.index = 0
            self.epoch += 1

    # -- state --------------------------------------------------------------
    def get_state(self) -> dict[str, int]:
        """Position of the next unread token: ``{"epoch", "index", "offset"}``."""
        return {"epoch": int(self.epoch), "index": int(self.index), "offset": int(self.offset)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a state returned by :meth:`get_state` (same settings)."""
        epoch, index, offset = (int(np.asarray(state[k])) for k in ("epoch", "index", "offset"))
        if epoch < 0 or not 0 <= index < self.docs_per_epoch or offset < 0:
            raise ValueError(f"invalid state {dict(state)} for {self.docs_per_epoch} docs/epoch")
        self.epoch, self.index, self.offset = epoch, index, offset
        self._cur = None
        if offset and not self._finished():
            doc = self.current()
            if doc is not None and offset >= len(doc[0]):
                raise ValueError(f"state offset {offset} is past the end of its document")

    # -- iteration ----------------------------------------------------------
    def next_row(self) -> dict[str, np.ndarray] | None:
        """One packed row, or ``None`` when a finite stream is exhausted."""
        return _fill_row(self, self.seq_len, self.pad_id, self.allow_split, self.include_doc_keys)

    def __iter__(self) -> PackedBatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rows = []
        while len(rows) < self.batch_size:
            row = self.next_row()
            if row is None:
                break
            rows.append(row)
        if not rows or (len(rows) < self.batch_size and self.drop_remainder):
            raise StopIteration
        while len(rows) < self.batch_size:  # pad the final partial batch
            pad = {
                "input_ids": np.full(self.seq_len, self.pad_id, dtype=np.int32),
                "loss_mask": np.zeros(self.seq_len, dtype=np.int32),
                "segment_ids": np.zeros(self.seq_len, dtype=np.int32),
            }
            if self.include_doc_keys:
                pad.update(
                    doc_key=np.full(self.seq_len, -1, dtype=np.int32),
                    doc_offset=np.zeros(self.seq_len, dtype=np.int32),
                )
            rows.append(pad)
        batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        if self.include_positions:
            batch["positions"] = segment_positions(batch["segment_ids"])
        return batch


def make_batch_iterator(
    source: Sequence[Any],
    tokenizer: _Encoder,
    *,
    seq_len: int,
    batch_size: int,
    pad_id: int | None = None,
    **kwargs: Any,
) -> PackedBatchIterator:
    """:class:`PackedBatchIterator` over raw examples tokenized by ``tokenizer``.

    Examples are dicts with ``text`` or ``prompt``/``response`` (see
    :func:`tokenize_example`); ``pad_id`` defaults to ``tokenizer.pad_id``.
    Other keyword arguments go to :class:`PackedBatchIterator`.
    """
    if pad_id is None:
        pad_id = int(getattr(tokenizer, "pad_id", tokenizer.eos_id))

    def tokenize_fn(example: Any) -> Doc:
        return tokenize_example(example, tokenizer)

    return PackedBatchIterator(
        source, tokenize_fn, seq_len=seq_len, batch_size=batch_size, pad_id=pad_id, **kwargs
    )
