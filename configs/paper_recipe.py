"""The paper's drafter recipe (DFlash appendix A.1), shared by the per-target configs.

The recipe's hyper-parameters are the defaults (configs/default.py: 5 drafter layers, 5 taps,
512 random anchors, length 3072, AdamW lr 6e-4, cosine schedule with 4% warmup, clip 1.0, no
weight decay, 6 epochs, CE loss on fully masked blocks); this file sets what a real target
needs on top: its path, bfloat16 with the fused Pallas kernel, FSDP over all devices, chunked
logits, batch 16 of one conversation per row, and a slower log/eval/checkpoint cadence. Block
size and gamma depend on the target (16 / 7 for Qwen3, 10 / 5 for Llama-3.1). Data:
prompt/response JSONL whose responses the target regenerated (dflash_jax/training/regenerate.py).

    python train.py --config=configs/paper_recipe.py --workdir=DIR \
        --config.target_path=/path/to/Qwen3-8B --config.data.paths='("/path/regen.jsonl",)'
"""

from configs.default import get_config as default_config


def paper_config(target_path: str, block_size: int, gamma: float):
    c = default_config()
    c.target_path = target_path  # a Hugging Face directory (weights + tokenizer)
    c.dtype = "bfloat16"
    c.attention_impl = "pallas"  # the fused training kernel on TPU / GPU
    c.mesh = "fsdp=-1"  # target, drafter and AdamW moments sharded over all devices
    c.drafter.block_size = block_size
    c.loss_chunk_anchors = 32  # 32 x 16 rows of 151K-vocab logits live at a time, not 512 x 16
    c.gamma = gamma
    c.data.update(
        kind="files", batch_size=16, allow_split=False
    )  # one conversation per row where it fits
    # Regeneration (data.kind="regenerated"): every assistant turn through the chat template,
    # greedy, up to 3072 new tokens per turn (the paper's configs; 4096 for coder targets).
    c.regen.update(max_new_tokens=3072, temperature=0.0, chat_template=True)
    c.log_every = 50
    c.eval_every = 2000
    c.eval_num_prompts = 16
    c.eval_max_new_tokens = 256
    c.checkpoint_every = 1000
    return c


def get_config():
    """The recipe with Qwen3's block size and gamma (16, 7.0); the target is given on the
    command line (--config.target_path)."""
    return paper_config("", block_size=16, gamma=7.0)
