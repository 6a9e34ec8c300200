"""Several JAX processes (TPU pod hosts, GPU nodes, or `dflash_jax.launch` on one machine).

On a pod every host runs the same program; arrays on a mesh over `jax.devices()` span devices
that one process cannot address, so host values go in through `put` (each process supplies the
slices its devices hold) and come back through `gather` (every process gets the whole value).

    initialize(auto)        join the process group (the CLIs call it first thing)
    is_primary()            process 0: the one that prints, writes metrics, exports
    put(tree, shardings)    host values / arrays -> arrays with these shardings
    gather(tree)            arrays -> numpy on every process
    any_process(flag)       OR of a flag over processes (a coordinated stop)
    allgather_json(obj)     one JSON-able object per process, on every process
    broadcast(tree)         process 0's values on every process
    primary_first(fn)       fn on process 0, then on the others (files they then read)
    shard_batches(it, sh)   the training batches, each process reading only its streams

With one process all of these reduce to `jax.device_put` / `jax.device_get` and no collective.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, List

import jax
import numpy as np

from dflash_jax.parallel.launch import ENV_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID

_STATE = {"initialized": False}


def initialize(auto: bool = False) -> bool:
    """Joins the process group before any other JAX call; returns whether this is a
    multi-process run.

    - Under `dflash_jax.launch` (its DFLASH_* environment): `jax.distributed.initialize` with
      that coordinator address, process count and index.
    - `auto=True` (the CLIs' --distributed): `jax.distributed.initialize()` without arguments,
      which finds them itself on Cloud TPU pods, SLURM, Open MPI and Kubernetes, or from
      JAX_COORDINATOR_ADDRESS.
    - Otherwise nothing: a single process.
    Calling it again is a no-op.
    """
    if _STATE["initialized"] or getattr(jax.distributed, "is_initialized", lambda: False)():
        _STATE["initialized"] = True
        return True
    kwargs = None
    if os.environ.get(ENV_ADDRESS):
        try:
            kwargs = dict(
                coordinator_address=os.environ[ENV_ADDRESS],
                num_processes=int(os.environ[ENV_NUM_PROCESSES]),
                process_id=int(os.environ[ENV_PROCESS_ID]),
            )
        except (KeyError, ValueError) as e:
            raise ValueError(
                f"{ENV_ADDRESS} is set but {ENV_NUM_PROCESSES} / "
                f"{ENV_PROCESS_ID} are missing or not integers ({e})"
            ) from None
    elif auto:
        kwargs = {}
    if kwargs is None:
        return False
    try:
        # Cross-process collectives on CPU (the default in recent JAX; older ones had none).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # noqa: BLE001 - an option this JAX does not have: its default stands
        pass
    jax.distributed.initialize(**kwargs)
    _STATE["initialized"] = True
    if jax.process_count() > 1:
        sys.excepthook = _exit_now
    return True


def _exit_now(exc_type, exc, tb):
    """An uncaught exception in a process of a group: print it and exit at once. A normal
    exit would first wait (minutes) in JAX's shutdown barrier for processes that are themselves
    blocked in a collective with this one; exiting lets them fail and the launcher see it."""
    traceback.print_exception(exc_type, exc, tb)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def is_primary() -> bool:
    return jax.process_index() == 0


def say(msg: str) -> None:
    """One line on stdout (and the CLI's log file), from process 0 only: every process sees
    the same values, so they are printed once."""
    if is_primary():
        from dflash_jax.support import console

        console.say(msg)  # stdout, and the CLI's log file (never twice on the console)


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def _is_global(x) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def put(tree, shardings):
    """`jax.device_put(tree, shardings)` that also works when the shardings span devices of
    other processes. A leaf may be:

    - a jax.Array spanning processes: resharded on device (no host copy);
    - a host value (numpy, or an array on this process's devices) with the GLOBAL shape: every
      process passes the same value, or at least the right values at the indices its own
      devices hold (a data-parallel batch: each process fills only its rows).
    `shardings` mirrors `tree` (or is one sharding for all leaves); None leaves stay None.
    """
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree_util.tree_map(lambda _: shardings, tree)

    def one(x, sh):
        if x is None:
            return None
        if sh.is_fully_addressable or _is_global(x):
            return jax.device_put(x, sh)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])

    return jax.tree_util.tree_map(one, tree, shardings)


def gather(tree):
    """Every leaf as a numpy array holding the whole (global) value, on every process.
    Collective when some leaf spans several processes: all processes must call it."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if any(_is_global(x) for x in leaves):
        from jax.experimental import multihost_utils

        leaves = [
            multihost_utils.process_allgather(x, tiled=True) if _is_global(x) else np.asarray(x)
            for x in leaves
        ]
    else:
        leaves = jax.device_get(leaves)
    return jax.tree_util.tree_unflatten(treedef, [np.asarray(x) for x in leaves])


def any_process(flag: bool) -> bool:
    """True when `flag` is true on any process (collective with several processes)."""
    if not is_multiprocess():
        return bool(flag)
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.asarray([int(bool(flag))], np.int32))
    return bool(np.any(flags))


def allgather_json(obj) -> List[Any]:
    """[obj of process 0, obj of process 1, ...] on every process (obj JSON-able)."""
    if not is_multiprocess():
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray([data.size], np.int32)).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: data.size] = data
    bufs = multihost_utils.process_allgather(buf)
    return [json.loads(bytes(b[:n]).decode()) for b, n in zip(bufs, sizes)]


