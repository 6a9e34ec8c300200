"""An EAGLE-3 drafter for SmolLM2-135M-Instruct (the paper's comparison on the same
target and data): one Llama layer at the target's width over EAGLE-3's default taps (target
layers 1, 14, 26), the target's embedding shared, its own LM head over the 16,384 most frequent
answer tokens of the training data, trained with training-time test (7 unrolled drafting
steps, step j weighted 0.8^j) on the same regenerated responses as the DFlash drafters
(configs/smollm2/drafter.py), rows of 8 x 512 tokens:

    python train.py --config=configs/smollm2/drafter_eagle3.py --workdir=runs/smollm2/eagle3 \\
        --config.regen.output=runs/smollm2/responses.jsonl

Time-sliced like the DFlash drafter (`--config.stop_at_step=N`, resumable from the workdir's
checkpoints); it is measured beside the DFlash drafters by benchmarks/drafter_grid.py.
"""

from configs.smollm2.drafter import get_config as drafter_config


def get_config():
    c = drafter_config()
    c.drafter.update(kind="eagle3", num_layers=1, num_taps=3, target_layer_ids=())
    c.drafter.eagle3.update(draft_vocab_size=16384, ttt_steps=7, ttt_decay=0.8)
    return c
