"""Stage 4 of the tiny code target: back to the library code after the test suites.

Stage 3 (configs/tiny_code_target_stage3.py, library code + the stdlib's test suites) lowered the
held-out loss on library code (1.13 -> 1.06 bits/byte) but made greedy completions loop more
(prompts whose completion has under half distinct 4-grams: 20% -> 34%; test code is repetitive
by nature). This stage fine-tunes the stage-3 export on the library code alone, at a low peak
learning rate for ~1.1 passes, to keep the better model and take back the library's style.
About 17 minutes on an otherwise idle 2-core CPU.

Result (benchmarks/results/tiny-code/*_stage4.json): the best language model of the four stages
(held-out library code 0.997 bits/byte, mean top-1 probability 0.545; stage 2: 1.13, 0.50), but
greedy completions loop as often as after stage 3 (34% of prompts below 0.5 distinct 4-grams;
stage 2: 20%), so it was not shipped (the bundled target is stage 2 + unlikelihood).

    python train.py --config=configs/tiny_code_target_stage4.py --workdir=/tmp/tiny_target4 \
        --config.target_path=/tmp/tiny_target3/export/target
"""

from configs.tiny_code_target_stage2 import get_config as stage2_config


def get_config():
    c = stage2_config()
    c.target_path = ""  # required: the stage-3 export (its tokenizer.json is reused)
    c.data.update(num_epochs=2)  # library code only (stage 2's corpus)
    c.learning_rate = 3e-4
    c.warmup_ratio = 0.03
    c.num_train_steps = 1600
    c.eval_every = 400
    return c
