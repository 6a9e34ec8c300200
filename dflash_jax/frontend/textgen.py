"""What infer.py, the notebook and the benchmarks share around `generate`: a model directory's
text side (tokenizer, stop ids, vocabulary size; prompts encoded with them), and DFlash timed
against autoregressive decoding on the same prompts after an untimed warm-up.

    text = textgen.load_text("assets/tiny-code/target")
    prompts = text.encode([{"prompt": "def fib(n):"}])
    c = textgen.compare(target, drafter, prompts, max_new_tokens=64)  # stop ids: the target's
    c.identical, c.speedup, c.spec.tau   # c.spec / c.ar: GenerationResults of the timed runs
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, List, Optional, Sequence

from dflash_jax.decoding.generation import Generator
from dflash_jax.decoding.request import GenerationResult, Settings
from dflash_jax.support import checks

# `generate` arguments that only a drafter uses: left out of the autoregressive runs.
DRAFTER_ONLY = (
    "block_size",
    "denoise_steps",
    "confidence_threshold",
    "tree_budget",
    "denoise_schedule",
    "remask",
)


def stop_token_ids(model_dir: Optional[str], tokenizer=None) -> List[int]:
    """The tokenizer's eos and the directory's generation_config.json eos_token_id(s). A
    generation_config.json that is not a JSON object, or whose eos_token_id is not a token id
    (a non-negative integer), a list of them or null, is a ValueError naming the file."""
    ids = set()
    if tokenizer is not None:
        ids.add(tokenizer.eos_id)
    gen_cfg = os.path.join(model_dir, "generation_config.json") if model_dir else None
    if gen_cfg and os.path.exists(gen_cfg):
        cfg = checks.json_object_file(gen_cfg)
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        for i in eos:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(
                    f"{gen_cfg}: eos_token_id must be a token id (a non-negative integer) or a "
                    f"list of them, got {json.dumps(cfg.get('eos_token_id'))[:60]}"
                )
        ids.update(eos)
    return sorted(i for i in ids if i is not None)


@dataclasses.dataclass
class ModelText:
    """A model directory's text side: `tokenizer` (None without tokenizer.json), the stop ids
    `generate` should get, and the vocabulary size (for checking token-id prompts)."""

    path: str
    tokenizer: object
    stop_token_ids: List[int]
    vocab_size: Optional[int]
    config: object = None  # the checked ModelConfig of config.json (float32)

    def encode(self, items, chat_template: bool = True, labels=None) -> List[List[int]]:
        """Prompt items ({"prompt"|"messages"|"ids": ...}, `prompting.check_prompt_item`) as
        token-id lists, through the chat template when the tokenizer has one."""
        from dflash_jax.data import prompting

        return prompting.encode_prompts(
            items,
            self.tokenizer,
            self.path,
            chat_template,
            vocab_size=self.vocab_size,
            labels=labels,
        )


def load_text(model_dir: str) -> ModelText:
    """Reads `model_dir`'s config.json (every field checked, `ModelConfig.from_hf`),
    tokenizer.json and generation_config.json (no weights), so that a bad model directory
    and bad prompts are refused before a model is loaded."""
    from dflash_jax.models.checkpoint import read_target_config

    cfg = read_target_config(model_dir)
    tok = _tokenizer(model_dir)
    return ModelText(
        path=model_dir,
        tokenizer=tok,
        stop_token_ids=stop_token_ids(model_dir, tok),
        vocab_size=cfg.vocab_size,
        config=cfg,
    )


@dataclasses.dataclass
class Comparison:
    """spec: the timed run with the drafter (autoregressive when there is none); ar: the timed
    autoregressive run on the same prompts, or None."""

    spec: GenerationResult
    ar: Optional[GenerationResult] = None

    @property
    def identical(self) -> Optional[bool]:
        return None if self.ar is None else self.spec.tokens == self.ar.tokens

    @property
    def speedup(self) -> Optional[float]:
        """Decode tokens/s with the drafter over autoregressive decode tokens/s."""
        if self.ar is None:
            return None
        return self.spec.stats["decode_tokens_per_s"] / max(
            self.ar.stats["decode_tokens_per_s"], 1e-9
        )


def ar_kwargs(gen_kw: dict) -> dict:
    """`gen_kw` without the drafter-only arguments."""
    return {k: v for k, v in gen_kw.items() if k not in DRAFTER_ONLY}


# `generate` keywords that are neither a setting nor a call's: how a `Generator` is built.
GENERATOR_OPTIONS = ("mesh", "attention_impl")


@dataclasses.dataclass(frozen=True)
class Generators:
    """The `Generator` with the drafter and (compare_ar) the autoregressive one on the same
    settings less the drafter-only ones, each checked once (`build`) and run on many batches
    (`run`, `warm_up`): what `compare` and the batch runner call per batch."""

    spec: Generator
    ar: Optional[Generator] = None

    @classmethod
    def build(cls, target, drafter, *, compare_ar: bool = False, **gen_kw) -> "Generators":
        """gen_kw: `generate`'s settings (`Settings`' fields), mesh and attention_impl; the
        drafter-only settings are left out of the autoregressive one."""
        opts = {k: gen_kw.pop(k) for k in GENERATOR_OPTIONS if k in gen_kw}
        spec = Generator(target, drafter, Settings.of(gen_kw), **opts)
        ar = None
        if compare_ar and drafter is not None:
            ar = Generator(target, None, Settings.of(ar_kwargs(gen_kw)), **opts)
        return cls(spec=spec, ar=ar)

    def warm_up(self, prompts, max_new_tokens, seed=None) -> GenerationResult:
        """Each generator run once untimed (compiles its programs, first-run allocations).
        Returns the first run's result (its stats["compile_s"] is the compile time)."""
        res = self.spec(prompts, max_new_tokens, seed=seed)
        if self.ar is not None:
            self.ar(prompts, max_new_tokens, seed=seed)
        return res

    def run(
        self,
        prompts,
        max_new_tokens,
        *,
        seed=None,
        warmup: bool = True,
        stream_callback: Optional[Callable[[List[List[int]]], None]] = None,
    ) -> Comparison:
        """`compare`'s runs: the streamed one, the warm-up, then the timed ones."""
        if stream_callback is not None:
            self.spec(prompts, max_new_tokens, seed=seed, stream_callback=stream_callback)
        if warmup:
            self.warm_up(prompts, max_new_tokens, seed=seed)
        spec = self.spec(prompts, max_new_tokens, seed=seed)
        ar = None if self.ar is None else self.ar(prompts, max_new_tokens, seed=seed)
        return Comparison(spec=spec, ar=ar)


