"""Export of a trained model: a drafter in the z-lab format, a target in the Hugging Face
format with its tokenizer beside it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dflash_jax.models.target import save_target
from dflash_jax.parallel import distributed

if TYPE_CHECKING:
    from dflash_jax.training.experiment import Experiment


def export(exp: Experiment, params, directory: str) -> str:
    """Drafter: its kind's format (DFlash: z-lab's). Target: HF format with the tokenizer
    beside it."""
    from dflash_jax.drafters import registry

    params = distributed.gather(params)  # all processes take part; process 0 writes
    if exp.mode == "drafter":
        path = os.path.join(directory, "drafter")
        if not distributed.is_primary():
            return path
        drafter = exp.drafter_for(params)
        registry.of(drafter).save(drafter, path)  # its kind's format (z-lab, EAGLE-3's)
    else:
        path = os.path.join(directory, "target")
        if not distributed.is_primary():
            return path
        save_target(exp.target_for(params), path)
        if exp.tokenizer is not None and not os.path.exists(os.path.join(path, "tokenizer.json")):
            exp.tokenizer.save(path)
    return path
