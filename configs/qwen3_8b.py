"""DFlash drafter for Qwen3-8B with the paper's hyper-parameters (see configs/paper_recipe.py):
block 16, gamma 7.0.

    python train.py --config=configs/qwen3_8b.py --workdir=DIR \
        --config.target_path=/path/to/Qwen3-8B --config.data.paths='("/path/regen.jsonl",)'
"""

from configs.paper_recipe import paper_config


def get_config():
    return paper_config("/path/to/Qwen3-8B", block_size=16, gamma=7.0)