def warm_up(
    target, drafter, prompts: Sequence[Sequence[int]], *, compare_ar: bool = False, **gen_kw
) -> GenerationResult:
    """Runs `generate` once untimed (compiles the programs, first-run allocations), and with
    `compare_ar` and a drafter the autoregressive program too. Returns the first run's result
    (its stats["compile_s"] is the compile time)."""
    max_new_tokens = gen_kw.pop("max_new_tokens")
    gens = Generators.build(target, drafter, compare_ar=compare_ar, **gen_kw)
    return gens.warm_up(prompts, max_new_tokens)


def compare(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    compare_ar: bool = True,
    warmup: bool = True,
    stream_callback: Optional[Callable[[List[List[int]]], None]] = None,
    stop_token_ids: Optional[Sequence[int]] = None,
    **gen_kw,
) -> Comparison:
    """`generate` with `drafter` and (compare_ar) without it on the same prompts, timed after
    an untimed `warm_up` (warmup=False: the programs are known to be compiled).

    stop_token_ids: default (None) the target directory's (`stop_token_ids(target.path)`).
    stream_callback: an extra, untimed run first that calls it with each step's commits
    (`generate`'s stream_callback), e.g. to print a completion as it is produced.
    gen_kw: the other `generate` arguments; the drafter-only ones are dropped for the
    autoregressive runs.
    """
    if stop_token_ids is None:
        stop_token_ids = _target_stop_ids(target)
    max_new_tokens = gen_kw.pop("max_new_tokens")
    gens = Generators.build(
        target, drafter, compare_ar=compare_ar, stop_token_ids=stop_token_ids, **gen_kw
    )
    return gens.run(prompts, max_new_tokens, warmup=warmup, stream_callback=stream_callback)


def _tokenizer(model_dir: str):
    if not os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return None
    from dflash_jax.data.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


def _target_stop_ids(target) -> List[int]:
    path = getattr(target, "path", None)
    return stop_token_ids(path, _tokenizer(path)) if path else []
