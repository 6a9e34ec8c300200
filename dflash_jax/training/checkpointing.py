"""Orbax checkpoints of the training state: periodic async saves, keep-N, robust restore.

A checkpoint step holds two items: `state` (TrainState: step, params, opt_state, rng) and
`data` (the JSON state of the batch iterator), so a resumed run sees exactly the batches and
random numbers the uninterrupted run would have.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Optional, Tuple

import orbax.checkpoint as ocp


class Checkpointer:
    """Wraps `ocp.CheckpointManager` (async saves every `every` steps, keeps `keep`)."""

    def __init__(self, directory: str, every: int, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        self.every = max(1, int(every))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=1, enable_async_checkpointing=async_save,
            create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data"))

    def maybe_save(self, step: int, state, data_state, force: bool = False) -> bool:
        """Saves at multiples of `every` (or when forced). Returns whether it saved.
        `data_state`: a dict, or a function returning it, called only when saving (with
        several processes it gathers their iterator positions, a collective)."""
        if not force and step % self.every:
            return False
        if step in self.manager.all_steps():
            return False
        if callable(data_state):
            data_state = data_state()
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
            force=True)
        return True

    def restore(self, abstract_state) -> Optional[Tuple[Any, dict, int]]:
        """(state, data_state, step) from the newest readable checkpoint, or None.

        An unreadable checkpoint (truncated, corrupted) is skipped with a warning and the
        previous one is tried.
        """
        self.manager.reload()
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    data=ocp.args.JsonRestore()))
                return out["state"], dict(out["data"]), int(step)
            except Exception as e:  # noqa: BLE001 - any failure means "unreadable"
                msg = (f"checkpoint step {step} in {self.directory} is unreadable "
                       f"({type(e).__name__}: {str(e)[:200]}); falling back to the previous one")
                logging.warning(msg)
                warnings.warn(msg, RuntimeWarning)
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
