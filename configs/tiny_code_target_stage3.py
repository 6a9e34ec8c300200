"""Stage 3 of the tiny code target: continued pretraining on a larger corpus.

After stage 2 (configs/tiny_code_target_stage2.py) the model has seen the ~2.9M-token library
code ~6 times: training loss ~2.7 nats/token against ~3.6 held out, and the held-out loss had
almost stopped falling, while greedy completions still loop on a fifth of the benchmark's
held-out prompts. This stage adds the stdlib's own test suites (``data.include_tests``, ~1.6x
more code; splits go by a hash of each path, so the benchmark's held-out library files stay
held out) and restarts warmup + cosine from the stage-2 export, about 1.3 passes of the larger
corpus. About 55 minutes on an otherwise idle 2-core CPU.

Result (benchmarks/results/tiny-code/*_stage3.json): held-out library code 1.13 -> 1.06
bits/byte, but greedy completions below 0.5 distinct 4-grams 20% -> 34%: the test suites'
repetitive style carries over. configs/tiny_code_target_stage4.py takes it back.

    python train.py --config=configs/tiny_code_target_stage3.py --workdir=/tmp/tiny_target3 \
        --config.target_path=/tmp/tiny_target2/export/target
"""

from configs.tiny_code_target_stage2 import get_config as stage2_config


def get_config():
    c = stage2_config()
    c.target_path = ""  # required: the stage-2 export (its tokenizer.json is reused)
    c.data.update(include_tests=True, num_epochs=2)
    c.learning_rate = 8e-4  # warmup, weight decay, steps and eval cadence as in stage 2
    return c
