"""Turning user prompts (text, JSONL files, or token ids) into token-id lists for `generate`.

Text goes through the target directory's `tokenizer.json` (Hugging Face `tokenizers`), and
through its chat template when the tokenizer config has one (rendered in jinja2's immutable
sandbox, as transformers renders it: a model directory cannot run code). Prompts cut from a
corpus (the benchmarks' held-out code, the trainer's prompt pools): `dflash_jax.data.prompts`.
"""

from __future__ import annotations

import json
import os
from typing import Iterator, List, Optional, Sequence, Tuple

from dflash_jax.support import checks

_PROMPT_KEYS = ("prompt", "text", "messages", "ids")


def check_prompt_item(obj, where: str) -> dict:
    """One prompt item checked: a JSON object with exactly one of "prompt"/"text" (a string),
    "messages" (a non-empty list of {"role": str, "content": str}) or "ids" (a non-empty list
    of integers; 1.5 or "abc" is an error, never truncated). A bare string is a "prompt".
    Raises ValueError naming `where` (e.g. "prompts.jsonl:3")."""
    if isinstance(obj, str):
        obj = {"prompt": obj}
    if not isinstance(obj, dict):
        raise ValueError(
            f"{where}: expected a JSON object with a 'prompt', 'text', 'messages' "
            f"or 'ids' field, got {type(obj).__name__}"
        )
    given = [k for k in _PROMPT_KEYS if k in obj]
    if len(given) != 1:
        raise ValueError(
            f"{where}: expected exactly one of 'prompt', 'text', 'messages' or "
            f"'ids', got {given or sorted(obj)}"
        )
    key = given[0]
    value = obj[key]
    if key in ("prompt", "text") and not isinstance(value, str):
        raise ValueError(f"{where}: {key!r} must be a string, got {json.dumps(value)[:40]}")
    if key == "messages":
        if not isinstance(value, list) or not value:
            raise ValueError(
                f"{where}: 'messages' must be a non-empty list of "
                "{'role': ..., 'content': ...} objects"
            )
        for j, m in enumerate(value):
            if not (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise ValueError(
                    f"{where}: messages[{j}] must be an object with string 'role' "
                    f"and 'content', got {json.dumps(m)[:60]}"
                )
    if key == "ids":
        from dflash_jax.support.checks import token_id_list

        try:
            obj = dict(obj, ids=token_id_list("'ids'", value))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return obj


def iter_jsonl(path: str, what: str = "JSONL file") -> Iterator[Tuple[int, object]]:
    """(line number, parsed JSON value) for every non-blank line of a JSON Lines file. Every
    error is a ValueError naming the file (and line): a directory, a missing file (`what` names
    the kind of file expected), text that is not UTF-8, a line that is not JSON."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory, not a {what}")
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such {what}")
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{n}: not UTF-8 text (expected JSON Lines)") from None
            if not line:
                continue
            try:
                yield n, json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None


def iter_prompt_file(path: str) -> Iterator[Tuple[int, dict]]:
    """(line number, checked item) for every non-blank line of a JSONL prompt file (a bare
    JSON string is a text prompt). Every error is a ValueError naming the file and line."""
    for n, obj in iter_jsonl(path, "prompt file"):
        yield n, check_prompt_item(obj, f"{os.fspath(path)}:{n}")


def read_prompt_file(path: str, with_labels: bool = False):
    """JSONL: one object per line with "prompt" (text), "messages" (chat), or "ids" (see
    `check_prompt_item`). With `with_labels`: (items, ["path:line", ...]) for
    `encode_prompts(labels=...)`, so later errors (ids outside the vocabulary) name the line."""
    pairs = list(iter_prompt_file(path))
    if not pairs:
        raise ValueError(f"{path}: no prompts")
    items = [item for _, item in pairs]
    return (items, [f"{path}:{n}" for n, _ in pairs]) if with_labels else items


def _tokenizer_config(model_dir: Optional[str]) -> dict:
    if not model_dir:
        return {}
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.exists(path):
        return {}
    return checks.json_object_file(path)


def chat_template(model_dir: Optional[str]) -> Optional[str]:
    """The chat template of tokenizer_config.json: a string, or in the list form
    ([{"name": ..., "template": ...}]) the one named "default", as transformers picks it.
    Any other value is a ValueError naming the file."""
    template = _tokenizer_config(model_dir).get("chat_template")
    if template is None or isinstance(template, str):
        return template
    path = os.path.join(model_dir, "tokenizer_config.json")
    if isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("template"), str) for t in template
    ):
        named = {t.get("name"): t["template"] for t in template}
        if "default" in named:
            return named["default"]
        raise ValueError(
            f"{path}: chat_template is a list without a 'default' entry "
            f"(names: {sorted(map(str, named))})"
        )
    raise ValueError(
        f"{path}: chat_template must be a string or a list of {{'name', 'template'}} "
        f"objects, got {type(template).__name__}"
    )


def special_tokens(model_dir: Optional[str]) -> dict:
    """{"bos_token": "<s>", ...} from tokenizer_config.json: the variables transformers passes
    to chat templates (Llama-3's starts with {{ bos_token }})."""
    out = {}
    for name, value in _tokenizer_config(model_dir).items():
        if name.endswith("_token") and name in (
            "bos_token",
            "eos_token",
            "unk_token",
            "sep_token",
            "pad_token",
            "cls_token",
            "mask_token",
        ):
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[name] = value
    return out


class ChatTemplateError(ValueError):
    """A chat template that failed to render: refused by the sandbox, a syntax error, an
    exception it raised, or a time or size bound (`template_sandbox`). One line, naming where
    the template came from."""


def render_chat(
    template: str,
    messages: Sequence[dict],
    where: str = "chat template",
    add_generation_prompt: bool = True,
    time_limit_s: Optional[float] = None,
    max_chars: Optional[int] = None,
    **variables,
) -> str:
    """The chat template rendered over `messages` with a generation prompt (thinking off;
    `add_generation_prompt=False`: a finished conversation, e.g. a training row), in the
    bounded sandbox of `template_sandbox` (as transformers renders it, plus a time and a size
    bound: `time_limit_s`, `max_chars`, default 10 s and 4,000,000 characters or the
    DFLASH_TEMPLATE_TIME_LIMIT / DFLASH_TEMPLATE_MAX_CHARS environment variables).
    `variables`: e.g. `special_tokens(model_dir)`. Every failure (an unsafe operation, a
    syntax error, an exception the template raises or causes, a bound) is a
    `ChatTemplateError` (a ValueError) naming `where`."""
    from jinja2.exceptions import SecurityError, TemplateError

    from dflash_jax.data import template_sandbox

    try:
        return template_sandbox.render(
            template,
            dict(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                enable_thinking=False,
                **variables,
            ),
            time_limit_s=time_limit_s,
            max_chars=max_chars,
        )
    except SecurityError as e:
        raise ChatTemplateError(
            f"{where}: refused to render: the template tried an unsafe operation ({e})"
        ) from None
    except template_sandbox.TemplateLimitError as e:
        raise ChatTemplateError(f"{where}: refused to render: {e}") from None
    except TemplateError as e:
        raise ChatTemplateError(f"{where}: {type(e).__name__}: {e}") from None
    except (Exception, MemoryError, RecursionError) as e:  # noqa: BLE001 - untrusted code
        raise ChatTemplateError(
            f"{where}: the chat template failed: {type(e).__name__}: {e}"
        ) from None


def encode_prompts(
    items: Sequence[dict],
    tokenizer,
    model_dir: Optional[str],
    use_chat_template: bool = True,
    vocab_size: Optional[int] = None,
    labels: Optional[Sequence[str]] = None,
) -> List[List[int]]:
    """Token ids for each prompt item ({"prompt"|"text"|"messages"|"ids": ...}). Items are
    checked (`check_prompt_item`); `vocab_size`: ids outside it are an error; `labels`: how
    errors name each item (e.g. "prompts.jsonl:3"; default "prompt i")."""
    template = chat_template(model_dir) if use_chat_template else None
    where_t = os.path.join(model_dir, "tokenizer_config.json") if model_dir else "chat template"
    variables = special_tokens(model_dir) if template is not None else {}
    out = []
    for i, item in enumerate(items):
        where = labels[i] if labels is not None else f"prompt {i}"
        item = check_prompt_item(item, where)
        if "ids" in item:
            ids = item["ids"]
        else:
            if tokenizer is None:
                raise ValueError(
                    f"{where}: text prompts need a tokenizer.json in {model_dir}; "
                    "pass token ids instead"
                )
            if "messages" in item:
                if template is None:
                    raise ValueError(
                        f"{where}: chat messages given but the target has no chat template"
                    )
                text = render_chat(template, item["messages"], where_t, **variables)
            else:
                text = item.get("prompt", item.get("text"))
                if template is not None:
                    text = render_chat(
                        template, [{"role": "user", "content": text}], where_t, **variables
                    )
            ids = list(tokenizer.encode(text))
        if not ids:
            raise ValueError(f"{where} is empty")
        if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = next(t for t in ids if t < 0 or t >= vocab_size)
            raise ValueError(f"{where}: token id {bad} outside the vocabulary [0, {vocab_size})")
        out.append(ids)
    return out
