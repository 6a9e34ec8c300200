"""Turning user prompts (text, JSONL files, or token ids) into token-id lists for `generate`.

Text goes through the target directory's `tokenizer.json` (Hugging Face `tokenizers`), and
through its chat template when the tokenizer config has one (rendered with jinja2).
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence


def read_prompt_file(path: str) -> List[dict]:
    """JSONL: one object per line with "prompt" (text), "messages" (chat), or "ids"."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from e
            if isinstance(obj, str):
                obj = {"prompt": obj}
            if not any(k in obj for k in ("prompt", "text", "messages", "ids")):
                raise ValueError(f"{path}:{n}: expected a 'prompt', 'text', 'messages' or 'ids' "
                                 "field")
            out.append(obj)
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def chat_template(model_dir: Optional[str]) -> Optional[str]:
    if not model_dir:
        return None
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        template = json.load(f).get("chat_template")
    return template if isinstance(template, str) else None


def render_chat(template: str, messages: Sequence[dict]) -> str:
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=list(messages), add_generation_prompt=True,
                                            enable_thinking=False)


def encode_prompts(items: Sequence[dict], tokenizer, model_dir: Optional[str],
                   use_chat_template: bool = True) -> List[List[int]]:
    """Token ids for each prompt item ({"prompt"|"text"|"messages"|"ids": ...})."""
    template = chat_template(model_dir) if use_chat_template else None
    out = []
    for item in items:
        if "ids" in item:
            out.append([int(i) for i in item["ids"]])
            continue
        if tokenizer is None:
            raise ValueError(f"text prompts need a tokenizer.json in {model_dir}; "
                             "pass token ids instead")
        if "messages" in item:
            if template is None:
                raise ValueError("chat messages given but the target has no chat template")
            text = render_chat(template, item["messages"])
        else:
            text = item.get("prompt", item.get("text"))
            if template is not None:
                text = render_chat(template, [{"role": "user", "content": text}])
        out.append(tokenizer.encode(text))
    return out


def encode_code_prompt(tokenizer, text: str, max_tokens: Optional[int] = None) -> List[int]:
    """Token ids of a code-completion prompt, trailing whitespace cut, its last `max_tokens`.

    A byte-level BPE merges a newline with the next line's indentation, so a prompt ending in a
    bare newline ends on a token the model rarely saw there; stripping it keeps prompts in
    distribution (the model writes the newline itself)."""
    ids = list(tokenizer.encode(text.rstrip()))
    return ids[-max_tokens:] if max_tokens else ids
