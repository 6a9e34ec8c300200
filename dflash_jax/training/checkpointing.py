"""Orbax checkpoints of the training state: periodic async saves, keep-N, robust restore.

A checkpoint step holds two items: `state` (TrainState: step, params, opt_state, rng) and
`data` (the JSON state of the batch iterator), so a resumed run sees exactly the batches and
random numbers the uninterrupted run would have.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Set, Tuple

import jax
import orbax.checkpoint as ocp

from dflash_jax.models.safetensors_io import CheckpointError


def _is_read_noise(exc) -> bool:
    """An exception of an Orbax / TensorStore read of an unreadable checkpoint (raised in the
    async tasks of a failed restore)."""
    if exc is None:
        return False
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return True  # a read task finalized after Orbax closed its event loop
    if "TensorStore" in str(exc) or "reading array index" in str(exc):
        return True
    tb = getattr(exc, "__traceback__", None)
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if f"{os.sep}orbax{os.sep}" in name or f"{os.sep}tensorstore{os.sep}" in name:
            return True
        tb = tb.tb_next
    return False


class _AsyncioReadNoise(logging.Filter):
    """Drops asyncio's 'exception was never retrieved' records of a failed restore's read
    tasks (dozens of tracebacks); kept with --verbose."""

    def filter(self, record):
        from dflash_jax.support import console

        exc = record.exc_info[1] if record.exc_info else None
        return console.verbose() or not _is_read_noise(exc)


_quiet = {"installed": False}


def _quiet_read_noise() -> None:
    """After a restore failed: the read tasks it left behind are reported by asyncio (a log
    record each) and by the garbage collector (`sys.unraisablehook`, 'Exception ignored in
    ...') with a traceback each, whenever they are collected. The skipped checkpoint already
    has its one warning line; these go only with --verbose. Installed once per process."""
    import sys

    if not _quiet["installed"]:
        _quiet["installed"] = True
        logging.getLogger("asyncio").addFilter(_AsyncioReadNoise())
        previous = sys.unraisablehook

        def hook(unraisable):
            from dflash_jax.support import console

            if console.verbose() or not _is_read_noise(unraisable.exc_value):
                previous(unraisable)

        sys.unraisablehook = hook
    import gc

    gc.collect()  # the failed restore's tasks and coroutines, now, under the filters


class IncompatibleCheckpointError(CheckpointError):
    """A readable checkpoint whose structure or shapes differ from the config's model: it is
    someone's good work, so it is never skipped, deleted or overwritten."""


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def tree_shapes(tree) -> Dict[str, tuple]:
    """{"params.layers_0.attn.q_proj.kernel": shape, ...} for a pytree of arrays, abstract
    arrays, or Orbax array metadata (the names Orbax stores)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        ".".join(_key_name(k) for k in path): tuple(getattr(x, "shape", ())) for path, x in leaves
    }


def shape_differences(saved: Dict[str, tuple], expected: Dict[str, tuple]) -> List[str]:
    """What differs between a checkpoint's names/shapes and the config's, as short phrases."""
    out = [
        f"{k}: checkpoint {saved[k]} vs config {expected[k]}"
        for k in sorted(saved.keys() & expected.keys())
        if saved[k] != expected[k]
    ]
    only_saved = sorted(saved.keys() - expected.keys())
    only_cfg = sorted(expected.keys() - saved.keys())
    if only_saved:
        out.append(
            f"{len(only_saved)} key(s) only in the checkpoint ({', '.join(only_saved[:3])}"
            f"{', ...' if len(only_saved) > 3 else ''})"
        )
    if only_cfg:
        out.append(
            f"{len(only_cfg)} key(s) only in the config ({', '.join(only_cfg[:3])}"
            f"{', ...' if len(only_cfg) > 3 else ''})"
        )
    return out


def layout_change(saved: Dict[str, tuple], expected: Dict[str, tuple]) -> Optional[str]:
    """What a target-mode checkpoint's layer layout (`models/layer_stack.py`) says against the
    config's, when only that differs in kind: one per name (layers_0, ...) against stacked
    (layers), either way; None otherwise."""
    looped = lambda d: any(k.startswith("params.layers_0.") for k in d)  # noqa: E731
    stacked = lambda d: any(k.startswith("params.layers.") for k in d)  # noqa: E731
    hint = (
        "resume it with scan_layers={was}, the layout it was written in; to go on {now}, export "
        "that run (WORKDIR/export/target, a Hugging Face directory, loads in either layout) "
        "and train from it as target_path"
    )
    if looped(saved) and stacked(expected):
        return (
            "it holds the target's layers one by one (layers_0, ...) and this config stacks "
            "them (scan_layers=True); " + hint.format(was="False", now="stacked")
        )
    if stacked(saved) and looped(expected):
        return (
            "it holds the target's layers stacked (scan_layers=True) and this config runs them "
            "one by one; " + hint.format(was="True", now="looped")
        )
    return None


class Checkpointer:
    """Wraps `ocp.CheckpointManager` (async saves every `every` steps, keeps `keep`).

    Restore tells two failures apart. An *incompatible* checkpoint (readable metadata whose
    names or shapes differ from the state to restore, e.g. a changed model shape) raises
    `IncompatibleCheckpointError` before training, naming the differences and the directory;
    nothing is deleted. A *corrupt* one (unreadable: truncated or garbled files) is skipped
    with a warning and the previous one is tried; when the rerun reaches a corrupt step's
    number it replaces that checkpoint. Keep-N is applied here, not by Orbax, over good
    checkpoints only, after the previous save has finished: a corrupt newer step never pushes
    out the newest good one, and a kill during a save leaves the previous one in place.
    """

    def __init__(self, directory: str, every: int, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        self.every = max(1, int(every))
        self.keep = max(1, int(keep))
        self.corrupt: Set[int] = set()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,
            save_interval_steps=1,
            enable_async_checkpointing=async_save,
            create=True,
        )
        # Handlers named up front so that a checkpoint's metadata can be read before restoring.
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": ocp.JsonCheckpointHandler(),
            },
        )

    def _prune(self) -> None:
        """Deletes the oldest good checkpoints beyond `keep` (finished saves only)."""
        self.manager.wait_until_finished()
        good = sorted(s for s in self.manager.all_steps() if s not in self.corrupt)
        for step in good[: -self.keep]:
            self.manager.delete(step)

    def maybe_save(self, step: int, state, data_state, force: bool = False) -> bool:
        """Saves at multiples of `every` (or when forced). Returns whether it saved. A corrupt
        checkpoint at this step is replaced; a good one is kept. `data_state`: a dict, or a
        function returning it, called only when saving (with several processes it gathers
        their iterator positions, a collective)."""
        if not force and step % self.every:
            return False
        self._prune()
        if step in self.manager.all_steps():
            if step not in self.corrupt:
                return False
            logging.info("replacing the unreadable checkpoint step %d in %s", step, self.directory)
            self.manager.delete(step)
            self.corrupt.discard(step)
        if callable(data_state):
            data_state = data_state()
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
            ),
            force=True,
        )
        return True

    def _check_compatible(self, step: int, abstract_state) -> bool:
        """Raises IncompatibleCheckpointError when step's stored names/shapes differ from
        `abstract_state`; False when its metadata is unreadable (corrupt), else True."""
        try:
            meta = self.manager.item_metadata(step)["state"]
            saved = tree_shapes(meta)
        except Exception:  # noqa: BLE001 - unreadable metadata: corrupt, not incompatible
            return False
        if not saved:
            return False
        expected = tree_shapes(abstract_state)
        layout = layout_change(saved, expected)
        if layout:
            raise IncompatibleCheckpointError(
                f"checkpoint step {step} in {self.directory}: {layout}. Nothing was changed"
            )
        diff = shape_differences(saved, expected)
        # The optimizer moments mirror the parameters: name the parameters when they differ.
        params_only = lambda d: {k: v for k, v in d.items() if k.startswith("params.")}
        diff = shape_differences(params_only(saved), params_only(expected)) or diff
        if diff:
            raise IncompatibleCheckpointError(
                f"checkpoint step {step} in {self.directory} does not match this config's "
                f"model: {'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''}. Nothing was "
                "changed: use another --workdir, or the config it was trained with"
            )
        return True

    def restore(self, abstract_state) -> Optional[Tuple[Any, dict, int]]:
        """(state, data_state, step) from the newest readable checkpoint, or None.

        An unreadable checkpoint (truncated, corrupted) is skipped with a warning and the
        previous one is tried; an incompatible one raises `IncompatibleCheckpointError`.
        """
        self.manager.reload()
        for step in sorted(self.manager.all_steps(), reverse=True):
            err = None
            if self._check_compatible(step, abstract_state):
                try:
                    out = self.manager.restore(
                        step,
                        args=ocp.args.Composite(
                            state=ocp.args.StandardRestore(abstract_state),
                            data=ocp.args.JsonRestore(),
                        ),
                    )
                    return out["state"], dict(out["data"]), int(step)
                except Exception as e:  # noqa: BLE001 - any failure means "unreadable"
                    err = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    from dflash_jax.support import console

                    logging.log(  # the traceback on the console with --verbose only
                        logging.INFO if console.verbose() else logging.DEBUG,
                        "restoring checkpoint step %d failed",
                        step,
                        exc_info=True,
                    )
                    del e
                    _quiet_read_noise()
            else:
                err = "metadata unreadable"
            self.corrupt.add(int(step))
            # One line per skipped checkpoint (details with --verbose).
            logging.warning(
                "checkpoint step %d in %s is unreadable (%s); falling back to the previous "
                "one (it is replaced when training reaches step %d again)",
                step,
                self.directory,
                err,
                step,
            )
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self._prune()
        self.manager.close()
