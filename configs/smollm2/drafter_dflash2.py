"""The DFlash 2 drafter for SmolLM2-135M-Instruct (assets/smollm2-135m-instruct/drafter_dflash2):
a trained DFlash drafter (`drafter.init_path`, configs/smollm2/drafter.py's) continued as
DFlash 2 (`upgrade_to_dflash2`: its layers kept, the convolutions starting as the identity, the
candidate selector new at the published sizes, rank 256 over the top 16), 60 steps at lr 5e-4
on the same regenerated responses. The DFlash drafter it is compared with is the same command
with `--config.drafter.dflash2.enabled=False` (the same init, steps and data):

    python train.py --config=configs/smollm2/drafter_dflash2.py --workdir=runs/smollm2/stage4/dflash2 \\
        --config.regen.output=runs/smollm2/responses.jsonl \\
        --config.drafter.init_path=runs/smollm2/stage3/train/export/drafter

The story and the figures: benchmarks/results/smollm2/README.md.
"""

from configs.smollm2.drafter import get_config as drafter_config


def get_config():
    c = drafter_config()
    c.drafter.dflash2.enabled = True
    c.learning_rate = 5e-4
    c.num_train_steps = 60
    c.eval_every = 30
    c.checkpoint_every = 10
    return c
