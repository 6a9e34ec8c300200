"""Prompt pools: every prompt that is cut from a corpus rather than given by a user.

* `code_prompts`: (prompt, reference) continuation pairs cut from Python files (context, a def
  header and its first body lines; the reference is the lines that follow), and
  `stdlib_prompts`: those of the held-out stdlib files, the benchmarks' prompts
  (`benchmark_prompts` adds the token ids and the `--prompt_file` alternative).
* `encode_code_prompt`: a code-completion prompt's token ids, trailing whitespace cut.
* `window_prompts`, `function_prompts`, `prompt_pool`: the trainer's prompts, cut from the
  *training* documents: random windows, code-completion prompts, or a mix (responses to
  regenerate, unlikelihood continuations).

User prompts (text, chat messages, JSONL files) are parsed by `dflash_jax.data.prompting`.
"""

from __future__ import annotations

import ast
import os
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from .builders import _DEFAULT_VALIDATION_PERCENT, build_python_stdlib, decode_example, load_split

__all__ = [
    "BENCHMARK_PROMPTS",
    "benchmark_prompts",
    "code_prompts",
    "encode_code_prompt",
    "function_prompts",
    "prompt_pool",
    "stdlib_prompts",
    "window_prompts",
]

# The benchmarks' code-completion prompts (bench_dflash, bf16_divergence, repetition): up to 50
# functions per held-out file, each cut after its first two body lines.
BENCHMARK_PROMPTS = dict(max_per_file=50, prompt_body_lines=2, reference_lines=4)


# ----------------------------------------------------------------------------
# Code-completion prompts cut from Python files
# ----------------------------------------------------------------------------


