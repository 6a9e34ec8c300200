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
     Every flag and --out (not an input, not a directory, its directory writable) is checked
     before the target loads: one `error:` line, exit 2, nothing written. Finished batches
     are journaled in OUT.partial: rerun the same command to resume (the same prompts,
     settings and target files; another target is refused). Ctrl-C / SIGTERM: one line, exit
     130 / 143, the finished batches kept.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import time
from typing import Callable, List, Optional, Sequence

if __name__ == "__main__":
    # The CLI: Ctrl-C / SIGTERM from here until the first batch is in OUT.partial is one line
    # and exit 130 / 143, at once (dflash_jax/support/interrupts.py); after it, the run stops
    # keeping its finished batches (`main`).
    from dflash_jax.support import interrupts

    interrupts.guard("interrupted: nothing was written")

from dflash_jax.data.sources import _ROLES
from dflash_jax.decoding.generation import Generator, generate
from dflash_jax.decoding.request import Settings
from dflash_jax.parallel import distributed
from dflash_jax.support import checks, console


class _Journal:
    """The finished batches of a regeneration, appended to `OUT.partial` as they finish (flushed
    and synced), so a run stopped by Ctrl-C, a signal or the end of a session resumes where it
    stopped instead of starting over: the same inputs, target and settings (a header on the
    first line: a fingerprint, and the target's files by `target_identity`) replay the recorded
    batches; other ones are refused (one line, the file kept). The file is started by the first
    finished batch and removed once OUT is written. `on_batch()` is called after each batch is
    on disk. A single process only (several: disabled)."""

    def __init__(
        self,
        out_path: str,
        fingerprint: str,
        enabled: bool = True,
        target: Optional[dict] = None,
        on_batch: Optional[Callable] = None,
    ):
        self.path = out_path + ".partial"
        self.done: dict = {}
        self.f = None
        self.enabled = enabled
        self.on_batch = on_batch
        self.head = {"fingerprint": fingerprint, "target": target}
        if not enabled or not os.path.exists(self.path):
            return
        lines = journal_lines(self.path, target)
        if json.loads(lines[0]).get("fingerprint") != fingerprint:
            raise ValueError(
                f"{self.path}: an interrupted regeneration of other prompts or settings; "
                "rerun it with those, or delete or move the file to start over"
            )
        for ln in lines[1:]:
            rec = json.loads(ln)
            self.done[tuple(rec["key"])] = rec["responses"]
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
        if not self.enabled:
            return
        if self.f is None:  # the first finished batch starts the file, header first
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self.f = open(self.path, "w")
            self.f.write(json.dumps(self.head) + "\n")
        self.f.write(json.dumps({"key": list(key), "responses": responses}) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())
        if self.on_batch is not None:
            self.on_batch()

    def finish(self) -> None:
        if self.f is not None:
            self.f.close()
            os.remove(self.path)


def target_identity(path: Optional[str]) -> Optional[dict]:
    """What a journal knows its target by: the directory's real path and, for each of its
    files (weights, config, tokenizer and chat template; hidden files and *.md aside), the
    size and modification time in ns, as `make` and rsync tell a changed file; for a GGUF
    target (a sidecar directory whose config.json names the .gguf) the .gguf file's too. A
    fine-tuned or requantized target of the same shape differs here. None for a target with
    no directory (built in memory)."""
    if not path or not os.path.isdir(path):
        return None
    real = os.path.realpath(path)
    files = {}
    for name in sorted(os.listdir(real)):
        full = os.path.join(real, name)
        if name.startswith(".") or name.endswith(".md") or not os.path.isfile(full):
            continue
        st = os.stat(full)
        files[name] = [st.st_size, st.st_mtime_ns]
    try:
        with open(os.path.join(real, "config.json")) as f:
            gguf = json.load(f).get("gguf_file")
    except (OSError, ValueError, AttributeError):
        gguf = None
    if isinstance(gguf, str) and os.path.isfile(gguf):
        st = os.stat(gguf)
        files[os.path.realpath(gguf)] = [st.st_size, st.st_mtime_ns]
    return {"dir": real, "files": files}


