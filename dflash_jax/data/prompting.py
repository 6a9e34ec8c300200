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

# The bounds on prompt text, checked before anything is tokenized or parsed. A prompt is at most
# MAX_PROMPT_CHARS characters: 16 per token of the largest context a supported model states
# (Qwen3.5's 262,144 tokens), well past what fits any context (text averages 3 to 5 characters a
# token), so a refusal costs no usable prompt and a 12 MB line is not tokenized for a minute to be
# refused by the context check afterwards. A JSON Lines line is at most MAX_LINE_BYTES (a prompt
# of MAX_PROMPT_CHARS as \uXXXX escapes is 6 bytes a character, 24 MiB) and nested at most
# MAX_JSON_DEPTH levels (a prompt line needs 3: {"messages": [{...}]}).
LARGEST_CONTEXT = 262_144
MAX_PROMPT_CHARS = 16 * LARGEST_CONTEXT
MAX_LINE_BYTES = 32 * 1024 * 1024
MAX_JSON_DEPTH = 64


def check_text(
    where: str, text: str, limit: int = MAX_PROMPT_CHARS, from_bytes: bool = False
) -> str:
    """`text` when it is Unicode text a tokenizer takes, else a ValueError naming `where`:
    more than `limit` characters, or a lone surrogate (half of a UTF-16 pair, e.g. a JSON
    "\ud800" escape without its pair). `from_bytes`: `text` was decoded from bytes with
    Python's surrogateescape (argv), so U+DC80..U+DCFF stand for bytes that were not UTF-8
    (e.g. "café" in Latin-1, whose é is the byte 0xE9) and the message names the byte. Nothing
    is replaced or dropped: the prompt is used as given or refused."""
    if len(text) > limit:
        raise ValueError(
            f"{where}: {len(text):,} characters, over the limit of {limit:,} for one prompt "
            f"(16 characters per token of a {LARGEST_CONTEXT:,}-token context); refused "
            "before tokenizing"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        if from_bytes and 0xDC80 <= c <= 0xDCFF:
            raise ValueError(
                f"{where}: not UTF-8 text: byte 0x{c - 0xDC00:02X} at character {e.start} "
                "(text in another encoding, e.g. Latin-1; convert it to UTF-8, e.g. with "
                "iconv -f latin1 -t utf-8)"
            ) from None
        raise ValueError(
            f"{where}: a lone surrogate U+{c:04X} at character {e.start} (half of a UTF-16 "
            "pair, not a character; a JSON \\uD800-\\uDFFF escape needs its pair)"
        ) from None
    return text


def _depth(obj) -> int:
    """How deeply lists and objects nest in a parsed JSON value (an explicit stack: no
    recursion, whatever the depth)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, d = stack.pop()
        if isinstance(value, (list, dict)):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


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
        raise ValueError(f"{where}: {key!r} must be a string, got {_short(value)}")
    if key in ("prompt", "text"):
        check_text(f"{where}: {key!r}", value)
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
                    f"and 'content', got {_short(m)}"
                )
            check_text(f"{where}: messages[{j}].role", m["role"])
            check_text(f"{where}: messages[{j}].content", m["content"])
        total = sum(len(m["role"]) + len(m["content"]) for m in value)
        if total > MAX_PROMPT_CHARS:
            raise ValueError(
                f"{where}: the messages hold {total:,} characters, over the limit of "
                f"{MAX_PROMPT_CHARS:,} for one prompt (16 characters per token of a "
                f"{LARGEST_CONTEXT:,}-token context); refused before tokenizing"
            )
    if key == "ids":
        from dflash_jax.support.checks import token_id_list

        try:
            obj = dict(obj, ids=token_id_list("'ids'", value))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return obj


def _short(value, n: int = 60) -> str:
    """A bounded description of a JSON value for an error line (no recursion limit reached,
    however deep or long the value)."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 3, n, n
    return r.repr(value)[:n]


def iter_jsonl(
    path: str,
    what: str = "JSONL file",
    max_line_bytes: int = MAX_LINE_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
) -> Iterator[Tuple[int, object]]:
    """(line number, parsed JSON value) for every non-blank line of a JSON Lines file. Every
    error is a ValueError naming the file (and line): a directory, a missing file (`what` names
    the kind of file expected), text that is not UTF-8 (the first bad byte and its offset), a
    line over `max_line_bytes` (refused before it is read whole or parsed), a line that is not
    JSON, JSON nested more than `max_depth` levels."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory, not a {what}")
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such {what}")
    with open(path, "rb") as f:
        n = 0
        while True:
            raw = f.readline(max_line_bytes + 2)  # the line and its end, or enough to refuse it
            if not raw:
                break
            n += 1
            if len(raw.rstrip(b"\r\n")) > max_line_bytes:
                raise ValueError(
                    f"{path}:{n}: a line over the limit of {max_line_bytes:,} bytes; refused "
                    f"before parsing (one prompt is at most {MAX_PROMPT_CHARS:,} characters)"
                )
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{n}: not UTF-8 text: byte 0x{raw[e.start]:02X} at byte {e.start} "
                    "of the line (expected JSON Lines in UTF-8)"
                ) from None
            if not line:
                continue
            deep = f"{path}:{n}: JSON nested more than {max_depth} levels deep; refused"
            try:
                value = json.loads(line)
            except RecursionError:
                raise ValueError(deep) from None
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
            if _depth(value) > max_depth:
                raise ValueError(deep)
            yield n, value


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
