"""A block-16 DFlash drafter for the tiny code target, on the target's own responses.

First run configs/tiny_code_target.py; this config then regenerates responses to stdlib prompts
with that target (workdir/regenerated.jsonl, greedy) and trains the drafter on them.

    python train.py --config=configs/tiny_code_drafter.py --workdir=/tmp/tiny_drafter \
        --config.target_path=/tmp/tiny_target/export/target
"""

from dflash_jax.training.trainer import default_config


def get_config():
    c = default_config()
    c.mode = "drafter"
    c.target_path = ""  # required: the exported tiny target
    c.drafter.update(num_layers=2, num_taps=3, block_size=16)
    c.num_anchors = 16  # 16 blocks x 16 rows per sequence: affordable on CPU
    c.gamma = 7.0
    c.data.update(kind="regenerated", max_files=0, seq_len=256, batch_size=8)
    c.regen.update(prompt_source="stdlib", num_prompts=3072, prompt_len=64, max_new_tokens=192,
                   temperature=0.0, batch_size=64)
    c.learning_rate = 1e-3
    c.num_train_steps = 3500
    c.log_every = 10
    c.eval_every = 500
    c.eval_num_prompts = 16
    c.eval_max_new_tokens = 128
    c.checkpoint_every = 500
    return c
