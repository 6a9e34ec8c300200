"""Pretrain a small Qwen3-architecture code target (~6M params) on the Python stdlib.

A byte-level BPE (4096 tokens) is trained on the corpus first (workdir/tokenizer). 3600 steps of
8x256 tokens (~7.4M tokens, ~2.5 epochs of the ~2.9M-token corpus) take about 40 minutes on an
otherwise idle 2-core CPU (~3,300 tokens/s). The result is exported as a Hugging Face directory
(workdir/export/target, tokenizer.json beside it). configs/tiny_code/target_stage2.py continues
it; the bundled target is stage 2 fine-tuned by configs/tiny_code/target_unlikelihood.py.

    python train.py --config=configs/tiny_code/target.py --workdir=/tmp/tiny_target
"""

from configs.default import get_config as default_config


def get_config():
    c = default_config()
    c.mode = "target"
    c.tokenizer_vocab_size = 4096
    c.target_model.update(
        vocab_size=0,
        hidden_size=256,
        intermediate_size=768,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    c.data.update(kind="stdlib", max_files=0, seq_len=256, batch_size=8, num_epochs=3)
    c.learning_rate = 1.5e-3
    c.b2 = 0.98
    c.weight_decay = 0.01
    c.num_train_steps = 3600
    c.log_every = 10
    c.eval_every = 400
    c.eval_batches = 4
    c.checkpoint_every = 200
    return c
