"""A block-16 DFlash drafter for the tiny code target, on the target's own responses.

First run configs/tiny_code/target.py; this config then regenerates greedy responses with that
target (workdir/regenerated.jsonl) to 16,384 prompts from the training files, half random
128-token windows and half code-completion prompts (context, a def header and two body lines, as
in the benchmark but from other files), and trains the drafter on them (~3 epochs). About 15
minutes of regeneration and 40 of training on an otherwise idle 2-core CPU. The bundled drafter
is this one fine-tuned through stages 2-4 (configs/tiny_code/drafter_stage4.py).

    python train.py --config=configs/tiny_code/drafter.py --workdir=/tmp/tiny_drafter \
        --config.target_path=/tmp/tiny_target/export/target
"""

from configs.default import get_config as default_config


def get_config():
    c = default_config()
    c.mode = "drafter"
    c.target_path = ""  # required: the exported tiny target
    c.drafter.update(num_layers=2, num_taps=3, block_size=16)
    c.num_anchors = 16  # 16 blocks x 16 rows per sequence: affordable on CPU
    c.gamma = 7.0
    c.data.update(kind="regenerated", max_files=0, seq_len=256, batch_size=8)
    c.regen.update(
        prompt_source="mixed",
        num_prompts=16384,
        prompt_len=128,
        max_new_tokens=128,
        temperature=0.0,
        batch_size=64,
        function_body_lines=2,
        functions_per_file=200,
    )
    c.learning_rate = 1e-3
    c.num_train_steps = 6000
    c.log_every = 10
    c.eval_every = 1000
    c.eval_num_prompts = 16
    c.eval_max_new_tokens = 64
    c.checkpoint_every = 500
    return c
