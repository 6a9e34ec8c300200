"""DFlash drafter for Qwen3-Coder-30B-A3B-Instruct (a Qwen3-MoE target: 128 experts, top 8) with the paper's
hyper-parameters (see configs/paper_recipe.py): block 16, gamma 7.0. The target pass is the
taps-only forward of the frozen MoE target (dropless routing, `dflash_jax/models/moe.py`).

    python train.py --config=configs/qwen3_coder_30b_a3b.py --workdir=DIR \
        --config.target_path=/path/to/Qwen3-Coder-30B-A3B-Instruct --config.data.paths='("/path/regen.jsonl",)'
"""

from configs.paper_recipe import paper_config


def get_config():
    return paper_config("/path/to/Qwen3-Coder-30B-A3B-Instruct", block_size=16, gamma=7.0)
