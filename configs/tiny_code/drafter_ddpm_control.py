"""The control of configs/tiny_code/drafter_ddpm.py: the same run (init, data, seed, steps,
learning rate) with today's fully masked objective (mask_schedule "all"):

    python train.py --config=configs/tiny_code/drafter_ddpm_control.py \\
        --workdir=/work/exp31/control --config.target_path=assets/tiny-code/target \\
        --config.drafter.init_path=assets/tiny-code/drafter \\
        --config.regen.output=/work/exp31/regen_s2.jsonl
"""

from configs.tiny_code.drafter_ddpm import get_config as ddpm_config


def get_config():
    c = ddpm_config()
    c.mask_schedule = "all"
    return c
