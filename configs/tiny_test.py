"""A seconds-long drafter run on a random peaky target and its own greedy outputs (tests, smoke).

python train.py --config=configs/tiny_test.py --workdir=/tmp/dflash_tiny
"""

from configs.default import get_config as default_config
from dflash_jax.models.tiny import tiny_fields


def get_config():
    c = default_config()
    c.mode = "drafter"
    c.target_model.update(
        **tiny_fields(),  # the tiny factory's dense target (dflash_jax/models/tiny.py)
        max_position_embeddings=512,
        tie_word_embeddings=False,
        init_std=0.3,
        attn_out_scale=0.02,
        init_seed=1,
    )
    c.drafter.update(num_layers=1, num_taps=2, block_size=8, target_layer_ids=(0, 1))
    c.num_anchors = 16
    c.gamma = 4.0
    c.data.update(kind="regenerated", seq_len=64, batch_size=8)
    c.regen.update(
        prompt_source="random",
        num_prompts=160,
        prompt_len=8,
        max_new_tokens=48,
        batch_size=32,
        holdout_fraction=0.05,
    )
    c.learning_rate = 3e-3
    c.num_train_steps = 150
    c.log_every = 25
    c.eval_every = 150
    c.eval_batches = 1
    c.eval_num_prompts = 8
    c.eval_max_new_tokens = 48
    c.checkpoint_every = 50
    return c
