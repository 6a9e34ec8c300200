"""The multi-step denoising ("DDPM") drafter: the bundled drafter fine-tuned on the
"mdlm" mask schedule (dflash_jax.training.masks.mask_draw): half of the blocks fully masked as
today, half masked at a ratio t ~ U(0,1] with the loss on the masked positions weighted 1/t.

1500 steps from the bundled drafter at the stage-4 learning rate, on 8192 fresh responses of the
bundled target (the stage-4 recipe's prompts with seed 2). Its control, the same run with the
fully masked objective, is configs/tiny_code/drafter_ddpm_control.py; the two ran one after the
other on the 2-core CPU (benchmarks/results/ddpm/README.md has the measurement):

    python train.py --config=configs/tiny_code/drafter_stage4.py --workdir=/work/exp31/regen_s2 \\
        --config.target_path=assets/tiny-code/target --config.seed=2 \\
        --config.drafter.init_path=assets/tiny-code/drafter \\
        --config.regen.output=/work/exp31/regen_s2.jsonl --config.regen.only=True \\
        --config.regen.num_prompts=8192
    python train.py --config=configs/tiny_code/drafter_ddpm.py --workdir=/work/exp31/ddpm \\
        --config.target_path=assets/tiny-code/target \\
        --config.drafter.init_path=assets/tiny-code/drafter \\
        --config.regen.output=/work/exp31/regen_s2.jsonl
"""

from configs.tiny_code.drafter_stage4 import get_config as stage4_config


def get_config():
    c = stage4_config()
    c.target_path = ""  # required: the bundled target
    c.drafter.init_path = ""  # required: the bundled drafter
    c.regen.output = ""  # required: the 8192 responses
    c.mask_schedule = "mdlm"
    c.mask_full_fraction = 0.5
    c.num_train_steps = 1500
    c.eval_every = 750
    c.checkpoint_every = 500
    return c
