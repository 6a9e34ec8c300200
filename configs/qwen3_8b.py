"""DFlash drafter for Qwen3-8B with the paper's hyper-parameters (appendix A.1).

5 drafter layers, 5 taps, block 16, gamma 7.0, 512 anchors, max length 3072, AdamW lr 6e-4,
cosine with 4% warmup, clip 1.0, no weight decay, 6 epochs. Data: prompt/response JSONL whose
responses the target regenerated (dflash_jax/training/regenerate.py).

    python train.py --config=configs/qwen3_8b.py --workdir=DIR \
        --config.target_path=/path/to/Qwen3-8B --config.data.paths='("/path/regen.jsonl",)'
"""

from dflash_jax.training.trainer import default_config


def get_config():
    c = default_config()
    c.mode = "drafter"
    c.target_path = "/path/to/Qwen3-8B"  # a Hugging Face directory (weights + tokenizer)
    c.dtype = "bfloat16"
    c.attention_impl = "pallas"  # the fused training kernel on TPU / GPU
    c.drafter.update(num_layers=5, num_taps=5, block_size=16)
    c.num_anchors = 512
    c.gamma = 7.0
    c.loss = "ce"
    c.mask_schedule = "all"
    c.data.update(kind="files", paths=(), seq_len=3072, batch_size=16, num_epochs=6,
                  allow_split=False)  # one conversation per row where it fits
    c.learning_rate = 6e-4
    c.warmup_ratio = 0.04
    c.grad_clip = 1.0
    c.weight_decay = 0.0
    c.log_every = 50
    c.eval_every = 2000
    c.eval_num_prompts = 16
    c.eval_max_new_tokens = 256
    c.checkpoint_every = 1000
    return c
