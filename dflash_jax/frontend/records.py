"""The JSON Lines file of infer.py's batch runner (`batch_runner.run_prompts`): its records,
the settings key a resumed file must match, and the writer that never loses a line.

Each record is one JSON line: {"index", "prompt_sha", "settings", "prompt_ids", "tokens",
"text" (with a tokenizer), "acceptance_lengths", "tau", "new_tokens", "batch",
"batch_decode_s", "tokens_per_s", "identical_to_ar" (with compare_ar)}; "tau" is null for a
prompt whose every token came from the prefill (max_new_tokens=1: no decode step ran).

The output file is not touched until the first batch is done: its lines (after the lines an
earlier run left, with --resume) go to a temporary file in the same directory that then
replaces the file in one rename; later batches are appended, each batch's lines in one write,
flushed. So a failed check or a crash before the first result leaves an existing file as it
was, and an interrupted run leaves complete records (a torn last line at most, which resume
drops). Resuming reads the file without changing it: every complete line must be a record of
this tool written for the same prompts (`prompt_sha`) and settings (`settings`), and a last line
without a newline must be the start of one (a torn write); anything else is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Dict, Optional, Sequence, Tuple


def prompt_sha(ids: Sequence[int]) -> str:
    return hashlib.sha1(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


def record(index, row, prompt, batch, settings, res, ar=None, tokenizer=None) -> dict:
    """The record of prompt `index`, row `row` of batch `batch` (`res`: its GenerationResult;
    `ar`: the autoregressive one of the same batch, or None)."""
    acc = [int(a) for a in res.acceptance_lengths[row]]
    toks = [int(t) for t in res.tokens[row]]
    rec = {
        "index": index,
        "prompt_sha": prompt_sha(prompt),
        "settings": settings,
        "prompt_ids": prompt,
        "tokens": toks,
        "acceptance_lengths": acc,
        "tau": float(sum(acc) / len(acc)) if acc else None,  # no decode step ran
        "new_tokens": len(toks),
        "batch": batch,
        "batch_decode_s": res.stats["decode_s"],
        "prefill_s": res.stats["prefill_s"],
        "compile_s": res.stats["compile_s"],
        "tokens_per_s": sum(acc) / max(res.stats["decode_s"], 1e-9),
    }
    if tokenizer is not None:
        rec["text"] = tokenizer.decode(toks)
    if ar is not None:
        rec["identical_to_ar"] = ar.tokens[row] == res.tokens[row]
        rec["ar_batch_decode_s"] = ar.stats["decode_s"]
        rec["ar_decode_tokens"] = int(sum(ar.acceptance_lengths[row]))
        rec["ar_tokens_per_s"] = rec["ar_decode_tokens"] / max(ar.stats["decode_s"], 1e-9)
    return rec


def settings_key(settings: dict) -> str:
    return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_settings(
    gen_kw: dict, batch_size: int, with_drafter: bool, extra: Optional[dict] = None
) -> str:
    """The `settings` key of `run_prompts`' records: what must match for --resume."""
    gen = dict(gen_kw)
    seed = int(gen.pop("seed", 0))
    if gen.get("mesh") is not None:  # the layout, not device objects
        gen["mesh"] = dict(gen["mesh"].shape)
    return settings_key(
        {
            "gen": gen,
            "seed": seed,
            "batch_size": batch_size,
            "drafter": with_drafter,
            **(extra or {}),
        }
    )


def model_identity(name: Optional[str]) -> Optional[str]:
    """What a resumed file must match for a model: the real path of a directory (so the same
    model named by another relative path or a link matches, and another model at the same
    relative path elsewhere does not); a hub id as it is."""
    if name is None:
        return None
    return os.path.realpath(name) if os.path.isdir(name) else str(name)


# How every record line starts (json.dumps keeps the key order of `run_prompts`' dicts): the
# one thing a torn last line (a write cut short) must show to be taken for this tool's.
RECORD_START = b'{"index": '


def _check_record(path, n, line: bytes, prompts, settings) -> dict:
    try:
        rec = json.loads(line)
        i = int(rec["index"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f"{path}:{n}: not a record of this tool; remove the file or choose another --json_out"
        ) from None
    if not 0 <= i < len(prompts) or rec.get("prompt_sha") != prompt_sha(prompts[i]):
        raise ValueError(
            f"{path}:{n}: written for a different prompt {i} (another prompt "
            "file?); remove it or choose another --json_out to start afresh"
        )
    if rec.get("settings") != settings:
        raise ValueError(
            f"{path}:{n}: written with other generation settings (model, "
            "max_new_tokens, temperature, seed, block size, batch size ...); "
            "rerun with the same flags or choose another --json_out"
        )
    return rec


def read_records(
    path: str, prompts: Sequence[Sequence[int]], settings: str
) -> Tuple[Dict[int, dict], int]:
    """(finished records of an earlier run in `path` by prompt index, the length in bytes of
    its complete lines). Reads only: a torn last line (the run was killed mid-write) is left
    where it is and replaced when the first new batch is written. Raises ValueError (one line)
    when a line is not a record of this tool, or was written for other prompts or settings."""
    done: Dict[int, dict] = {}
    if not os.path.exists(path):
        return done, 0
    with open(path, "rb") as f:
        data = f.read()
    keep = data.rfind(b"\n") + 1  # complete lines only
    lines = data[:keep].split(b"\n")[:-1]
    for n, line in enumerate(lines, 1):  # a blank line is not one of ours either
        rec = _check_record(path, n, line, prompts, settings)
        done[int(rec["index"])] = rec
    tail = data[keep:]
    if tail:
        try:
            json.loads(tail)
            whole = True
        except ValueError:
            whole = False
        if whole:  # a complete line that lost its newline: it must still be a record of ours
            _check_record(path, len(lines) + 1, tail, prompts, settings)
        elif not tail.startswith(RECORD_START):
            raise ValueError(
                f"{path}:{len(lines) + 1}: not a record of this tool; remove the file or "
                "choose another --json_out"
            )
    return done, keep


def read_done(path: str, prompts: Sequence[Sequence[int]], settings: str) -> Dict[int, dict]:
    """Finished records of an earlier run in `path` (JSONL), by prompt index (`read_records`;
    the file is not changed). Raises ValueError (one line) when the file is not this tool's
    or belongs to other prompts or settings."""
    return read_records(path, prompts, settings)[0]


class RecordWriter:
    """The output file of `run_prompts`. The first `write` puts the `keep` first bytes of the
    existing file (an earlier run's complete lines, on resume) and its lines into a temporary
    file in the same directory, which then replaces the file (through a symbolic link: the
    file it names) in one rename; later writes append, one write each, flushed. Nothing
    exists or changes on disk before the first write."""

    def __init__(self, path: str, keep: int = 0):
        self.path = os.path.realpath(path)
        self.keep = keep
        self._f = None

    def write(self, text: str) -> None:
        data = text.encode()
        if self._f is not None:
            self._f.write(data)
            self._f.flush()
            os.fsync(self._f.fileno())
            return
        folder, name = os.path.split(self.path)
        os.makedirs(folder, exist_ok=True)
        prefix = b""
        if self.keep:
            with open(self.path, "rb") as f:
                prefix = f.read(self.keep)
        if os.path.exists(self.path):
            mode = os.stat(self.path).st_mode & 0o7777
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(prefix + data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self._f = open(self.path, "ab")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
