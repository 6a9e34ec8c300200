"""Tokenizers built on the Hugging Face ``tokenizers`` library.

* :func:`train_bpe_tokenizer` trains a byte-level BPE on a text corpus (for the
  small targets trained in this project) with the special tokens
  ``<|endoftext|>`` (eos and pad) and ``<|mask|>`` (the DFlash mask token),
  and saves ``tokenizer.json`` plus a minimal ``tokenizer_config.json``.
* :func:`load_tokenizer` loads the ``tokenizer.json`` of an existing model
  directory and finds its eos / pad / mask tokens from the usual config files.

Both return a :class:`TextTokenizer`.  Byte-level BPE with no normalizer
round-trips any text exactly: ``decode(encode(x)) == x``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "EOS_TOKEN",
    "MASK_TOKEN",
    "TextTokenizer",
    "load_tokenizer",
    "train_bpe_tokenizer",
]

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"

# Tried in order when a model directory names no eos token.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|im_end|>", "<eos>", "<|end_of_text|>")
_MASK_CANDIDATES = ("<|mask|>", "<mask>", "[MASK]")


class TextTokenizer:
    """Thin wrapper over a ``tokenizers.Tokenizer`` with the ids DFlash needs.

    Attributes: ``eos_id`` (int), ``pad_id`` (int; defaults to ``eos_id``),
    ``mask_id`` (int or ``None``), ``vocab_size`` (including added tokens).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_token: str,
        pad_token: str | None = None,
        mask_token: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.eos_token = eos_token
        self.pad_token = pad_token or eos_token
        self.mask_token = mask_token
        self.eos_id = self._require_id(self.eos_token)
        self.pad_id = self._require_id(self.pad_token)
        self.mask_id = None if mask_token is None else self._require_id(mask_token)

    def _require_id(self, token: str) -> int:
        tid = self.tokenizer.token_to_id(token)
        if tid is None:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return int(tid)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added/special tokens included."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS unless ``add_special_tokens``)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = False
    ) -> list[list[int]]:
        """``encode`` for many texts at once (parallel in Rust)."""
        encs = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encs]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are kept unless ``skip_special_tokens``."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self.tokenizer.id_to_token(int(idx))

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(d / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "bos_token": None,
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000_000,
        }
        if self.mask_token is not None:
            config["mask_token"] = self.mask_token
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return d

    def __repr__(self) -> str:
        return (
            f"TextTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
            f"pad_id={self.pad_id}, mask_id={self.mask_id})"
        )


def train_bpe_tokenizer(
    texts: Iterable[str],
    out_dir: str | os.PathLike | None = None,
    *,
    vocab_size: int = 4096,
    min_frequency: int = 2,
    extra_special_tokens: Sequence[str] = (),
    show_progress: bool = False,
    total: int | None = None,
) -> TextTokenizer:
    """Train a byte-level BPE on ``texts``; save it to ``out_dir`` if given.

    Special tokens get the first ids: ``<|endoftext|>`` = 0 (eos and pad),
    ``<|mask|>`` = 1, then ``extra_special_tokens``.  The 256 byte symbols are
    always in the vocabulary, so every string is encodable and round-trips
    exactly (no normalizer, no prefix space).

    ``total``: the number of texts, for the progress bar's ETA (default ``len(texts)`` when it
    has one). The bar (``dflash_jax.support.console.progress``) counts texts read; ``show_progress``
    adds the tokenizers library's own bars.
    """
    specials = [EOS_TOKEN, MASK_TOKEN] + [t for t in extra_special_tokens]
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size must be >= {256 + len(specials)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    from dflash_jax.support import console

    if total is None and hasattr(texts, "__len__"):
        total = len(texts)
    with console.progress(texts, total=total, desc="tokenizer", unit="text") as bar:
        tok.train_from_iterator(bar, trainer=trainer)
    wrapped = TextTokenizer(tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, mask_token=MASK_TOKEN)
    if out_dir is not None:
        wrapped.save(out_dir)
    return wrapped


def _token_content(value: Any) -> str | None:
    """A token as written in HF configs: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def load_tokenizer(
    model_dir: str | os.PathLike,
    *,
    eos_token: str | None = None,
    pad_token: str | None = None,
    mask_token: str | None = None,
) -> TextTokenizer:
    """Load ``model_dir/tokenizer.json`` and find its special tokens.

    eos / pad / mask come from the arguments, else ``tokenizer_config.json``,
    ``special_tokens_map.json``, then ``eos_token_id`` / ``pad_token_id`` in
    ``generation_config.json`` / ``config.json`` (an id list uses its first
    entry), then well-known token strings (``<|endoftext|>``, ``</s>``, ...
    for eos; ``<|mask|>``, ``<mask>``, ``[MASK]`` for mask).  pad falls back
    to eos; mask is ``None`` when none exists.
    """
    d = Path(model_dir)
    path = d / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {d}")
    tok = Tokenizer.from_file(str(path))
    tok_cfg = _read_json(d / "tokenizer_config.json")
    st_map = _read_json(d / "special_tokens_map.json")
    model_cfgs = [_read_json(d / "generation_config.json"), _read_json(d / "config.json")]

    def from_configs(key: str) -> str | None:
        for cfg in (tok_cfg, st_map):
            content = _token_content(cfg.get(key))
            if content is not None and tok.token_to_id(content) is not None:
                return content
        for cfg in model_cfgs:
            tid = cfg.get(f"{key}_id")
            if isinstance(tid, list):
                tid = tid[0] if tid else None
            if isinstance(tid, int):
                token = tok.id_to_token(tid)
                if token is not None:
                    return token
        return None

    def first_present(candidates: Sequence[str]) -> str | None:
        return next((t for t in candidates if tok.token_to_id(t) is not None), None)

    eos = eos_token or from_configs("eos_token") or first_present(_EOS_CANDIDATES)
    if eos is None:
        raise ValueError(f"cannot determine the eos token of {d}; pass eos_token=")
    pad = pad_token or from_configs("pad_token") or eos
    mask = mask_token or from_configs("mask_token") or first_present(_MASK_CANDIDATES)
    return TextTokenizer(tok, eos_token=eos, pad_token=pad, mask_token=mask)
