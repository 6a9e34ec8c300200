"""Continued pretraining of the tiny code target (stage 2 of configs/tiny_code/target.py).

Stage 1 (3600 steps, ~2.5 epochs) leaves a 5.8M-param model whose greedy completions loop on a
third of the benchmark's held-out prompts (`benchmarks/repetition.py`). This stage restarts the
schedule from the stage-1 export (same tokenizer, fresh AdamW state, warmup then cosine to zero
from a lower peak) for ~3.4 more epochs of the same corpus, with a little more weight decay
against the repeated epochs. About 55 minutes on an otherwise idle 2-core CPU.

    python train.py --config=configs/tiny_code/target_stage2.py --workdir=/tmp/tiny_target2 \
        --config.target_path=/tmp/tiny_target/export/target
"""

from configs.tiny_code.target import get_config as stage1_config


def get_config():
    c = stage1_config()
    c.target_path = ""  # required: the stage-1 export (its tokenizer.json is reused)
    c.data.update(num_epochs=4)
    c.learning_rate = 1e-3
    c.warmup_ratio = 0.02
    c.weight_decay = 0.05
    c.num_train_steps = 4800
    c.eval_every = 800
    return c
