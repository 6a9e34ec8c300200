"""The tiny code target, fine-tuned against greedy loops (sequence-level unlikelihood).

Stages 1-4 (stages 3-4, not shipped, are in git history: assets/tiny-code/README.md) showed that a better language model does not loop
less: held-out loss fell from 1.13 to 1.00 bits/byte while the share of held-out prompts whose
greedy completion loops rose from 20% to 34%. This stage attacks the loops directly: it
continues the stage-2 export on the library code with, at every step, greedy continuations of
8 training-split prompts decoded by the model being trained, whose tokens inside a repeated
4-gram are pushed down by -log(1 - p) (`dflash_jax.training.unlikelihood`; Welleck et al. 2020),
next to the usual next-token loss on real code. Prompts are the benchmark's kind (code before a
function body, and plain windows), up to 192 tokens, continued for 64 tokens.
About 33 minutes on an otherwise idle 2-core CPU.

Result (benchmarks/results/tiny-code/{target_eval,repetition}.json, the bundled target): no
held-out prompt's greedy completion loops any more (distinct-4-gram median 0.98, mean 0.96; real
code 1.00, 0.97; stage 2: 0.70 and 20% of prompts below 0.5); the price is a less confident model
(1.21 bits/byte against 1.13, mean top-1 probability 0.35 against 0.50), whose text a drafter
predicts less well (block-16 tau 3.10 -> 1.78 on the benchmark).

    python train.py --config=configs/tiny_code/target_unlikelihood.py --workdir=/tmp/tiny_target_ul \\
        --config.target_path=/tmp/tiny_target2/export/target
"""

from configs.tiny_code.target_stage2 import get_config as stage2_config


def get_config():
    c = stage2_config()
    c.target_path = ""  # required: the stage-2 export (its tokenizer.json is reused)
    c.unlikelihood.update(
        weight=1.0,
        batch_size=8,
        prompt_len=192,
        max_new_tokens=64,
        ngram=4,
        prompt_source="mixed",
        num_prompts=8192,
    )
    c.learning_rate = 2e-4
    c.warmup_ratio = 0.03
    c.num_train_steps = 1200
    c.eval_every = 400
    return c
