"""Prompt text that once reached the tokenizer and broke there (issue #66, class 6), refused in
one line naming where it came from (the prompt file and line, or --prompt), before anything is
tokenized: bytes that are not UTF-8 (a Latin-1 "café" from a shell arrives in argv as the
surrogate U+DCE9, Python's surrogateescape), a lone surrogate (a JSON "\\ud800" escape without
its pair), JSON nested deeper than `MAX_JSON_DEPTH`, a prompt over `MAX_PROMPT_CHARS` characters
or a line over `MAX_LINE_BYTES` bytes.

The reference for "not text": Python's own UTF-8 codec (strict) and the tokenizer itself, which
is shown to fail on the same strings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dflash_jax.data import load_tokenizer, prompting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "assets", "tiny-code", "target")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TARGET)


def _file(tmp_path, *lines: bytes):
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    return str(p)


def _refused(call, *needles):
    with pytest.raises(ValueError) as e:
        call()
    text = str(e.value)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, (needle, text)
    return text


# ------------------------------------------------------------------------------ not text


@pytest.mark.parametrize(
    "line, needles",
    [
        # a JSON escape of half a UTF-16 pair: valid JSON, not a character
        (b'{"prompt": "caf\\ud800!"}', ["prompts.jsonl:2: 'prompt': a lone surrogate U+D800 at character 3"]),
        (b'"\\udfff"', ["prompts.jsonl:2: 'prompt': a lone surrogate U+DFFF at character 0"]),
        (
            b'{"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "a\\udc80"}]}',
            ["prompts.jsonl:2: messages[1].content: a lone surrogate U+DC80 at character 1"],
        ),
        (
            b'{"messages": [{"role": "us\\ud83der", "content": "hi"}]}',
            ["prompts.jsonl:2: messages[0].role: a lone surrogate U+D83D"],
        ),
        # Latin-1 bytes: not UTF-8; the first bad byte and where it is
        ('{"prompt": "café"}'.encode("latin-1"), ["prompts.jsonl:2: not UTF-8 text: byte 0xE9 at byte 15"]),
    ],
)  # fmt: skip
def test_prompt_file_text_that_is_not_unicode_refused(tmp_path, tok, line, needles):
    """Refused when the file is read, naming the file and line; the tokenizer (the reference)
    fails on the same string when it is valid JSON."""
    path = _file(tmp_path, b'{"prompt": "fine"}', line)
    _refused(lambda: prompting.read_prompt_file(path), *needles)
    try:
        item = json.loads(line)
    except UnicodeDecodeError:
        return  # the Latin-1 line: not even JSON text
    text = item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)
    with pytest.raises(Exception):  # noqa: B017 - the tokenizer's own error, a traceback
        tok.encode(text)


def test_encode_prompts_refuses_a_lone_surrogate_not_the_tokenizer(tok):
    """The library path (items given in code, no file): one line naming the item."""
    _refused(
        lambda: prompting.encode_prompts([{"prompt": "x\ud800"}], tok, TARGET),
        "prompt 0: 'prompt': a lone surrogate U+D800 at character 1",
    )


def test_check_text_states_the_escaped_byte():
    """surrogateescape keeps byte b as U+DC00 + b: for argv the message gives the byte back
    (elsewhere it is a lone surrogate); real characters (any plane) pass untouched."""
    argv = b"caf\xe9 na\xefve".decode("utf-8", "surrogateescape")
    _refused(
        lambda: prompting.check_text("--prompt", argv, from_bytes=True),
        "--prompt: not UTF-8 text: byte 0xE9 at character 3",
    )
    _refused(lambda: prompting.check_text("p", argv), "p: a lone surrogate U+DCE9 at character 3")
    good = "café 🤖 日本 \U0010fffd"
    assert prompting.check_text("--prompt", good) is good


# ------------------------------------------------------------------------------ sizes


def test_nested_json_refused_in_one_line(tmp_path):
    """Nesting past Python's parser (a RecursionError once) and past the stated limit, both one
    line; the deepest legitimate line (messages, depth 3) and a line at the limit pass."""
    deep = b"[" * 100_000 + b"]" * 100_000
    path = _file(tmp_path, b'"ok"', deep)
    _refused(lambda: prompting.read_prompt_file(path), "prompts.jsonl:2: JSON nested more than 64")
    over = b'{"prompt": "x", "meta": ' + b"[" * 64 + b"]" * 64 + b"}"
    _refused(
        lambda: prompting.read_prompt_file(_file(tmp_path, over)), "prompts.jsonl:1: JSON nested"
    )
    at = b'{"prompt": "x", "meta": ' + b"[" * 63 + b"]" * 63 + b"}"
    msgs = b'{"messages": [{"role": "user", "content": "[[[{}]]]"}]}'
    assert len(prompting.read_prompt_file(_file(tmp_path, at, msgs))) == 2


def test_oversized_prompt_refused_before_tokenizing(tmp_path):
    """A 12 MB prompt line (tokenized for 42 s before the context check refused it) is refused
    as it is read, by the stated character limit; the limit is inclusive."""
    assert prompting.MAX_PROMPT_CHARS == 16 * prompting.LARGEST_CONTEXT == 4_194_304
    line = json.dumps({"prompt": "def f():\n    return 1\n" * 550_000}).encode()
    assert len(line) > 12_000_000
    path = _file(tmp_path, line)
    t0 = time.perf_counter()
    _refused(
        lambda: prompting.read_prompt_file(path),
        "prompts.jsonl:1: 'prompt': 12,100,000 characters, over the limit of 4,194,304",
        "refused before tokenizing",
    )
    assert time.perf_counter() - t0 < 5  # read and parsed, never tokenized
    limit = "a" * prompting.MAX_PROMPT_CHARS
    assert prompting.check_text("p", limit) is limit
    _refused(lambda: prompting.check_text("p", limit + "a"), "4,194,305 characters")
    many = [{"role": "user", "content": "a" * 1_500_000}] * 3  # each under, together over
    _refused(
        lambda: prompting.check_prompt_item({"messages": many}, "m"),
        "m: the messages hold 4,500,012 characters",
    )


def test_line_over_the_byte_limit_refused_before_parsing(tmp_path):
    """A line longer than `max_line_bytes` is refused without being read whole; a line of
    exactly the limit (its newline aside) is read. The default leaves room for a prompt of the
    character limit written as \\uXXXX escapes (6 bytes a character) and its JSON."""
    assert prompting.MAX_LINE_BYTES >= 6 * prompting.MAX_PROMPT_CHARS + 1024
    exact = b'"' + b"a" * 998 + b'"'  # 1,000 bytes
    path = _file(tmp_path, exact, exact + b" ")
    rows = prompting.iter_jsonl(path, max_line_bytes=1000)
    assert next(rows)[0] == 1
    _refused(lambda: next(rows), "prompts.jsonl:2: a line over the limit of 1,000 bytes")


# ------------------------------------------------------------------------------ infer.py


def test_infer_prompt_not_utf8_one_line(tmp_path):
    """The user's path: a Latin-1 "café" as --prompt (bytes in argv; Python decodes them with
    surrogateescape) is refused with exit 2 and one line naming --prompt, before any model is
    resolved or loaded."""
    r = subprocess.run(
        [sys.executable, "infer.py", b"--prompt=caf\xe9", "--max_new_tokens=2"],
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, "LC_ALL": "C.UTF-8", "PYTHONUTF8": "1"},
        timeout=300,
    )
    err = r.stderr.decode("utf-8", "replace")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert r.returncode == 2, err[-800:]
    assert lines[-1].startswith("error: --prompt: not UTF-8 text: byte 0xE9 at character 3"), err
    assert "Traceback" not in err