def _describe_target(ident: Optional[dict], name: Optional[str] = None) -> str:
    if ident is None:
        return "a target built in memory (no directory)"
    if name is None:
        return ident["dir"]
    where = name if os.path.isabs(name) else os.path.join(ident["dir"], name)
    entry = ident["files"].get(name)
    if entry is None:
        return f"{where} absent"
    when = datetime.datetime.fromtimestamp(entry[1] / 1e9).isoformat(sep=" ")
    return f"{where} {entry[0]} bytes, modified {when}"


def _target_change(old: Optional[dict], new: Optional[dict]) -> Optional[str]:
    """'journal: ...; given: ...' naming the first difference of two target identities, or
    None when they are the same."""
    if old == new:
        return None
    if old is None or new is None or old["dir"] != new["dir"]:
        return f"journal: {_describe_target(old)}; given: {_describe_target(new)}"
    for name in sorted(set(old["files"]) | set(new["files"])):
        if old["files"].get(name) != new["files"].get(name):
            return f"journal: {_describe_target(old, name)}; given: {_describe_target(new, name)}"
    return f"journal: {_describe_target(old)}; given: {_describe_target(new)}"


def journal_lines(path: str, target: Optional[dict]) -> List[str]:
    """The whole lines of the journal `path` (header first; a last line cut by an
    interruption is left out: that batch is redone), checked to be a journal of this version
    of the target `target` (`target_identity`): anything else is a ValueError, one line
    naming both targets, the file kept."""
    with open(path) as f:
        lines = f.read().split("\n")
    head = _json_or_none(lines[0])
    restart = f"delete or move {path} to start over"
    if not isinstance(head, dict) or "fingerprint" not in head:
        raise ValueError(f"{path}: not a regeneration journal (no header line); {restart}")
    if "target" not in head:
        raise ValueError(
            f"{path}: a journal of an earlier version of regenerate, which did not record the "
            f"target's files (its batches may come from another target); {restart}"
        )
    change = _target_change(head["target"], target)
    if change is not None:
        raise ValueError(
            f"{path}: an interrupted regeneration with another target ({change}); rerun it "
            f"with that target, or {restart}"
        )
    good = [lines[0]]
    for ln in lines[1:]:
        rec = _json_or_none(ln)
        if not isinstance(rec, dict) or "key" not in rec or "responses" not in rec:
            break  # a line cut by the interruption: that batch is redone
        good.append(ln)
    return good


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


def _journal(
    out_path, target, inputs, max_new_tokens, batch_size, temperature, top_p, seed, stop, on_batch
):
    """The `_Journal` of a regeneration of `inputs` with these settings (single process)."""
    fingerprint = _fingerprint(
        target, inputs, max_new_tokens=max_new_tokens, batch_size=batch_size,
        temperature=temperature, top_p=top_p, seed=seed, stop=[int(t) for t in stop],
    )  # fmt: skip
    return _Journal(
        out_path,
        fingerprint,
        enabled=not distributed.is_multiprocess(),
        target=target_identity(getattr(target, "path", None)),
        on_batch=on_batch,
    )


