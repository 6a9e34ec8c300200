"""Small random GGUF files laid out as llama.cpp's converter lays them out (for tests/test_gguf.py).

`write_gguf(path, arch, types)`: a 2-layer model (hidden 256, 4 heads / 2 KV heads, head_dim 64 for llama, 128 for qwen3)
with a byte-level BPE tokenizer (the 256 byte symbols, merges of frequent pairs of a small
corpus, ChatML control tokens) and a ChatML template. llama: Q/K rows permuted the way the
converter permutes them (stated below in NumPy), an untied `output.weight`; qwen3: QK-norm, tied
head (no `output.weight`). `types` maps a tensor kind (token_embd, attn_q, ..., output) to a
GGML type name; K-quant blocks (Q4_K, Q6_K) are built by hand: random bytes with sane scales.
"""

from __future__ import annotations

import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 256, 4, 2, 64, 512, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = (
    "the quick brown fox jumps over the lazy dog. def add(a, b): return a + b\n"
    "numbers 12345 and 67890; the end of the line is here. hello world, hello there!\n"
)


def byte_symbols():
    """GPT-2's printable spelling of the 256 bytes (a NumPy-free statement of the rule)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def tiny_bpe(n_merges: int = 40):
    """(tokens, merges): the 256 byte symbols, `n_merges` merges learned greedily on CORPUS
    (within words, GPT-2 style), then the specials."""
    sym = byte_symbols()
    words = [[sym[b] for b in (" " + w).encode()] for w in CORPUS.split()]
    tokens = [sym[b] for b in range(256)]
    merges = []
    for _ in range(n_merges):
        counts = {}
        for w in words:
            for a, b in zip(w, w[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        best = max(counts, key=lambda p: (counts[p], p))
        merges.append(f"{best[0]} {best[1]}")
        tokens.append(best[0] + best[1])
        new_words = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words.append(out)
        words = new_words
    return tokens + SPECIALS, merges


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: rows [head, 2, d/2] (the two rotary halves) stored as [head, d/2, 2]."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _kquant_blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """Random Q4_K (144-byte) or Q6_K (210-byte) blocks of 256 values with f16 scales set."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % block == 0
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin (f16) lead the block
        d = rng.uniform(1e-4, 4e-4, size=(rows, cols // block)).astype(np.float16)
        m = rng.uniform(0, 2e-3, size=(rows, cols // block)).astype(np.float16)
        data[..., 0:2] = d.view(np.uint8).reshape(rows, cols // block, 2)
        data[..., 2:4] = m.view(np.uint8).reshape(rows, cols // block, 2)
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], d (f16) last
        d = rng.uniform(2e-5, 6e-5, size=(rows, cols // block)).astype(np.float16)
        data[..., 208:210] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def write_gguf(path, arch: str, types: dict, seed: int = 0, tokenizer: bool = True) -> dict:
    """Writes the file; returns {gguf tensor name: float32 array before quantization, in HF
    row order} for the tensors that were given as floats (K-quant ones are bytes only)."""
    import gguf

    rng = np.random.default_rng(seed)
    Q = gguf.GGMLQuantizationType
    # qwen3: head_dim 128 != hidden / heads (read from attention.key_length; transformers'
    # GGUF loader takes Qwen3's default, 128, so the file says the same)
    head_dim = HEAD_DIM if arch == "llama" else 128
    tokens, merges = tiny_bpe()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1e6)
    w.add_vocab_size(vocab)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
        w.add_token_list(tokens)
        w.add_token_types([1] * (vocab - len(SPECIALS)) + [3] * len(SPECIALS))
        w.add_token_merges(merges)
        w.add_bos_token_id(vocab - 2)
        w.add_eos_token_id(vocab - 1)
        w.add_pad_token_id(vocab - 3)
        w.add_add_bos_token(False)
        w.add_chat_template(TEMPLATE)
    floats = {}

    def tensor(name, kind, arr_or_shape, permute_heads=None):
        qtype = Q[types.get(kind, "F32")]
        if qtype in (Q.Q4_K, Q.Q6_K):
            rows, cols = arr_or_shape
            w.add_tensor(name, _kquant_blocks(rng, rows, cols, qtype), raw_dtype=qtype)
            return
        arr = np.asarray(arr_or_shape, np.float32)
        floats[name] = arr
        if permute_heads is not None:
            arr = converter_permute(arr, permute_heads)
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        elif qtype == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    def normal(*shape, std=0.05):
        return rng.normal(0, std, size=shape).astype(np.float32)

    def matrix(kind, rows, cols):
        return (rows, cols) if types.get(kind) in ("Q4_K", "Q6_K") else normal(rows, cols)

    tensor("token_embd.weight", "token_embd", normal(vocab, HIDDEN, std=0.5))
    for i in range(LAYERS):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", "norm", 1 + normal(HIDDEN, std=0.1))
        tensor(p + "ffn_norm.weight", "norm", 1 + normal(HIDDEN, std=0.1))
        heads = (HEADS, KV_HEADS) if arch == "llama" else (None, None)
        tensor(p + "attn_q.weight", "attn_q", normal(HEADS * head_dim, HIDDEN), heads[0])
        tensor(p + "attn_k.weight", "attn_k", normal(KV_HEADS * head_dim, HIDDEN), heads[1])
        tensor(p + "attn_v.weight", "attn_v", matrix("attn_v", KV_HEADS * head_dim, HIDDEN))
        tensor(
            p + "attn_output.weight", "attn_output", matrix("attn_output", HIDDEN, HEADS * head_dim)
        )
        if arch == "qwen3":
            tensor(p + "attn_q_norm.weight", "norm", 1 + normal(head_dim, std=0.1))
            tensor(p + "attn_k_norm.weight", "norm", 1 + normal(head_dim, std=0.1))
        tensor(p + "ffn_gate.weight", "ffn_gate", matrix("ffn_gate", FFN, HIDDEN))
        tensor(p + "ffn_up.weight", "ffn_up", matrix("ffn_up", FFN, HIDDEN))
        tensor(p + "ffn_down.weight", "ffn_down", matrix("ffn_down", HIDDEN, FFN))
    tensor("output_norm.weight", "norm", 1 + normal(HIDDEN, std=0.1))
    if arch == "llama":
        tensor("output.weight", "output", matrix("output", vocab, HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return floats
