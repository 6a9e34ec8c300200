"""The paper's drafter recipe (DFlash appendix A.1), shared by the per-target configs.

5 drafter layers, 5 taps, 512 random anchors, max length 3072, AdamW lr 6e-4 with a cosine
schedule and 4% warmup, global-norm clip 1.0, no weight decay, 6 epochs, CE loss on fully
masked blocks. Block size and gamma depend on the target (16 / 7 for Qwen3, 10 / 5 for
Llama-3.1). Data: prompt/response JSONL whose responses the target regenerated
(dflash_jax/training/regenerate.py).
"""

from dflash_jax.training.trainer import default_config


def paper_config(target_path: str, block_size: int, gamma: float):
    c = default_config()
    c.mode = "drafter"
    c.target_path = target_path  # a Hugging Face directory (weights + tokenizer)
    c.dtype = "bfloat16"
    c.attention_impl = "pallas"  # the fused training kernel on TPU / GPU
    c.mesh = "fsdp=-1"  # target, drafter and AdamW moments sharded over all devices
    c.drafter.update(num_layers=5, num_taps=5, block_size=block_size,
                     param_dtype="float32")  # float32 masters and AdamW moments, bf16 compute
    c.num_anchors = 512
    c.loss_chunk_anchors = 32  # 32 x 16 rows of 151K-vocab logits live at a time, not 512 x 16
    c.gamma = gamma
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
