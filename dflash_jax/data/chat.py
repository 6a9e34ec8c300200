"""Chat data for regeneration: conversations read from JSONL, and templated token rows.

One conversation per line, in any of three layouts (a file may mix them):
  ShareGPT:  {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}, ...]}
             (SpecForge's files, with "role"/"content" inside "conversations", are read too)
  OpenAI:    {"messages": [{"role": "user", "content": "..."}, ...]}
  plain:     {"prompt": "..."} or {"text": "..."} or a bare JSON string: one user turn.
Roles are normalised to "system", "user" and "assistant"; the assistant turns of the input are
only placeholders (regeneration replaces them), so a conversation is its system message (if
any) and its user turns. A bad row is a one-line ValueError naming the file and line.

`chat_ids` renders a conversation through a chat template with the assistant contents given as
exact token ids (the ids the target produced, never re-tokenised text): the row's loss mask is
1 on those ids and 0 on everything the template adds.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

from dflash_jax.data.prompting import iter_jsonl

_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}

Message = Dict[str, str]


def conversation_from(obj, where: str) -> List[Message]:
    """The normalised messages [{"role", "content"}] of one JSON row (see the module doc).
    Raises ValueError naming `where` (e.g. "chats.jsonl:7")."""
    if isinstance(obj, str):
        obj = {"prompt": obj}
    if not isinstance(obj, dict):
        raise ValueError(
            f"{where}: expected a JSON object with 'conversations', 'messages' or "
            f"'prompt', got {type(obj).__name__}"
        )
    keys = [k for k in ("conversations", "messages", "prompt", "text") if k in obj]
    if len(keys) != 1:
        raise ValueError(
            f"{where}: expected exactly one of 'conversations', 'messages', "
            f"'prompt' or 'text', got {keys or sorted(obj)}"
        )
    key = keys[0]
    if key in ("prompt", "text"):
        if not isinstance(obj[key], str) or not obj[key]:
            raise ValueError(f"{where}: {key!r} must be a non-empty string")
        return [{"role": "user", "content": obj[key]}]
    turns = obj[key]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: {key!r} must be a non-empty list of turns")
    out = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict):
            raise ValueError(f"{where}: {key}[{j}] must be an object, got {type(t).__name__}")
        role = t.get("from", t.get("role"))
        content = t.get("value", t.get("content"))
        if not isinstance(role, str) or role.lower() not in _ROLES:
            raise ValueError(
                f"{where}: {key}[{j}] has role {role!r}; expected one of "
                f"{', '.join(sorted(_ROLES))}"
            )
        role = _ROLES[role.lower()]
        if role != "assistant" and not isinstance(content, str):
            raise ValueError(f"{where}: {key}[{j}] ({role}) needs a string content/value")
        out.append({"role": role, "content": content if isinstance(content, str) else ""})
    if any(m["role"] == "system" for m in out[1:]):
        raise ValueError(f"{where}: a system message may only open the conversation")
    body = out[1:] if out[0]["role"] == "system" else out
    if not body or body[0]["role"] != "user":
        raise ValueError(
            f"{where}: the conversation must start with a user turn (after an "
            "optional system message)"
        )
    for a, b in zip(body, body[1:]):
        if a["role"] == b["role"]:
            raise ValueError(
                f"{where}: two {a['role']} turns in a row; user and assistant turns must alternate"
            )
    # The input's assistant turns are placeholders: keep the system message and user turns.
    return [m for m in out if m["role"] != "assistant"]


def read_conversations(path: str, limit: int = 0) -> List[List[Message]]:
    """Every conversation of a JSONL file (ShareGPT, OpenAI messages or plain prompts), as
    system + user messages; `limit` > 0 reads only that many. ValueError naming file:line."""
    out = []
    for n, obj in iter_jsonl(path):
        out.append(conversation_from(obj, f"{os.fspath(path)}:{n}"))
        if limit and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path}: no conversations")
    return out


# Assistant contents are rendered as these markers (private-use characters, which no template
# rewrites), then the text between them is tokenised and the exact ids go in their place.
_MARK = "\ue000{}\ue001"
_MARK_RE = re.compile("\ue000(\\d+)\ue001")


def chat_ids(
    render,
    encode,
    messages: Sequence[Message],
    responses: Sequence[Sequence[int]],
    add_generation_prompt: bool,
    stop_ids: Sequence[int] = (),
    where: str = "chat template",
) -> Tuple[List[int], List[int]]:
    """(ids, loss_mask) of `messages` rendered through a chat template, where the k-th
    assistant message is the token ids `responses[k]` (inserted as they are, mask 1; all
    template text mask 0).

    render(messages, add_generation_prompt) -> text; encode(text) -> ids. A response that
    ends with a stop id the template writes right after the content (e.g. <|im_end|>) keeps
    it once, in the response. ValueError naming `where` if the template drops, repeats or
    reorders assistant contents."""
    marked, k = [], 0
    for m in messages:
        if m["role"] == "assistant":
            marked.append({"role": "assistant", "content": _MARK.format(k)})
            k += 1
        else:
            marked.append(dict(m))
    if k != len(responses):
        raise ValueError(f"{where}: {k} assistant messages but {len(responses)} responses")
    text = render(marked, add_generation_prompt)
    pieces = _MARK_RE.split(text)  # text, index, text, index, ..., text
    order = [int(i) for i in pieces[1::2]]
    if order != list(range(k)):
        raise ValueError(
            f"{where}: the chat template does not write each assistant message "
            f"once and in order (got {order} for {k} messages)"
        )
    ids, mask = [], []
    stop = set(int(s) for s in stop_ids)
    prev_stop = None
    for j, piece in enumerate(pieces[0::2]):
        t = list(encode(piece)) if piece else []
        if prev_stop is not None and t and t[0] == prev_stop:
            t = t[1:]  # the template's end-of-turn token is the response's own stop token
        ids += t
        mask += [0] * len(t)
        if j < k:
            r = [int(x) for x in responses[j]]
            ids += r
            mask += [1] * len(r)
            prev_stop = r[-1] if r and r[-1] in stop else None
    return ids, mask


def plain_render(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """No chat template: a single user turn is its text (today's raw-prompt regeneration)."""
    del add_generation_prompt
    users = [m for m in messages if m["role"] != "assistant"]
    if len(users) != 1 or users[0]["role"] != "user":
        raise ValueError(
            "conversations with several turns or a system message need a chat "
            "template (the tokenizer has none, or regen.chat_template is False)"
        )
    return users[0]["content"] + "".join(
        _MARK.format(i) for i in range(sum(m["role"] == "assistant" for m in messages))
    )


def template_renderer(model_dir: Optional[str], use_chat_template: bool = True):
    """(render, description): the target's chat template (tokenizer_config.json, rendered in
    `prompting`'s sandbox) when it has one and `use_chat_template`, else `plain_render`."""
    from dflash_jax.data import prompting

    template = prompting.chat_template(model_dir) if use_chat_template else None
    if template is None:
        return plain_render, "no chat template: plain text"
    where = os.path.join(model_dir, "tokenizer_config.json")
    variables = prompting.special_tokens(model_dir)

    def render(messages, add_generation_prompt):
        return prompting.render_chat(
            template, messages, where, add_generation_prompt=add_generation_prompt, **variables
        )

    return render, f"chat template of {where}"
