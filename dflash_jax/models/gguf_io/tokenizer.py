"""A GGUF file's tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json),
checked against the vocabulary."""

from __future__ import annotations

import json
from typing import Dict, Optional, Tuple


from dflash_jax.models.gguf_io.common import (
    GGUFError,
    PRE_TOKENIZERS,
    _TOKEN_CONTROL,
    _TOKEN_USER_DEFINED,
)
from dflash_jax.models.gguf_io.reader import (
    _field,
    _int_field,
)


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes (the alphabet of byte-level vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def build_tokenizer(reader):
    """A `tokenizers.Tokenizer` from `tokenizer.ggml.*` (byte-level BPE, `model` "gpt2"): the
    vocabulary and merges as stored, the pre-tokenizer of `tokenizer.ggml.pre`, control tokens
    as special added tokens and user-defined ones as plain added tokens (matched whole), a BOS
    prepended when `add_bos_token`. None (with the reason) for other tokenizer models."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        return None, f"tokenizer model {kind!r} (only byte-level BPE, 'gpt2', is built)"
    tokens = list(_field(reader, "tokenizer.ggml.tokens") or [])
    merges = list(_field(reader, "tokenizer.ggml.merges") or [])
    types = list(_field(reader, "tokenizer.ggml.token_type") or [])
    if not tokens or not merges:
        return None, "no tokenizer.ggml.tokens / merges"
    alphabet = set(_bytes_to_unicode().values())
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)
    tok = Tokenizer(model)
    pre = _field(reader, "tokenizer.ggml.pre") or "default"
    how, pattern = PRE_TOKENIZERS.get(pre, (None, None))
    if how is None:
        return None, f"pre-tokenizer {pre!r} (known: {sorted(PRE_TOKENIZERS)})"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=how != "split")
    if how == "digits+gpt2":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif how == "split":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special, added = [], []
    for t, ty in zip(tokens, types):
        if ty == _TOKEN_CONTROL and set(t) <= alphabet:
            special.append(AddedToken(t, special=True, normalized=False))
        elif ty == _TOKEN_USER_DEFINED:
            added.append(AddedToken(t, special=False, normalized=False))
    tok.add_special_tokens(special)
    tok.add_tokens(added)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A {b} $B", special_tokens=[(b, int(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, None


# Token ids of `tokenizer.ggml.*` (llama.cpp's spelling, "seperator" included).
_TOKEN_ID_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "eot_token_id",
    "eom_token_id",
    "unknown_token_id",
    "padding_token_id",
    "seperator_token_id",
    "cls_token_id",
    "mask_token_id",
)


def check_tokenizer(reader, vocab_rows: int) -> None:
    """The tokenizer metadata checked before anything is derived from it: the token list (no
    more tokens than embedding rows; one type per token), every special token id inside the
    vocabulary, a BOS id when add_bos_token asks for one, and every merge of a byte-level BPE
    two tokens of the vocabulary separated by one space whose concatenation is a token too
    (what Hugging Face tokenizers requires). GGUFError naming the file and the entry."""
    path = reader.dj_path
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is not None and not (
        isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)
    ):
        raise GGUFError(f"{path}: tokenizer.ggml.tokens must be an array of strings")
    tokens = tokens or []
    if len(tokens) > vocab_rows:
        raise GGUFError(
            f"{path}: tokenizer.ggml.tokens holds {len(tokens)} tokens, more than the "
            f"{vocab_rows} rows of token_embd.weight"
        )
    types = _field(reader, "tokenizer.ggml.token_type")
    if tokens and types is not None and (not isinstance(types, list) or len(types) != len(tokens)):
        n = len(types) if isinstance(types, list) else type(types).__name__
        raise GGUFError(
            f"{path}: tokenizer.ggml.token_type holds {n} entries for {len(tokens)} tokens"
        )
    size = len(tokens) or vocab_rows
    where = "tokenizer.ggml.tokens" if tokens else "token_embd.weight's rows"
    for key in _TOKEN_ID_KEYS:
        i = _int_field(reader, f"tokenizer.ggml.{key}", lo=0)
        if i is not None and i >= size:
            raise GGUFError(
                f"{path}: tokenizer.ggml.{key}={i} is outside the vocabulary "
                f"({size} entries in {where})"
            )
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token", False)
    if not isinstance(add_bos, bool):
        raise GGUFError(f"{path}: tokenizer.ggml.add_bos_token must be true or false")
    if add_bos and tokens and _field(reader, "tokenizer.ggml.bos_token_id") is None:
        raise GGUFError(
            f"{path}: tokenizer.ggml.add_bos_token is true but there is no bos_token_id"
        )
    if _field(reader, "tokenizer.ggml.model") != "gpt2" or not tokens:
        return  # no byte-level BPE is built from it (`build_tokenizer` says why)
    merges = _field(reader, "tokenizer.ggml.merges")
    if merges is None:
        return
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise GGUFError(f"{path}: tokenizer.ggml.merges must be an array of strings")
    vocab = set(tokens)
    for i, m in enumerate(merges):
        parts = m.split(" ")
        if len(parts) != 2 or not all(parts):
            raise GGUFError(
                f"{path}: tokenizer.ggml.merges[{i}] = {m[:60]!r} is not two tokens "
                "separated by one space"
            )
        for part in (parts[0], parts[1], parts[0] + parts[1]):
            if part not in vocab:
                raise GGUFError(
                    f"{path}: tokenizer.ggml.merges[{i}] = {m[:60]!r}: {part[:40]!r} is not "
                    "in tokenizer.ggml.tokens"
                )


def tokenizer_files(reader) -> Tuple[Dict[str, dict], Optional[str]]:
    """{file name: JSON object} of the tokenizer files derived from the metadata, and the
    reason the tokenizer itself could not be built (None when it was)."""
    tokens = list(_field(reader, "tokenizer.ggml.tokens") or [])

    def token(key):
        i = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    eos_ids = [
        int(i)
        for i in (
            _field(reader, "tokenizer.ggml.eos_token_id"),
            _field(reader, "tokenizer.ggml.eot_token_id"),
            _field(reader, "tokenizer.ggml.eom_token_id"),
        )
        if i is not None
    ]
    eos_ids = list(dict.fromkeys(eos_ids))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id") or token("eos_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok_cfg["chat_template"] = template
    gen = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("padding_token_id", "pad_token_id")):
        v = _field(reader, f"tokenizer.ggml.{key}")
        if v is not None:
            gen[hf_key] = int(v)
    files = {"tokenizer_config.json": tok_cfg, "generation_config.json": gen}
    try:
        tok, why = build_tokenizer(reader) if tokens else (None, "no tokenizer in the metadata")
    except GGUFError:
        raise
    except Exception as e:  # noqa: BLE001 - what `check_tokenizer` did not foresee: one line
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise GGUFError(f"{reader.dj_path}: the tokenizer cannot be built ({msg})") from None
    if tok is not None:
        files["tokenizer.json"] = json.loads(tok.to_str())
    return files, why
