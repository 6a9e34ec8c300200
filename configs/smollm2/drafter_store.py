"""The SmolLM2-135M DFlash drafter trained on a tap store (issue: training that learns more
per CPU-hour): the target's taps and top-16 next-token distribution computed once per token
and read from disk (`dflash_jax/training/tap_store.py`), the head restricted to the 8,192
most frequent answer tokens (92.6% / 93.5% of the target's MT-Bench / HumanEval answer tokens,
98.7% of the training answers', `benchmarks/results/smollm2/draft_vocab_coverage.md`; 16,384
covers 97.6% / 96.4% but its step is 2.8x stage 5's against 3.4x, `store_step.json`),
documents never split (the store's pieces). Everything else as `configs/smollm2/drafter.py` (rows of 8 x 512, 64 anchors).

    python -m dflash_jax.training.tap_store --target=smollm2-135m-instruct \\
        --responses=runs/smollm2/responses6.jsonl --out=runs/smollm2/store6 \\
        --tap_layers=1,8,14,20,27
    python train.py --config=configs/smollm2/drafter_store.py --workdir=runs/smollm2/stage6 \\
        --config.regen.output=runs/smollm2/responses6.jsonl \\
        --config.data.tap_store=runs/smollm2/store6 \\
        --config.drafter.init_path=assets/smollm2-135m-instruct/drafter

The stages and their figures: benchmarks/results/smollm2/README.md (the ledger).
"""

from configs.smollm2.drafter import get_config as base_config


def get_config():
    c = base_config()
    c.data.allow_split = False
    c.drafter.draft_vocab_size = 8192
    c.loss = "ce"
    return c