def _split_lines(text: str) -> list[str]:
    """Split on ``\\n`` only (like ``ast`` line numbers), keeping line ends."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


def code_prompts(
    examples: Iterable[dict[str, Any]],
    *,
    prompt_body_lines: int = 4,
    reference_lines: int = 8,
    context_lines: int | None = 40,
    max_per_file: int = 2,
    max_prompts: int | None = None,
) -> list[dict[str, Any]]:
    """Cut Python files into ``(prompt, reference)`` continuation pairs.

    For each function (in source order) whose body has at least
    ``prompt_body_lines + reference_lines`` lines, the prompt is up to
    ``context_lines`` lines before the function (``None``: the whole file
    before it), its decorators and ``def`` header, and the first
    ``prompt_body_lines`` lines of its body; the reference is the next
    ``reference_lines`` lines.  ``prompt + reference`` is always a verbatim
    slice of the file.  Files are taken in sorted path order, at most
    ``max_per_file`` functions each.  Returns dicts with ``prompt``,
    ``reference``, ``path`` and ``lineno`` (1-based line of the reference).
    Files that do not parse are skipped.
    """
    items = [decode_example(dict(ex)) for ex in examples]
    items.sort(key=lambda ex: ex.get("path", ""))
    out: list[dict[str, Any]] = []
    for ex in items:
        text = ex["text"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                tree = ast.parse(text)
            except (SyntaxError, ValueError):
                continue
        lines = _split_lines(text)
        funcs = [
            n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        funcs.sort(key=lambda n: n.lineno)
        taken = 0
        for fn in funcs:
            if taken >= max_per_file:
                break
            body_start = fn.body[0].lineno  # 1-based, first line of the body
            body_end = fn.end_lineno or body_start
            if body_start <= fn.lineno:  # one-line def: body on the def line
                continue
            if body_end - body_start + 1 < prompt_body_lines + reference_lines:
                continue
            head = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
            start = 0 if context_lines is None else max(0, head - 1 - context_lines)
            cut = body_start - 1 + prompt_body_lines  # 0-based index of reference
            prompt = "".join(lines[start:cut])
            reference = "".join(lines[cut : cut + reference_lines])
            if not reference.strip():
                continue
            out.append(
                {
                    "prompt": prompt,
                    "reference": reference,
                    "path": ex.get("path", ""),
                    "lineno": cut + 1,
                }
            )
            taken += 1
            if max_prompts is not None and len(out) >= max_prompts:
                return out
    return out


def stdlib_prompts(
    data_dir: str | os.PathLike,
    *,
    split: str = "validation",
    max_files: int | None = None,
    validation_percent: float = _DEFAULT_VALIDATION_PERCENT,
    **prompt_kwargs: Any,
) -> list[dict[str, Any]]:
    """Benchmark prompts from the held-out stdlib files (see `code_prompts`)."""
    builder = build_python_stdlib(
        data_dir, max_files=max_files, validation_percent=validation_percent
    )
    source = load_split(builder, split)
    return code_prompts((source[i] for i in range(len(source))), **prompt_kwargs)


def encode_code_prompt(tokenizer, text: str, max_tokens: int | None = None) -> list[int]:
    """Token ids of a code-completion prompt, trailing whitespace cut, its last `max_tokens`.

    A byte-level BPE merges a newline with the next line's indentation, so a prompt ending in a
    bare newline ends on a token the model rarely saw there; stripping it keeps prompts in
    distribution (the model writes the newline itself)."""
    ids = list(tokenizer.encode(text.rstrip()))
    return ids[-max_tokens:] if max_tokens else ids


def benchmark_prompts(
    tokenizer,
    prompt_file: str | None = None,
    data_dir: str | os.PathLike = "/tmp/dflash_tfds",
    num_prompts: int = 16,
    max_prompt_tokens: int = 256,
) -> list[list[int]]:
    """The benchmarks' token-id prompts: `prompt_file` JSONL (`dflash_jax.data.prompting`, no chat
    template), or the held-out stdlib code-completion prompts (`BENCHMARK_PROMPTS`); each cut
    to its last `max_prompt_tokens`, empty ones dropped, at most `num_prompts`."""
    if prompt_file:
        from dflash_jax.data import prompting

        items = prompting.read_prompt_file(prompt_file)
        prompts = prompting.encode_prompts(items, tokenizer, None, use_chat_template=False)
    else:
        pairs = stdlib_prompts(data_dir, max_prompts=num_prompts, **BENCHMARK_PROMPTS)
        prompts = [encode_code_prompt(tokenizer, p["prompt"]) for p in pairs]
    return [p[-max_prompt_tokens:] for p in prompts if p][:num_prompts]


# ----------------------------------------------------------------------------
# The trainer's prompt pools (from the training documents)
# ----------------------------------------------------------------------------


def window_prompts(
    source: Sequence, tokenize_fn: Callable, n: int, length: int, rng: np.random.RandomState
) -> list[list[int]]:
    """Up to n prompts of `length` tokens from random windows of the documents: one window per
    document per pass, in a fresh random order each pass, until n prompts or no usable doc.
    `tokenize_fn(doc) -> (ids, loss_mask)`."""
    out = []
    while len(out) < n:
        before = len(out)
        for i in rng.permutation(len(source)):
            ids, _ = tokenize_fn(source[int(i)])
            if len(ids) < length + 8:
                continue
            start = int(rng.randint(0, len(ids) - length - 8 + 1))
            out.append(ids[start : start + length].tolist())
            if len(out) >= n:
                return out
        if len(out) == before:
            break
    return out


def function_prompts(
    source: Sequence,
    tokenizer,
    n: int,
    max_len: int,
    body_lines: int,
    per_file: int,
    rng: np.random.RandomState,
) -> list[list[int]]:
    """Up to n code-completion prompts (the benchmark's kind, see `code_prompts`) from the
    documents, each encoded by `encode_code_prompt` to its last max_len tokens, in random
    order."""
    if n <= 0:
        return []
    items = code_prompts(
        (source[i] for i in range(len(source))),
        prompt_body_lines=body_lines,
        reference_lines=1,
        context_lines=40,
        max_per_file=per_file,
    )
    out = []
    for i in rng.permutation(len(items))[:n]:
        ids = encode_code_prompt(tokenizer, items[int(i)]["prompt"], max_len)
        if ids:
            out.append(ids)
    return out


def prompt_pool(
    source: Sequence,
    tokenizer,
    tokenize_fn: Callable,
    n: int,
    n_functions: int,
    length: int,
    body_lines: int,
    per_file: int,
    rng: np.random.RandomState,
) -> list[list[int]]:
    """n prompts of at most `length` tokens: n_functions code-completion prompts, random
    document windows for the rest, shuffled."""
    prompts = function_prompts(source, tokenizer, n_functions, length, body_lines, per_file, rng)
    prompts += window_prompts(source, tokenize_fn, n - len(prompts), length, rng)
    return [prompts[i] for i in rng.permutation(len(prompts))]