def check_settings(max_new_tokens, batch_size, temperature, top_p=None, seed=0, flag="") -> None:
    """The settings of a regeneration checked before anything loads or is written (one
    ValueError naming the first bad one, `flag` before its name: "--" for the CLI's flags):
    counts >= 1, temperature finite and >= 0, top_p in (0, 1], a 64-bit seed."""
    checks.int_param(flag + "batch_size", batch_size, lo=1)
    checks.int_param(flag + "max_new_tokens", max_new_tokens, lo=1)
    checks.float_param(flag + "temperature", temperature, lo=0.0)
    if top_p is not None:
        checks.float_param(flag + "top_p", top_p, lo=0.0, hi=1.0, lo_open=True)
    checks.seed_param(flag + "seed", seed)


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
    on_batch: Optional[Callable] = None,
) -> List[dict]:
    """Generates a response for each prompt (token-id lists) and writes `out_path` (JSONL).

    Batches have a fixed size (the last one is padded with repeats) so one compiled program
    serves them all. Written atomically (tmp file, then rename). Returns the records.
    `mesh`: generate on it; when it spans several processes, all of them call this with the
    same prompts, process 0 writes the file and all return once it is there. `on_batch()`:
    called once each finished batch is in the journal (`OUT.partial`).
    """
    check_settings(max_new_tokens, batch_size, temperature, top_p, seed)
    records = []
    prompts = checks.prompt_ids(prompts, target.config.vocab_size)
    context = target.config.max_position_embeddings
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > context:
            raise ValueError(
                f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} exceed the "
                f"target's context ({context})"
            )
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
        on_batch,
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
        try:
            with open(tmp, "w") as f:
                for rec in records:
                    f.write(json.dumps(rec) + "\n")
            os.replace(tmp, out_path)
        except BaseException:  # a full disk, Ctrl-C: no half-written file left behind
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
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
    on_batch: Optional[Callable] = None,
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
    -> ids; decode(ids) -> text (the records' "messages"). `on_batch()`: called once each
    finished batch is in the journal (`OUT.partial`)."""
    from dflash_jax.data.chat import chat_ids

    check_settings(max_new_tokens, batch_size, temperature, top_p, seed)
    convs = [[dict(m) for m in c if m["role"] != "assistant"] for c in conversations]
    users = [[j for j, m in enumerate(c) if m["role"] == "user"] for c in convs]
    if not convs or any(not u for u in users):
        why = "every conversation needs a user turn" if convs else "no conversations"
        raise ValueError(f"regenerate_chat: {why}")
    # Per conversation: the conversation so far (answers included), the answers' ids, turns.
    msgs, responses, turns = ([[] for _ in convs] for _ in range(3))
    stop = tuple(int(s) for s in stop_token_ids)
    # The settings checked once; each batch draws with its own seed (seed, turn, batch).
    settings = Settings(temperature=temperature, top_p=top_p, stop_token_ids=stop)
    gen = Generator(target, drafter, settings, mesh)
    journal = _journal(
        out_path, target, convs, max_new_tokens, batch_size, temperature, top_p, seed, stop,
        on_batch,
    )  # fmt: skip
    total = sum(len(u) for u in users)
    bar = console.progress(total=total, desc="regenerate", unit="turn")
    t0, done, n_batches = time.time(), 0, 0
    context = target.config.max_position_embeddings
    ended = set()  # conversations whose next prompt would not fit the context: cut there
    for k in range(max(len(u) for u in users)):
        active, prompts = _turn_prompts(
            k, convs, users, msgs, responses, ended, bar,
            lambda turn, done: chat_ids(render, encode, turn, done, True, stop)[0],
            context - max_new_tokens,
        )  # fmt: skip
        for b0 in range(0, len(active), batch_size):
            chunk = prompts[b0 : b0 + batch_size]
            outs = journal.get((k, b0))
            if outs is None:
                padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
                outs = gen(padded, max_new_tokens, seed=seed + 100003 * k + b0 // batch_size)
                outs = [[int(t) for t in r] for r in outs.tokens[: len(chunk)]]
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
    for i in (i for i in range(len(convs)) if responses[i]):
        ids, mask = chat_ids(render, encode, msgs[i], responses[i], False, stop)
        rec = {"input_ids": ids, "loss_mask": mask, "prompt_ids": turns[i][0]["prompt_ids"]}
        rec["turns"] = turns[i]
        if decode is not None:
            rec["messages"] = msgs[i]
        records.append(rec)
    _write_records(records, out_path)
    journal.finish()
    return records


def _turn_prompts(k, convs, users, msgs, responses, ended, bar, prompt_of, room):
    """(conversation indices, prompts) of turn k, shortest first (less padding): each
    conversation with a k-th user turn, its prompt `prompt_of(conversation so far, earlier
    responses)`; one whose prompt is longer than `room` (the context less max_new_tokens) ends
    here (`ended`; its remaining turns counted done on `bar`). `msgs` gains the user turn."""
    active, prompts = [], []
    for i in (i for i, u in enumerate(users) if len(u) > k and i not in ended):
        start = 0 if k == 0 else users[i][k - 1] + 1
        turn = msgs[i] + convs[i][start : users[i][k] + 1]  # (system,) user turn k
        p = prompt_of(turn, responses[i])
        if len(p) > room:
            ended.add(i)
            bar.update(len(users[i]) - k)
            continue
        msgs[i] = turn
        active.append(i)
        prompts.append(p)
    order = sorted(range(len(active)), key=lambda j: len(prompts[j]))
    return [active[j] for j in order], [prompts[j] for j in order]


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


def _interrupted_line(out_path: str) -> str:
    """What a run stopped by a signal leaves: the finished batches in OUT.partial."""
    journal = out_path + ".partial"
    try:
        with open(journal) as f:
            n = sum(isinstance(_json_or_none(ln), dict) for ln in f.read().split("\n")[1:])
    except OSError:
        n = 0
    if not n:
        return "interrupted: nothing was written"
    return (
        f"interrupted: {n} finished batch{'es' if n > 1 else ''} kept in {journal}; rerun the "
        "same command to resume"
    )


def check_out(out_path, prompts: Optional[str], target_dir: Optional[str] = None) -> None:
    """--out checked before anything loads or is written: a file (not a directory) in a
    directory that exists and is writable, or can be created; neither it nor a file written
    beside it (OUT.tmp, the journal OUT.partial and its OUT.partial.tmp) is an input (the
    --prompts file, a file of the --target directory or its GGUF file). ValueError, one line."""
    from dflash_jax.models.hub import ALLOW_PATTERNS

    if not isinstance(out_path, str) or not out_path:
        raise ValueError(f"--out must be a path, got {out_path!r}")
    files = {"--prompts": prompts}
    if target_dir is not None:
        gguf = (target_identity(target_dir) or {"files": {}})["files"]
        files.update({"--target's GGUF file": f for f in gguf if os.path.isabs(f)})
    for path in (out_path, out_path + ".tmp", out_path + ".partial", out_path + ".partial.tmp"):
        if os.path.isdir(path):
            raise ValueError(f"--out {out_path}: {path} is a directory")
        checks.output_not_input(
            path, "--out", files, {"--target": target_dir}, model_files=ALLOW_PATTERNS
        )
    checks.writable_dir(os.path.dirname(os.path.abspath(out_path)), f"--out {out_path}: directory")


def main(argv):
    del argv
    import signal
    import sys

    from absl import flags

    from dflash_jax.data import load_tokenizer
    from dflash_jax.models import hub
    from dflash_jax.models.checkpoint import read_target_config
    from dflash_jax.models.target import load_target
    from dflash_jax.support import interrupts

    F = flags.FLAGS
    # Every flag and output path checked before any model loads or any file is written.
    check_settings(F.max_new_tokens, F.batch_size, F.temperature, seed=F.seed, flag="--")
    check_out(F.out, F.prompts)
    from dflash_jax.support import locks

    locks.acquire(F.out, "--out")  # one run per --out: a second is refused, naming the first
    target_dir = hub.resolve_or_exit(F.target, what="--target")
    check_out(F.out, F.prompts, target_dir)
    context = read_target_config(target_dir).max_position_embeddings
    if F.max_new_tokens >= context:
        raise ValueError(
            f"--max_new_tokens {F.max_new_tokens} leaves no room for a prompt in the "
            f"target's context ({context} tokens)"
        )
    if not F.as_given and os.path.exists(F.out + ".partial"):  # resumed: the same target?
        journal_lines(F.out + ".partial", target_identity(target_dir))
        interrupts.guard(_interrupted_line(F.out))
    console.cli_startup()
    from dflash_jax.data.chat import read_conversations

    if not F.as_given:
        read_conversations(F.prompts)  # a bad row is an error before the target loads
    else:  # the conversations' own answers: no target pass here
        from dflash_jax.data.chat import template_renderer

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
            context=context,
        )
        n = sum(int(sum(r["loss_mask"])) for r in recs)
        console.say(
            f"{len(recs)} rows of {len(convs)} conversations as given ({how}): "
            f"{n} answer tokens -> {F.out}"
        )
        return
    target = load_target(target_dir)
    tok = load_tokenizer(target_dir)

    def saved():  # a batch is in OUT.partial: a signal from now on ends the run keeping it
        # Both explicitly: a SIGINT inherited ignored (a background job) is not ignored here
        # either, as it is not while guarded; SIGTERM raises `interrupts.Terminated`.
        interrupts.raise_on_sigterm()
        interrupts.release({signal.SIGINT: signal.default_int_handler})

    try:
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
            on_batch=saved,
        )
    except KeyboardInterrupt as e:  # SIGINT / SIGTERM after the first saved batch
        sys.stdout.flush()
        sys.stderr.write(_interrupted_line(F.out) + "\n")
        sys.exit(143 if isinstance(e, interrupts.Terminated) else 130)


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
