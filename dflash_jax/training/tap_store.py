"""The frozen target's taps and next-token distribution, stored on disk beside the data.

A drafter's training step runs the frozen target over every packed row for the hidden states
the drafter reads (its taps). On SmolLM2-135M that pass is ~40% of a step, and it is the same
on every epoch and every variant trained on the same data. The store computes it once per
document piece, teacher-forced over the data's own tokens (the regenerated answers are the
target's own greedy tokens, so this is the pass regeneration made), and keeps:

- the tapped layers' outputs, bfloat16 (or float32), [tokens, n_taps * H];
- the target's top-k next-token distribution at every position (ids int32 and log-probs
  float32 of the full softmax, [tokens, k]): the soft labels of a KL loss.

Training on a store never runs the target (`config.data.tap_store`; the trainer reads the
pieces of each batch from disk, `StoreSource`).

Layout (format version 1), a directory:

    manifest.json     {"format": "dflash-jax-tap-store", "version": 1, "target": fingerprint,
                       "target_name", "tap_layers", "hidden_size", "seq_len", "top_k", "dtype",
                       "compression": "zlib-1, bytes split by significance", "records": N}
    index.npz         per record: token count, crc32 of its token ids, shard, byte offset
                      and byte length of its blob (records written so far: resumable)
    shard_00000.bin   the records' blobs, appended

A record is cut into the pieces the trainer's packer makes with `data.allow_split=False`
(offsets 0, seq_len, 2 seq_len, ...; `pieces`), and each piece is computed as a sequence of its
own (positions from 0): the taps of a piece depend on the piece alone, wherever the packer
puts it (attention within the document, RoPE relative). A blob is the record's pieces
concatenated: taps (the 16-bit words split into a high-byte plane and a low-byte plane before
zlib: the sign and exponent bytes compress, the mantissa bytes hardly), then top-k ids and
log-probs, each zlib level 1.

A store is bound to its target (a fingerprint of the config and every parameter), tap layers,
piece length and format version, and each record to its token ids (crc32): opening one with
anything else is one line (`StoreError`), never a silent misreading.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from typing import Callable, Optional, Sequence

import numpy as np

from dflash_jax.support.checks import ConfigError

FORMAT = "dflash-jax-tap-store"
VERSION = 1
SHARD_BYTES = 1 << 30  # a new shard file past this size


class StoreError(ConfigError):
    """A tap store that does not fit what it is opened for (one line)."""


def pieces(n_tokens: int, seq_len: int):
    """[(offset, length)] of a document of n_tokens as the packer cuts it without splits."""
    return [(o, min(seq_len, n_tokens - o)) for o in range(0, n_tokens, seq_len)]


def ids_crc(ids) -> int:
    return zlib.crc32(np.ascontiguousarray(np.asarray(ids, np.int32)).tobytes())


def target_fingerprint(config, params) -> str:
    """sha256 (16 hex digits) of the target's config and every parameter's bytes (as stored),
    whatever the layer stack's layout (the looped names and config without `scan_layers`)."""
    import dataclasses

    import jax

    from dflash_jax.models import layer_stack

    h = hashlib.sha256()
    cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    cfg.pop("scan_layers", None)
    params = layer_stack.unstack_layers(params)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in leaves:
        arr = np.asarray(leaf)
        h.update(jax.tree_util.keystr(path).encode())
        h.update(str(arr.dtype).encode() + str(arr.shape).encode())
        h.update(np.ascontiguousarray(arr).view(np.uint8).tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- blob coding


def _pack16(words: np.ndarray) -> bytes:
    """16-bit words -> zlib(high bytes, then low bytes)."""
    w = np.ascontiguousarray(words).view(np.uint16).ravel()
    planes = np.concatenate([(w >> 8).astype(np.uint8), (w & 0xFF).astype(np.uint8)])
    return zlib.compress(planes.tobytes(), 1)


def _unpack16(data: bytes, n: int) -> np.ndarray:
    planes = np.frombuffer(zlib.decompress(data), np.uint8)
    return (planes[:n].astype(np.uint16) << 8) | planes[n:]


def _encode(taps: np.ndarray, top_ids: np.ndarray, top_logp: np.ndarray, dtype: str) -> bytes:
    if dtype == "bfloat16":
        import ml_dtypes

        t = _pack16(np.asarray(taps, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
    else:
        t = zlib.compress(np.ascontiguousarray(taps, np.float32).tobytes(), 1)
    i = zlib.compress(np.ascontiguousarray(top_ids, np.int32).tobytes(), 1)
    p = zlib.compress(np.ascontiguousarray(top_logp, np.float32).tobytes(), 1)
    head = np.array([len(t), len(i), len(p)], np.int64).tobytes()
    return head + t + i + p


def _decode(blob: bytes, n: int, width: int, k: int, dtype: str):
    lt, li, lp = np.frombuffer(blob[:24], np.int64)
    o = 24
    if dtype == "bfloat16":
        import ml_dtypes

        words = _unpack16(blob[o : o + lt], n * width)
        taps = words.view(ml_dtypes.bfloat16).astype(np.float32).reshape(n, width)
    else:
        taps = np.frombuffer(zlib.decompress(blob[o : o + lt]), np.float32).reshape(n, width)
    o += lt
    ids = np.frombuffer(zlib.decompress(blob[o : o + li]), np.int32).reshape(n, k)
    o += li
    logp = np.frombuffer(zlib.decompress(blob[o : o + lp]), np.float32).reshape(n, k)
    return taps, ids, logp


# --------------------------------------------------------------------------- the store


class TapStore:
    """A store directory, opened for reading (and appending, `append`). `expect` (a dict of
    manifest keys) is checked first: any difference is one `StoreError` line."""

    def __init__(self, path: str, expect: Optional[dict] = None):
        self.path = str(path)
        mpath = os.path.join(self.path, "manifest.json")
        if not os.path.isfile(mpath):
            raise StoreError(f"{self.path}: not a tap store (no manifest.json)")
        try:
            with open(mpath) as f:
                self.manifest = json.load(f)
        except (OSError, ValueError) as e:
            raise StoreError(f"{mpath}: unreadable manifest ({e})") from None
        m = self.manifest
        if m.get("format") != FORMAT:
            raise StoreError(f"{mpath}: not a {FORMAT} manifest (format {m.get('format')!r})")
        if m.get("version") != VERSION:
            raise StoreError(
                f"{self.path}: tap store format version {m.get('version')!r}, this code reads "
                f"version {VERSION}: rebuild it"
            )
        for key, want in (expect or {}).items():
            have = m.get(key)
            if key == "tap_layers":  # a subset of the stored layers is enough
                have, want = list(have or []), list(want)
                if set(want) <= set(have):
                    continue
            if have != want:
                raise StoreError(
                    f"{self.path}: stored for {key} {have!r}, but this run needs {want!r} "
                    f"(build a store for it: python -m dflash_jax.training.tap_store ...)"
                )
        self.width = int(m["hidden_size"]) * len(m["tap_layers"])
        self.k = int(m["top_k"])
        self.dtype = m["dtype"]
        self.seq_len = int(m["seq_len"])
        self._load_index()
        self._files: dict = {}

    def _load_index(self):
        ipath = os.path.join(self.path, "index.npz")
        if os.path.exists(ipath):
            with np.load(ipath) as z:
                self.index = {k: z[k].copy() for k in z.files}
        else:
            self.index = {
                k: np.zeros(0, np.int64) for k in ("n_tokens", "crc", "shard", "offset", "nbytes")
            }
        n = len(self.index["n_tokens"])
        self.done = self.index["nbytes"] > 0 if n else np.zeros(0, bool)

    def __len__(self) -> int:
        return int(np.sum(self.done))

    def has(self, i: int) -> bool:
        return i < len(self.done) and bool(self.done[i])

    def check_records(self, docs: Sequence, tokenize_fn: Callable) -> None:
        """Every document i is record i of the store, with the same token ids (crc32)."""
        n = len(docs)
        if len(self.done) < n or not np.all(self.done[:n]):
            missing = n if len(self.done) < n else int(np.sum(~self.done[:n]))
            raise StoreError(
                f"{self.path}: holds {len(self)} of the {n} training records ({missing} "
                "missing): build the rest with python -m dflash_jax.training.tap_store"
            )
        for i in range(n):
            ids = tokenize_fn(docs[i])[0]
            if len(ids) != self.index["n_tokens"][i] or ids_crc(ids) != self.index["crc"][i]:
                raise StoreError(
                    f"{self.path}: record {i} holds other tokens than the training data's "
                    "record (another data file or order)"
                )

    def _file(self, shard: int):
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = open(os.path.join(self.path, f"shard_{shard:05d}.bin"), "rb")
        return f

    def read(self, i: int):
        """(taps float32 [n, width], top-k ids int32 [n, k], log-probs float32 [n, k]) of
        record i, every token of it (its pieces concatenated)."""
        f = self._file(int(self.index["shard"][i]))
        f.seek(int(self.index["offset"][i]))
        blob = f.read(int(self.index["nbytes"][i]))
        return _decode(blob, int(self.index["n_tokens"][i]), self.width, self.k, self.dtype)

    def close(self):
        for f in self._files.values():
            f.close()
        self._files = {}


def create(path: str, manifest: dict) -> None:
    """A new, empty store (refused over an existing one with another manifest)."""
    os.makedirs(path, exist_ok=True)
    mpath = os.path.join(path, "manifest.json")
    if os.path.exists(mpath):
        TapStore(path, expect={k: v for k, v in manifest.items() if k != "records"})
        return
    tmp = mpath + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(manifest, format=FORMAT, version=VERSION), f, indent=1)
    os.replace(tmp, mpath)


class _Writer:
    """Appends record blobs to the last shard; the index is rewritten (atomically) on
    `flush`, so a stopped build loses at most the records since the last flush."""

    def __init__(self, store: TapStore, n_records: int):
        self.store = store
        idx = store.index
        have = len(idx["n_tokens"])
        if have < n_records:
            for k in idx:
                idx[k] = np.concatenate([idx[k], np.zeros(n_records - have, np.int64)])
        self.shard = int(idx["shard"].max()) if have else 0
        self.f = None

    def _open(self):
        p = os.path.join(self.store.path, f"shard_{self.shard:05d}.bin")
        self.f = open(p, "ab")
        if self.f.tell() >= SHARD_BYTES:
            self.f.close()
            self.shard += 1
            self._open()

    def add(self, i: int, ids, blob: bytes):
        if self.f is None:
            self._open()
        idx = self.store.index
        off = self.f.tell()
        self.f.write(blob)
        idx["n_tokens"][i] = len(ids)
        idx["crc"][i] = ids_crc(ids)
        idx["shard"][i] = self.shard
        idx["offset"][i] = off
        idx["nbytes"][i] = len(blob)
        if off + len(blob) >= SHARD_BYTES:
            self.f.close()
            self.f = None
            self.shard += 1

    def flush(self):
        if self.f is not None:
            self.f.flush()
            os.fsync(self.f.fileno())
        path = os.path.join(self.store.path, "index.npz")
        tmp = path + ".tmp.npz"
        np.savez(tmp, **self.store.index)
        os.replace(tmp, path)
        self.store._load_index()

    def close(self):
        self.flush()
        if self.f is not None:
            self.f.close()


def make_pass(tmod, tap_layers, top_k: int):
    """jit(params, ids [B,S], positions [B,S], segment_ids [B,S]) -> (taps [B,S,F] float32,
    top-k ids [B,S,k], their log-probs [B,S,k]): the target's teacher-forced pass over packed
    pieces, each its own sequence (positions from 0, attention within its segment)."""
    import jax
    import jax.numpy as jnp

    tap_layers = tuple(tap_layers)

    def run(params, ids, pos, seg):
        hidden, _, taps = tmod.apply(
            {"params": params}, ids, pos, tap_layers=tap_layers, segment_ids_BT=seg
        )
        logits = tmod.apply({"params": params}, hidden, method="logits")
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        top_logp, top_ids = jax.lax.top_k(logp, top_k)
        return taps.astype(jnp.float32), top_ids.astype(jnp.int32), top_logp

    return jax.jit(run)


def build(
    target,
    records: Sequence,
    tokenize_fn: Callable,
    path: str,
    tap_layers: Sequence[int],
    seq_len: int,
    top_k: int = 16,
    dtype: str = "bfloat16",
    rows: int = 8,
    target_name: str = "",
    log: Callable = print,
    flush_every: int = 64,
) -> TapStore:
    """Writes (or completes: records already stored are skipped) the store of `records` at
    `path`. Pieces are packed first-fit into [rows, seq_len] batches for the target's pass."""
    from dflash_jax.models.target import target_module
    from dflash_jax.support import console

    if dtype not in ("bfloat16", "float32"):
        raise StoreError(f"tap store dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    tcfg = target.config
    tap_layers = [int(i) for i in tap_layers]
    if not tap_layers or min(tap_layers) < 0 or max(tap_layers) >= tcfg.num_layers:
        raise StoreError(f"tap layers {tap_layers} outside the target's {tcfg.num_layers} layers")
    if not 1 <= top_k <= tcfg.vocab_size:
        raise StoreError(f"top_k must be in [1, {tcfg.vocab_size}], got {top_k}")
    manifest = dict(
        target=target_fingerprint(tcfg, target.params),
        target_name=target_name,
        tap_layers=tap_layers,
        hidden_size=int(tcfg.hidden_size),
        seq_len=int(seq_len),
        top_k=int(top_k),
        dtype=dtype,
        compression="zlib-1; 16-bit taps split into high- and low-byte planes",
    )
    create(path, manifest)
    store = TapStore(path)
    writer = _Writer(store, len(records))
    todo = [i for i in range(len(records)) if not store.has(i)]
    tmod = target_module(tcfg, "xla")
    run = make_pass(tmod, tap_layers, top_k)
    n_tok = sum(len(tokenize_fn(records[i])[0]) for i in todo)
    log(
        f"tap store {path}: {len(records) - len(todo)} of {len(records)} records kept, "
        f"{len(todo)} to compute ({n_tok} tokens)"
    )
    bar = console.progress(total=n_tok, desc="tap store", unit="tok")
    t0, done_tok = time.time(), 0
    pending = {}  # record -> {offset: (taps, ids, logp)} until every piece is computed
    queue = []  # (record, offset, length, ids)
    for i in todo:
        ids = np.asarray(tokenize_fn(records[i])[0], np.int32)
        for off, n in pieces(len(ids), seq_len):
            queue.append((i, off, n, ids))
    since_flush = 0
    while queue:
        batch, queue = _first_fit(queue, rows, seq_len)
        taps, tid, tlp = (np.asarray(x) for x in run(target.params, *_packed(batch, seq_len)))
        for r, items in enumerate(batch):
            for at, (i, off, n, ids) in items:
                got = pending.setdefault(i, {})
                got[off] = (taps[r, at : at + n], tid[r, at : at + n], tlp[r, at : at + n])
                if len(got) == len(pieces(len(ids), seq_len)):
                    parts = [got[o] for o, _ in pieces(len(ids), seq_len)]
                    blob = _encode(*(np.concatenate(p) for p in zip(*parts)), dtype)
                    writer.add(i, ids, blob)
                    del pending[i]
                    since_flush += 1
                    done_tok += len(ids)
                    bar.update(len(ids))
        if since_flush >= flush_every:
            writer.flush()
            since_flush = 0
            dt = time.time() - t0
            log(f"tap store: {len(writer.store)} records, {done_tok / dt:.0f} tokens/s")
    writer.close()
    bar.close()
    dt = time.time() - t0
    if todo:
        log(
            f"tap store: {len(todo)} records ({done_tok} tokens) in {dt:.0f} s, "
            f"{done_tok / max(dt, 1e-9):.0f} tokens/s"
        )
    return TapStore(path)


def _first_fit(queue, rows: int, seq_len: int):
    """(batch, the rest of the queue): queued pieces (record, offset, length, ids) packed in
    order, first fit, into `rows` rows of `seq_len` tokens; batch[r] lists (start, piece)."""
    batch, fill, rest = [[] for _ in range(rows)], [0] * rows, []
    for j, item in enumerate(queue):
        for r in range(rows):
            if fill[r] + item[2] <= seq_len:
                batch[r].append((fill[r], item))
                fill[r] += item[2]
                break
        else:
            rest.append(item)
        if all(f == seq_len for f in fill):
            rest.extend(queue[j + 1 :])
            break
    return batch, rest


def _packed(batch, seq_len: int):
    """(ids, positions, segment ids) [rows, seq_len] of a packed batch (`_first_fit`): each
    piece its own segment, positions from 0 within it; padding is segment 0."""
    rows = len(batch)
    ids_b, pos_b, seg_b = (np.zeros((rows, seq_len), np.int32) for _ in range(3))
    for r, items in enumerate(batch):
        for s_, (at, (i, off, n, ids)) in enumerate(items):
            ids_b[r, at : at + n] = ids[off : off + n]
            pos_b[r, at : at + n] = np.arange(n)
            seg_b[r, at : at + n] = s_ + 1
    return ids_b, pos_b, seg_b


class StoreSource:
    """batch (with doc_key / doc_offset) -> {"taps" [B,S,F], "topk_ids", "topk_logp" [B,S,k]}
    read from the store (zeros in the padding): what the train step takes instead of running
    the target. The last `cache_records` records read are kept in memory (an LRU)."""

    def __init__(self, store: TapStore, tap_layers=None, cache_records: int = 256):
        from collections import OrderedDict

        self.store = store
        stored = list(store.manifest["tap_layers"])
        h = int(store.manifest["hidden_size"])
        layers = stored if tap_layers is None else list(tap_layers)
        # the columns of the requested layers, in their order, from the stored concatenation
        self.cols = np.concatenate([np.arange(h) + stored.index(i) * h for i in layers])
        self.width = len(self.cols)
        self.all_cols = len(layers) == len(stored) and layers == stored
        self.cache = OrderedDict()
        self.cache_records = cache_records
        self.read_s = 0.0

    def _record(self, k: int):
        got = self.cache.get(k)
        if got is not None:
            self.cache.move_to_end(k)
            return got
        t = time.perf_counter()
        got = self.store.read(k)
        self.read_s += time.perf_counter() - t
        self.cache[k] = got
        if len(self.cache) > self.cache_records:
            self.cache.popitem(last=False)
        return got

    def __call__(self, batch) -> dict:
        from dflash_jax.training.tap_cache import TapCache

        shape = batch["segment_ids"].shape
        s = self.store
        taps = np.zeros(shape + (self.width,), np.float32)
        ids = np.zeros(shape + (s.k,), np.int32)
        logp = np.full(shape + (s.k,), -1e9, np.float32)
        for b, st, en, k, o in TapCache._segments(batch):
            t, i, p = self._record(k)
            t = t[o : o + en - st]
            taps[b, st:en] = t if self.all_cols else t[:, self.cols]
            ids[b, st:en] = i[o : o + en - st]
            logp[b, st:en] = p[o : o + en - st]
        return {"taps": taps, "topk_ids": ids, "topk_logp": logp}


def main():
    """python -m dflash_jax.training.tap_store --target=T --responses=R.jsonl --out=DIR
    (--tap_layers=1,14,27 | --drafter=DIR) [--seq_len=512] [--top_k=16] [--dtype=bfloat16]"""
    from absl import flags

    from dflash_jax.support import cli

    flags.DEFINE_string("target", None, "Target: a directory, GGUF file or name.")
    flags.DEFINE_string("responses", None, "The data: regenerated JSONL (regen.output).")
    flags.DEFINE_string("out", None, "The store directory (completed if it exists).")
    flags.DEFINE_string("tap_layers", "", "Tapped target layers, comma-separated.")
    flags.DEFINE_string("drafter", "", "Or: the tap layers of this drafter.")
    flags.DEFINE_integer("seq_len", 512, "The trainer's data.seq_len (piece length).")
    flags.DEFINE_integer("top_k", 16, "Next-token distribution entries kept per position.")
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Taps stored as.")
    flags.DEFINE_integer("rows", 8, "Rows of seq_len per target pass.")
    flags.DEFINE_integer("limit", 0, "Only the first N records (0: all).")
    F = flags.FLAGS

    def run(argv):
        if not F.target or not F.responses or not F.out:
            raise ValueError("--target, --responses and --out are required")
        if bool(F.tap_layers) == bool(F.drafter):
            raise ValueError("give exactly one of --tap_layers and --drafter")
        if F.seq_len < 1 or F.rows < 1 or F.limit < 0:
            raise ValueError("--seq_len and --rows must be >= 1, --limit >= 0")
        if not os.path.isfile(F.responses):
            raise ValueError(f"--responses {F.responses}: no such file")
        layers = None
        if F.tap_layers:
            try:
                layers = [int(x) for x in F.tap_layers.split(",")]
            except ValueError:
                raise ValueError(f"--tap_layers {F.tap_layers!r}: integers, comma-separated")
        import dflash_jax as dj
        from dflash_jax.training.regenerate import read_records, record_tokens

        target = dj.load_target(F.target, dtype="float32")
        if F.drafter:  # the layers its kind taps (a DFlash drafter's target_layer_ids)
            from dflash_jax.drafters import registry

            kind = registry.for_spec(F.drafter)
            dcfg = kind.read_config(F.drafter, target.config)
            layers = list(kind.tap_layers(dcfg, target.config.num_layers))
        records = read_records(F.responses, vocab_size=target.config.vocab_size)
        if F.limit:
            records = records[: F.limit]
        build(
            target,
            records,
            record_tokens,
            F.out,
            layers,
            F.seq_len,
            F.top_k,
            F.dtype,
            F.rows,
            target_name=F.target,
        )

    cli.run(run)


if __name__ == "__main__":
    main()
