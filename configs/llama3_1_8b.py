"""DFlash drafter for Llama-3.1-8B-Instruct with the paper's hyper-parameters (see configs/paper_recipe.py):
block 10, gamma 5.0.

    python train.py --config=configs/llama3_1_8b.py --workdir=DIR \
        --config.target_path=/path/to/Llama-3.1-8B-Instruct --config.data.paths='("/path/regen.jsonl",)'
"""

from configs.paper_recipe import paper_config


def get_config():
    return paper_config("/path/to/Llama-3.1-8B-Instruct", block_size=10, gamma=5.0)
