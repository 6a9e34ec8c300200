"""Training: the DFlash drafter recipe, target pretraining, regeneration, checkpoints.

Entry point: `train_and_evaluate(config, workdir)` (see `trainer.py` and `configs/*.py`):
the loop in `trainer.py`, its checks before any compute in `preflight.py` and its log window
in `run_log.py`, the step (state, optimizer, gradient accumulation, shardings) in `step.py`, evaluation in `evaluation.py`, export in `export.py`, the run built from its config
(data, models, loss) in `experiment.py`. The training mask and loss weights are in `masks.py`,
the objectives in `losses.py`.
"""

from dflash_jax.training import masks
from dflash_jax.training.losses import DrafterRecipe, drafter_loss, target_loss


def __getattr__(name):  # the trainer pulls in orbax / data: import it on first use
    if name == "train_and_evaluate":
        from dflash_jax.training import trainer

        return trainer.train_and_evaluate
    if name in ("TrainState", "make_optimizer", "make_train_step"):
        from dflash_jax.training import step

        return getattr(step, name)
    if name in ("Experiment", "build_experiment"):
        from dflash_jax.training import experiment

        return getattr(experiment, name)
    raise AttributeError(name)


__all__ = [
    "DrafterRecipe",
    "drafter_loss",
    "masks",
    "target_loss",
    "train_and_evaluate",
    "TrainState",
    "make_optimizer",
    "make_train_step",
    "Experiment",
    "build_experiment",
]
