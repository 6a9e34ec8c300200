"""Stage 3 of the bundled drafter: twice the regenerated responses, same (stage-2) target.

The stage-2 fine-tune (configs/tiny_code/drafter_stage2.py) had nearly stopped improving on its
16,384 responses (held-out loss 1.98 -> 1.96 over its last 1000 steps). This stage regenerates
16,384 more with another seed (other random windows and functions of the training files), and
continues from the stage-2 drafter on all 32,768 (~1 epoch) at a lower peak learning rate.
About 17 minutes of regeneration and 25 of training on an otherwise idle 2-core CPU:

    # the new responses only (regen.only: no training)
    python train.py --config=configs/tiny_code/drafter_stage2.py --workdir=/tmp/regen_seed1 \
        --config.target_path=assets/tiny-code/target --config.seed=1 \
        --config.drafter.init_path=/tmp/tiny_drafter2/export/drafter \
        --config.regen.output=/tmp/regen_seed1.jsonl --config.regen.only=True
    cat /tmp/tiny_drafter2/regenerated.jsonl /tmp/regen_seed1.jsonl > /tmp/regen_32k.jsonl
    python train.py --config=configs/tiny_code/drafter_stage3.py --workdir=/tmp/tiny_drafter3 \
        --config.target_path=assets/tiny-code/target \
        --config.drafter.init_path=/tmp/tiny_drafter2/export/drafter \
        --config.regen.output=/tmp/regen_32k.jsonl
"""

from configs.tiny_code.drafter_stage2 import get_config as stage2_config


def get_config():
    c = stage2_config()
    c.target_path = ""  # required: the stage-2 target (the bundled one)
    c.drafter.init_path = ""  # required: the stage-2 drafter export
    c.regen.output = ""  # the 32,768 responses (kept last 5% held out for the in-loop eval)
    c.learning_rate = 4e-4
    c.num_train_steps = 4000
    return c