def broadcast(tree):
    """Process 0's values of a pytree of numbers / numpy arrays, on every process."""
    if not is_multiprocess():
        return tree
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree)


def sync(name: str) -> None:
    """A barrier: returns when every process has reached `sync(name)`."""
    if is_multiprocess():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def primary_first(fn, name: str):
    """fn() on process 0 and, once it has returned, on the others: for steps that write files
    the others then only read (dataset preparation, tokenizer training)."""
    if not is_multiprocess():
        return fn()
    out = fn() if is_primary() else None
    sync(name)
    return out if is_primary() else fn()


# ------------------------------------------------------------------------ data per process


class ShardedBatches:
    """The global batch as `num_shards` independent streams, each process reading only those
    whose rows its devices hold.

    Stream s is a `PackedBatchIterator` over documents s, s + n, s + 2n, ... (n = num_shards)
    giving batch_size / n rows; the global batch is the streams' rows stacked in order s = 0..n-1.
    So the global batch depends on `num_shards`, never on the process count: one process reading
    all n streams sees exactly the batches that n processes reading one each do (and can resume
    their checkpoint). `next()` returns global-shaped arrays [batch_size, seq_len] in which only
    the rows of this process's streams are filled (the rest are zeros no device reads); place
    them with `put(batch, sharding)`. The iterator position is per stream; `get_state()` gathers
    every stream's from the processes that read it (collective with several processes).
    """

    def __init__(self, streams, batch_size: int, seq_len: int, pad_id: int):
        self.streams = streams  # one per shard; None where this process does not read it
        self.batch_size, self.seq_len, self.pad_id = batch_size, seq_len, pad_id
        self.rows = batch_size // len(streams)

    @property
    def num_shards(self) -> int:
        return len(self.streams)

    def read_shards(self) -> List[int]:
        return [s for s, it in enumerate(self.streams) if it is not None]

    def __iter__(self):
        return self

    def __next__(self):
        parts = {s: next(it) for s, it in enumerate(self.streams) if it is not None}
        out = {}
        for key, first in next(iter(parts.values())).items():
            buf = np.zeros((self.batch_size,) + first.shape[1:], first.dtype)
            for s, part in parts.items():
                buf[s * self.rows : (s + 1) * self.rows] = part[key]
            out[key] = buf
        return out

    def get_state(self) -> dict:
        """{"num_shards": n, "shards": [state of stream 0, ...]}: the same on every process."""
        mine = [it.get_state() if it is not None else None for it in self.streams]
        merged = [None] * self.num_shards
        for states in allgather_json(mine):
            merged = [m if m is not None else s for m, s in zip(merged, states)]
        return {"num_shards": self.num_shards, "shards": merged}

    def set_state(self, state) -> None:
        shards = state.get("shards") if isinstance(state, dict) else None
        if shards is None or len(shards) != self.num_shards:
            have = len(shards) if shards is not None else 1
            raise ValueError(
                f"the checkpoint's data position is for {have} data shard(s), this "
                f"run reads {self.num_shards}: set data.num_shards={have} to "
                "resume it"
            )
        for it, s in zip(self.streams, shards):
            if it is not None:
                it.set_state(s)


def shard_batches(it, sharding, num_shards: int = 0):
    """`it` (a `PackedBatchIterator` over the whole source, batch = the global batch) split
    into `num_shards` streams (0: one per process) of which this process reads the ones whose
    rows `sharding` puts on its devices. One stream: `it` itself, unchanged."""
    from dflash_jax.data.packing import PackedBatchIterator

    n = int(num_shards) or jax.process_count()
    if n == 1:
        return it
    b = it.batch_size
    if b % n:
        raise ValueError(f"batch_size {b} is not divisible by data.num_shards={n}")
    rows = b // n
    needed = set()
    for index in sharding.addressable_devices_indices_map((b, it.seq_len)).values():
        start, stop, _ = index[0].indices(b)
        needed.update(range(start // rows, -(-stop // rows)))
    streams = [
        PackedBatchIterator(
            it.source,
            it.tokenize_fn,
            seq_len=it.seq_len,
            batch_size=rows,
            seed=it.seed,
            shuffle=it.shuffle,
            num_epochs=it.num_epochs,
            host_id=s,
            num_hosts=n,
            pad_id=it.pad_id,
            allow_split=it.allow_split,
            drop_remainder=it.drop_remainder,
            include_positions=it.include_positions,
        )
        if s in needed
        else None
        for s in range(n)
    ]
    return ShardedBatches(streams, b, it.seq_len, it.pad_id)
