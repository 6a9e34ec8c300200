"""Target-generated training responses (DFlash regenerates its responses with the target).

`regenerate(target, prompts, out_path, ...)` runs `dflash_jax.generate` over prompts in fixed-size
batches (greedy or sampled) and writes JSONL records that `dflash_jax.data.build_user_files`
reads: {"prompt": text, "response": text, "prompt_ids": [...], "response_ids": [...]}
(texts only when a tokenizer is given; the ids are the exact tokens the target produced).

`regenerate_chat(target, conversations, out_path, render=..., encode=...)` does what SpecForge's
`regenerate_train_data.py` does for chat data: every assistant turn of each conversation is
regenerated in order, turn k's prompt being the conversation so far (system message, user turns
and the regenerated earlier answers) through the target's chat template with a generation
prompt. Its records are training rows: {"input_ids": the templated conversation, "loss_mask":
1 on the assistant tokens only, "prompt_ids": turn 1's prompt (evaluation), "turns":
[{"prompt_ids", "response_ids"}, ...], "messages": texts (with a tokenizer)}.
`record_tokens(rec)` gives (ids, loss_mask) for either kind of record.

CLI: python -m dflash_jax.training.regenerate --target=DIR --prompts=FILE.jsonl --out=OUT.jsonl
     (prompts: JSONL of conversations, see `dflash_jax.data.chat`: ShareGPT "conversations",
     OpenAI "messages" or plain "prompt"; --chat_template (default on when the tokenizer has
     one), --max_new_tokens, --temperature, --batch_size)
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Callable, List, Optional, Sequence

from dflash_jax.decoding.generation import generate
from dflash_jax.parallel import distributed
from dflash_jax.support import console


class _Journal:
    """The finished batches of a regeneration, appended to `OUT.partial` as they finish (flushed
    and synced), so a run stopped by Ctrl-C, a signal or the end of a session resumes where it
    stopped instead of starting over: the same inputs, target and settings (a fingerprint on
    the first line) replay the recorded batches; other ones are refused (one line, the file
    kept). Removed once OUT is written. A single process only (several: disabled)."""

    def __init__(self, out_path: str, fingerprint: str, enabled: bool = True):
        self.path = out_path + ".partial"
        self.done: dict = {}
        self.f = None
        if not enabled:
            return
        lines = []
        if os.path.exists(self.path):
            with open(self.path) as f:
                lines = f.read().split("\n")
            head = _json_or_none(lines[0]) or {}
            if head.get("fingerprint") != fingerprint:
                raise ValueError(
                    f"{self.path}: an interrupted regeneration of other prompts, target or "
                    "settings; rerun it with those, or delete the file to start over"
                )
            good = [lines[0]]
            for ln in lines[1:]:
                rec = _json_or_none(ln)
                if rec is None:  # a line cut by the interruption: that batch is redone
                    break
                self.done[tuple(rec["key"])] = rec["responses"]
                good.append(ln)
            lines = good
        else:
            lines = [json.dumps({"fingerprint": fingerprint})]
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:  # rewritten without a cut last line
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, self.path)
        self.f = open(self.path, "a")
        if self.done:
            console.say(f"regenerate: {len(self.done)} finished batches resumed from {self.path}")

    def get(self, key):
        return self.done.get(tuple(key))

    def add(self, key, responses) -> None:
        if self.f is not None:
            self.f.write(json.dumps({"key": list(key), "responses": responses}) + "\n")
            self.f.flush()
            os.fsync(self.f.fileno())

    def finish(self) -> None:
        if self.f is not None:
            self.f.close()
            os.remove(self.path)


_last_log = [0.0]


def _log_due(log_every: int, n_batches: int, bar, t0: float) -> bool:
    """A progress line is due (no progress bar: a log file): every `log_every` batches, or a
    minute after the last line (a batch of an 8B target can take minutes)."""
    if not (bar.disable and distributed.is_primary()):
        return False
    now = time.time()
    if (log_every and n_batches % log_every == 0) or now - max(_last_log[0], t0) >= 60:
        _last_log[0] = now
        return True
    return False


def _json_or_none(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _journal(out_path, target, inputs, max_new_tokens, batch_size, temperature, top_p, seed, stop):
    """The `_Journal` of a regeneration of `inputs` with these settings (single process)."""
    fingerprint = _fingerprint(
        target, inputs, max_new_tokens=max_new_tokens, batch_size=batch_size,
        temperature=temperature, top_p=top_p, seed=seed, stop=[int(t) for t in stop],
    )  # fmt: skip
    return _Journal(out_path, fingerprint, enabled=not distributed.is_multiprocess())


def _fingerprint(target, inputs, **settings) -> str:
    blob = json.dumps(
        {"target": repr(target.config), "inputs": inputs, "settings": settings},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def regenerate(
    target,
    prompts: Sequence[Sequence[int]],
    out_path: str,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    temperature: float = 0.0,
    top_p: Optional[float] = None,
    seed: int = 0,
    stop_token_ids: Sequence[int] = (),
    tokenizer=None,
    drafter=None,
    log_every: int = 10,
    mesh=None,
) -> List[dict]:
    """Generates a response for each prompt (token-id lists) and writes `out_path` (JSONL).

    Batches have a fixed size (the last one is padded with repeats) so one compiled program
    serves them all. Written atomically (tmp file, then rename). Returns the records.
    `mesh`: generate on it; when it spans several processes, all of them call this with the
    same prompts, process 0 writes the file and all return once it is there.
    """
    records = []
    prompts = [list(map(int, p)) for p in prompts]
    journal = _journal(
        out_path,
        target,
        prompts,
        max_new_tokens,
        batch_size,
        temperature,
        top_p,
        seed,
        stop_token_ids,
    )
    t0 = time.time()
    n_batches = (len(prompts) + batch_size - 1) // batch_size
    bar = console.progress(total=len(prompts), desc="regenerate", unit="prompt")
    for bi in range(n_batches):
        chunk = prompts[bi * batch_size : (bi + 1) * batch_size]
        padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
        outs = journal.get((bi,))
        if outs is None:
            res = generate(
                target,
                drafter,
                padded,
                max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed + bi,
                stop_token_ids=stop_token_ids,
                mesh=mesh,
            )
            outs = [[int(t) for t in r] for r in res.tokens[: len(chunk)]]
            journal.add((bi,), outs)
        for p, r in zip(chunk, outs):
            rec = {"prompt_ids": p, "response_ids": list(map(int, r))}
            if tokenizer is not None:
                rec = {"prompt": tokenizer.decode(p), "response": tokenizer.decode(r), **rec}
            records.append(rec)
        bar.update(len(chunk))
        if _log_due(log_every, bi + 1, bar, t0):
            # No bar (not a terminal, e.g. a log file): a line every `log_every` batches, and
            # at least one a minute.
            console.say(
                f"regenerate: {len(records)}/{len(prompts)} responses, {time.time() - t0:.0f}s"
            )
    bar.close()
    _write_records(records, out_path)
    journal.finish()
    return records


def _write_records(records: List[dict], out_path: str) -> None:
    """Process 0 writes `records` atomically (tmp file, then rename); all wait for the file."""
    if distributed.is_primary():
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
        os.replace(tmp, out_path)
    distributed.sync("regenerate: " + os.path.basename(out_path))  # the file is complete


def regenerate_chat(
    target,
    conversations: Sequence[Sequence[dict]],
    out_path: str,
    *,
    render: Callable,
    encode: Callable,
    decode: Optional[Callable] = None,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    temperature: float = 0.0,
    top_p: Optional[float] = None,
    seed: int = 0,
    stop_token_ids: Sequence[int] = (),
    drafter=None,
    log_every: int = 10,
    mesh=None,
) -> List[dict]:
    """Regenerates every assistant turn of `conversations` (lists of {"role", "content"}:
    an optional system message and user turns; assistant turns given are ignored, as
    `dflash_jax.data.chat.read_conversations` returns them) and writes training rows (JSONL,
    see the module doc). Returns the records.

    Turn k of all conversations that have one is generated together, in fixed-size batches
    (the last padded with repeats, one compiled program); turn k's prompt is
    `chat.chat_ids(render, encode, conversation so far, earlier responses,
    add_generation_prompt=True)`, so earlier answers enter as the exact ids the target wrote.
    A conversation whose next prompt + max_new_tokens would exceed the target's context ends
    before that turn (one with no turn left is dropped; a line says how many).
    render(messages, add_generation_prompt) -> text (`chat.template_renderer`); encode(text)
    -> ids; decode(ids) -> text (only for the records' "messages"). At temperature > 0 every
    batch draws with its own seed (seed, turn, batch)."""
    from dflash_jax.data.chat import chat_ids

    convs = [[dict(m) for m in c if m["role"] != "assistant"] for c in conversations]
    users = [[j for j, m in enumerate(c) if m["role"] == "user"] for c in convs]
    if any(not u for u in users):
        raise ValueError("regenerate_chat: every conversation needs a user turn")
    if not convs:
        raise ValueError("regenerate_chat: no conversations")
    msgs: List[List[dict]] = [[] for _ in convs]  # the conversation so far, answers included
    responses: List[List[List[int]]] = [[] for _ in convs]
    turns: List[List[dict]] = [[] for _ in convs]
    stop = tuple(int(s) for s in stop_token_ids)
    journal = _journal(
        out_path, target, convs, max_new_tokens, batch_size, temperature, top_p, seed, stop
    )
    total = sum(len(u) for u in users)
    bar = console.progress(total=total, desc="regenerate", unit="turn")
    t0, done, n_batches = time.time(), 0, 0
    context = target.config.max_position_embeddings
    ended = set()  # conversations whose next prompt would not fit the context: cut there
    for k in range(max(len(u) for u in users)):
        active, prompts = [], []
        for i in (i for i, u in enumerate(users) if len(u) > k and i not in ended):
            start = 0 if k == 0 else users[i][k - 1] + 1
            turn = msgs[i] + convs[i][start : users[i][k] + 1]  # (system,) user turn k
            p = chat_ids(render, encode, turn, responses[i], True, stop)[0]
            if len(p) + max_new_tokens > context:
                ended.add(i)
                bar.update(len(users[i]) - k)
                continue
            msgs[i] = turn
            active.append(i)
            prompts.append(p)
        order = sorted(range(len(active)), key=lambda j: len(prompts[j]))  # less padding
        active, prompts = [active[j] for j in order], [prompts[j] for j in order]
        for b0 in range(0, len(active), batch_size):
            chunk = prompts[b0 : b0 + batch_size]
            padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
            outs = journal.get((k, b0))
            if outs is None:
                res = generate(
                    target,
                    drafter,
                    padded,
                    max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    seed=seed + 100003 * k + b0 // batch_size,
                    stop_token_ids=stop,
                    mesh=mesh,
                )
                outs = [[int(t) for t in r] for r in res.tokens[: len(chunk)]]
                journal.add((k, b0), outs)
            for i, p, r in zip(active[b0 : b0 + batch_size], chunk, outs):
                responses[i].append(r)
                turns[i].append({"prompt_ids": p, "response_ids": r})
                text = ""
                if decode is not None:
                    text = decode(r[:-1] if r and r[-1] in stop else r)
                msgs[i].append({"role": "assistant", "content": text})
            done += len(chunk)
            n_batches += 1
            bar.update(len(chunk))
            if _log_due(log_every, n_batches, bar, t0):
                console.say(f"regenerate: {done}/{total} turns, {time.time() - t0:.0f}s")
    bar.close()
    if ended:
        console.say(
            f"regenerate: {len(ended)} conversation(s) cut where prompt + "
            f"max_new_tokens ({max_new_tokens}) exceeds the target's context "
            f"({context}); {sum(not responses[i] for i in ended)} dropped entirely"
        )
    records = []
    for i in range(len(convs)):
        if not responses[i]:
            continue
        ids, mask = chat_ids(render, encode, msgs[i], responses[i], False, stop)
        rec = {
            "input_ids": ids,
            "loss_mask": mask,
            "prompt_ids": turns[i][0]["prompt_ids"],
            "turns": turns[i],
        }
        if decode is not None:
            rec["messages"] = msgs[i]
        records.append(rec)
    _write_records(records, out_path)
    journal.finish()
    return records


def record_tokens(rec: dict):
    """(ids, loss_mask) int32 arrays of a regenerated record: a chat row's own input_ids and
    loss_mask, or prompt + response with the mask on the response."""
    import numpy as np

    if "input_ids" in rec:
        return (np.asarray(rec["input_ids"], np.int32), np.asarray(rec["loss_mask"], np.int32))
    p, r = list(rec["prompt_ids"]), list(rec["response_ids"])
    mask = np.ones(len(p) + len(r), np.int32)
    mask[: len(p)] = 0
    return np.asarray(p + r, np.int32), mask


_CHAT_KEYS = ("input_ids", "loss_mask", "prompt_ids")


def read_records(
    path: str, required=("prompt_ids", "response_ids"), vocab_size: Optional[int] = None
) -> List[dict]:
    """The JSON objects of a JSONL file, each checked to hold the `required` keys (id-list
    keys, ending in "_ids", as integer lists within `vocab_size`). With the default
    `required`, a chat row (a record with "input_ids", see `regenerate_chat`) needs
    input_ids, a 0/1 loss_mask of the same length and prompt_ids instead. Every error is a
    ValueError naming the file and line."""
    from dflash_jax.support.checks import token_id_list

    default = required == ("prompt_ids", "response_ids")

    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                rec = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise ValueError(f"{path}:{n}: not a valid JSON line ({e})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
            chat = default and "input_ids" in rec
            for key in _CHAT_KEYS if chat else required:
                if key not in rec:
                    raise ValueError(
                        f"{path}:{n}: missing key {key!r} (expected "
                        f"{', '.join(map(repr, required))})"
                    )
                if key.endswith("_ids"):
                    try:
                        rec[key] = token_id_list(
                            key, rec[key], vocab_size, allow_empty=key != "prompt_ids"
                        )
                    except ValueError as e:
                        raise ValueError(f"{path}:{n}: {e}") from None
            if chat:
                mask = rec["loss_mask"]
                if not (
                    isinstance(mask, list)
                    and len(mask) == len(rec["input_ids"])
                    and all(type(x) is int and x in (0, 1) for x in mask)
                ):
                    raise ValueError(
                        f"{path}:{n}: loss_mask must be a list of 0/1 as long as "
                        f"input_ids ({len(rec['input_ids'])})"
                    )
            out.append(rec)
    return out


def rows_as_given(
    conversations: Sequence[Sequence[dict]],
    out_path: str,
    *,
    render: Callable,
    encode: Callable,
    max_new_tokens: int = 256,
    stop_token_ids: Sequence[int] = (),
    context: int = 0,
) -> List[dict]:
    """Training rows of `conversations` with their own assistant answers (no generation):
    the cheap data of teacher-forced distillation, where a tap store gives the target's
    next-token distribution at every position and the drafter learns that (loss "topk_kl").
    Each answer is its text encoded, cut to `max_new_tokens` tokens, then the first stop id;
    a conversation is cut before the first turn that would pass `context` tokens (> 0). The
    records are chat rows as `regenerate_chat` writes them (input_ids, loss_mask on the
    answers, prompt_ids of turn 1); written to `out_path`."""
    from dflash_jax.data.chat import chat_ids

    stop = tuple(int(t) for t in stop_token_ids)
    records = []
    for conv in conversations:
        msgs, answers, prompt = [], [], None
        for m in conv:
            if m["role"] != "assistant":
                msgs.append(dict(m))
                continue
            if not msgs or msgs[-1]["role"] != "user":
                continue
            ans = list(encode(m["content"]))[:max_new_tokens] + list(stop[:1])
            trial = msgs + [{"role": "assistant", "content": m["content"]}]
            ids, mask = chat_ids(render, encode, trial, answers + [ans], False, stop)
            if context and len(ids) > context:
                break
            if prompt is None:
                prompt = chat_ids(render, encode, msgs, answers, True, stop)[0]
            msgs, answers = trial, answers + [ans]
        if answers:
            ids, mask = chat_ids(render, encode, msgs, answers, False, stop)
            records.append({"input_ids": ids, "loss_mask": mask, "prompt_ids": prompt})
    _write_records(records, out_path)
    return records


_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def given_conversations(path: str) -> List[List[dict]]:
    """The conversations of a JSONL file with their assistant turns kept ("messages" with
    role / content, ShareGPT "conversations" with from / value, or a "prompt" alone);
    `chat.read_conversations`
    keeps only the system and user turns, for regeneration. ValueError naming file:line."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            msgs = obj.get("messages") or obj.get("conversations")
            if isinstance(obj.get("prompt"), str) and msgs is None:  # a prompt: no answer
                msgs = [{"role": "user", "content": obj["prompt"]}]
            if not isinstance(msgs, list):
                raise ValueError(f"{path}:{n}: no 'messages' or 'conversations' list")
            conv = []
            for m in msgs:
                role = _ROLES.get(str(m.get("role", m.get("from", ""))).lower())
                text = m.get("content", m.get("value"))
                if role is None or not isinstance(text, str):
                    raise ValueError(f"{path}:{n}: a message without a known role and text")
                conv.append({"role": role, "content": text})
            out.append(conv)
    return out


def regenerate_from_file(
    target,
    tokenizer,
    model_dir: Optional[str],
    path: str,
    out_path: str,
    *,
    use_chat_template: bool = True,
    limit: int = 0,
    log=None,
    **kw,
) -> List[dict]:
    """Regenerates the conversations of the JSONL file `path` (`data.chat.read_conversations`):
    through the target's chat template when `model_dir`'s tokenizer_config.json has one and
    `use_chat_template` (`regenerate_chat`: multi-turn, chat rows), else as raw single-turn
    prompts (`regenerate`: prompt/response records). `limit` > 0: the first `limit`
    conversations. `kw`: max_new_tokens, batch_size, temperature, seed, stop_token_ids, mesh..."""
    from dflash_jax.data.chat import plain_render, read_conversations, template_renderer

    if tokenizer is None:
        raise ValueError(f"{path}: text conversations need the target's tokenizer.json")
    convs = read_conversations(path, limit=limit)
    render, how = template_renderer(model_dir, use_chat_template)
    if log is not None:
        log(f"regenerating {len(convs)} conversations of {path} ({how}) -> {out_path}")
    if render is plain_render:
        prompts = []
        for c in convs:
            prompts.append(list(tokenizer.encode(plain_render(c, True))))
        return regenerate(target, prompts, out_path, tokenizer=tokenizer, **kw)
    return regenerate_chat(
        target,
        convs,
        out_path,
        render=render,
        encode=tokenizer.encode,
        decode=tokenizer.decode,
        **kw,
    )


def main(argv):
    del argv
    from absl import flags

    from dflash_jax.data import load_tokenizer
    from dflash_jax.models import hub
    from dflash_jax.models.target import load_target

    F = flags.FLAGS
    from dflash_jax.support import locks

    locks.acquire(F.out, "--out")  # one run per --out: a second is refused, naming the first
    target_dir = hub.resolve_or_exit(F.target, what="--target")
    console.cli_startup()
    from dflash_jax.data.chat import read_conversations

    if not F.as_given:
        read_conversations(F.prompts)  # a bad row is an error before the target loads
    else:  # the conversations' own answers: no target pass here
        from dflash_jax.data.chat import template_renderer
        from dflash_jax.models.checkpoint import read_target_config

        tok = load_tokenizer(target_dir)
        render, how = template_renderer(target_dir, True)
        convs = given_conversations(F.prompts)
        recs = rows_as_given(
            convs,
            F.out,
            render=render,
            encode=tok.encode,
            max_new_tokens=F.max_new_tokens,
            stop_token_ids=(tok.eos_id,),
            context=read_target_config(target_dir).max_position_embeddings,
        )
        n = sum(int(sum(r["loss_mask"])) for r in recs)
        console.say(
            f"{len(recs)} rows of {len(convs)} conversations as given ({how}): "
            f"{n} answer tokens -> {F.out}"
        )
        return
    target = load_target(target_dir)
    tok = load_tokenizer(target_dir)
    regenerate_from_file(
        target,
        tok,
        target_dir,
        F.prompts,
        F.out,
        use_chat_template=F.chat_template,
        log=console.say,
        max_new_tokens=F.max_new_tokens,
        batch_size=F.batch_size,
        temperature=F.temperature,
        seed=F.seed,
        stop_token_ids=(tok.eos_id,),
    )


if __name__ == "__main__":
    from absl import flags

    from dflash_jax.support import cli

    flags.DEFINE_string(
        "target", None, "target model directory (HF format) or hub id", required=True
    )
    flags.DEFINE_string(
        "prompts",
        None,
        "JSONL conversations (ShareGPT 'conversations', OpenAI 'messages') or prompts ('prompt')",
        required=True,
    )
    flags.DEFINE_string("out", None, "output JSONL", required=True)
    flags.DEFINE_bool(
        "chat_template",
        True,
        "render through the target's chat template when its tokenizer_config.json has one",
    )
    flags.DEFINE_integer("max_new_tokens", 256, "response length cap (per assistant turn)")
    flags.DEFINE_integer("batch_size", 32, "prompts per generate call")
    flags.DEFINE_float("temperature", 0.0, "0 = greedy")
    flags.DEFINE_integer("seed", 0, "sampling seed")
    flags.DEFINE_bool(
        "as_given",
        False,
        "write the conversations with their own answers (cut to max_new_tokens), no generation",
    )
    cli.run(main)
