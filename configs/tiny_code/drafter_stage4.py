"""Stage 4 of the bundled drafter: adapted to the unlikelihood-tuned target.

The target fine-tuned against greedy loops (configs/tiny_code/target_unlikelihood.py) answers
differently from the stage-2 one the stage-3 drafter learned (fewer loops, which were the easiest
text to draft) and its hidden states moved, so the drafter is adapted to it: 32,768 fresh
responses of the new target (the prompts of stages 2 and 3: seeds 0 and 1), and 3000 steps from
the stage-3 drafter at stage 3's peak learning rate. About 35 minutes of regeneration and 20 of
training on an otherwise idle 2-core CPU:

    for seed in 0 1; do  # the responses only (regen.only: no training)
      python train.py --config=configs/tiny_code/drafter_stage3.py --workdir=/tmp/regen_ul_$seed \\
          --config.target_path=/tmp/stage_ul/target --config.seed=$seed \\
          --config.drafter.init_path=/tmp/tiny_drafter3/export/drafter \\
          --config.regen.output=/tmp/regen_ul_$seed.jsonl --config.regen.only=True
    done
    cat /tmp/regen_ul_0.jsonl /tmp/regen_ul_1.jsonl > /tmp/regen_ul_32k.jsonl
    python train.py --config=configs/tiny_code/drafter_stage4.py --workdir=/tmp/tiny_drafter4 \\
        --config.target_path=/tmp/stage_ul/target \\
        --config.drafter.init_path=/tmp/tiny_drafter3/export/drafter \\
        --config.regen.output=/tmp/regen_ul_32k.jsonl
"""

from configs.tiny_code.drafter_stage3 import get_config as stage3_config


def get_config():
    c = stage3_config()
    c.target_path = ""  # required: the unlikelihood-tuned target (bf16, as bundled)
    c.drafter.init_path = ""  # required: the stage-3 drafter export
    c.regen.output = ""  # the 32,768 responses of the new target
    c.num_train_steps = 3000
    return c
