"""Chat-format regeneration: templated multi-turn prompts, exact assistant spans, data errors."""

import json
import os
import shutil

import pytest

from dflash_jax.data import chat, load_tokenizer, prompting
from dflash_jax.training import regenerate as regen

# ChatML, as Qwen's templates write it (system, user, assistant turns; generation prompt).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]


def _char_tokenizer(vocab_size):
    """One token per character (no merges): decode is concatenation, so a row decodes to the
    text the template wrote around the exact response ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    chars += [chr(0xC0 + i) for i in range(vocab_size - len(SPECIALS) - len(chars))]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return tok


@pytest.fixture(scope="module")
def chat_target(hf_checkpoints, tmp_path_factory):
    """conftest's small random Qwen3 (vocab 128) with a character tokenizer and a chat
    template; eos (the stop token) is <|im_end|>."""
    src, model = hf_checkpoints["qwen3_tied"]
    d = str(tmp_path_factory.mktemp("chat_target"))
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), d)
    _char_tokenizer(model.config.vocab_size).save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "mask_token": "<|mask|>",
                "chat_template": TEMPLATE,
            },
            f,
        )
    from dflash_jax.models.target import load_target

    return d, load_target(d), load_tokenizer(d)


ROWS = [
    # ShareGPT, system + two user turns (the assistant values are placeholders).
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi there"},
            {"from": "gpt", "value": "old answer"},
            {"from": "human", "value": "And 2+2?"},
            {"from": "gpt", "value": "4"},
        ]
    },
    # OpenAI messages, three user turns, the last without an answer.
    {
        "messages": [
            {"role": "user", "content": "def f(x):"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "y"},
            {"role": "user", "content": "last one"},
        ]
    },
    # Plain prompt.
    {"prompt": "Write a haiku."},
]


def _runs(ids, mask):
    """Maximal runs of mask == 1, as id lists."""
    runs, cur = [], None
    for t, m in zip(ids, mask):
        if m:
            cur = [] if cur is None else cur
            cur.append(t)
        elif cur is not None:
            runs.append(cur)
            cur = None
    return runs + ([cur] if cur is not None else [])


def test_multi_turn_rows_mask_exactly_the_regenerated_answers(chat_target, tmp_path):
    import dflash_jax as dj

    d, target, tok = chat_target
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    out = str(tmp_path / "regen.jsonl")
    n_new, eos = 6, tok.eos_id
    recs = regen.regenerate_from_file(
        target, tok, d, str(data), out, max_new_tokens=n_new, batch_size=2, stop_token_ids=(eos,)
    )
    assert [json.loads(l) for l in open(out)] == recs
    assert regen.read_records(out, vocab_size=128) == recs  # chat rows pass the reader
    render = lambda msgs, gen: prompting.render_chat(TEMPLATE, msgs, add_generation_prompt=gen)
    convs = chat.read_conversations(str(data))
    assert [len(r["turns"]) for r in recs] == [2, 3, 1]
    for conv, rec in zip(convs, recs):
        so_far, users = [], iter(m for m in conv if m["role"] == "user")
        if conv[0]["role"] == "system":
            so_far.append(conv[0])
        for turn in rec["turns"]:
            so_far.append(next(users))
            p, r = turn["prompt_ids"], turn["response_ids"]
            # The prompt is the conversation so far (earlier answers regenerated) through the
            # chat template, with the generation prompt ...
            assert tok.decode(p) == render(so_far, True)
            # ... and the answer is the target's greedy continuation of it.
            ar = dj.generate(target, None, [p], n_new, stop_token_ids=(eos,))
            assert r == ar.tokens[0]
            assert 1 <= len(r) <= n_new and (len(r) == n_new or r[-1] == eos)
            text = tok.decode(r[:-1] if r[-1] == eos else r)
            so_far.append({"role": "assistant", "content": text})
            # The answer was generated in the context the training row gives it.
            assert rec["input_ids"][: len(p)] == p
        ids, mask = rec["input_ids"], rec["loss_mask"]
        # The row is the templated conversation ...
        assert tok.decode(ids) == render(so_far, False)
        # ... whose loss mask covers exactly the answers: one run per turn, nothing else.
        assert _runs(ids, mask) == [t["response_ids"] for t in rec["turns"]]
        assert sum(mask) == sum(len(t["response_ids"]) for t in rec["turns"])
        assert rec["prompt_ids"] == rec["turns"][0]["prompt_ids"]
        got_ids, got_mask = regen.record_tokens(rec)
        assert got_ids.tolist() == ids and got_mask.tolist() == mask


def test_stop_token_is_kept_once_in_the_answer():
    """A response ending on the stop token the template also writes after the content keeps it
    once, with loss (the drafter learns to end turns); a cut response gets the template's."""
    render = lambda msgs, gen: prompting.render_chat(TEMPLATE, msgs, add_generation_prompt=gen)
    enc = {"<|im_start|>": [1], "<|im_end|>": [2]}

    def encode(text):  # specials as ids 1, 2; other characters 10 + ord % 100
        out, i = [], 0
        while i < len(text):
            for s, t in enc.items():
                if text.startswith(s, i):
                    out += t
                    i += len(s)
                    break
            else:
                out.append(10 + ord(text[i]) % 100)
                i += 1
        return out

    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]
    ids, mask = chat.chat_ids(render, encode, msgs, [[50, 51, 2]], False, stop_ids=(2,))
    assert ids.count(2) == 2 and _runs(ids, mask) == [[50, 51, 2]]  # user's <|im_end|> + one
    ids, mask = chat.chat_ids(render, encode, msgs, [[50, 51]], False, stop_ids=(2,))
    assert _runs(ids, mask) == [[50, 51]] and ids[ids.index(51) + 1] == 2
    with pytest.raises(ValueError, match="once and in order"):
        chat.chat_ids(lambda m, g: "no answers here", encode, msgs, [[5]], False)


@pytest.mark.parametrize(
    "row, message",
    [
        ("{oops", "not valid JSON"),
        (json.dumps({"conversations": [{"from": "robot", "value": "x"}]}), "has role 'robot'"),
        (
            json.dumps({"messages": [{"role": "assistant", "content": "x"}]}),
            "must start with a user turn",
        ),
        (json.dumps({"messages": [{"role": "user"}]}), "needs a string content"),
        (
            json.dumps(
                {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
            ),
            "two user turns in a row",
        ),
        (
            json.dumps(
                {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}
            ),
            "system message may only",
        ),
        (json.dumps({"prompt": "a", "messages": []}), "exactly one of"),
        (json.dumps([1, 2]), "expected a JSON object"),
    ],
)
def test_bad_rows_are_one_line_errors_naming_file_and_line(tmp_path, row, message):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + row + "\n")
    with pytest.raises(ValueError) as e:
        chat.read_conversations(str(path))
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_multi_turn_without_a_template_is_an_error():
    with pytest.raises(ValueError, match="need a chat template"):
        chat.plain_render(
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ],
            True,
        )


def _default_config():
    from configs.default import get_config

    return get_config()


def test_trainer_regenerates_chat_rows_from_a_prompt_file(chat_target, tmp_path):
    from dflash_jax.training import config_checks
    from dflash_jax.training import experiment, trainer

    d, _, tok = chat_target
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    out_file = str(tmp_path / "rows.jsonl")
    c = _default_config()
    c.target_path = d
    c.data.kind = "regenerated"
    c.data.seq_len, c.data.batch_size = 64, 2
    c.drafter.num_layers, c.drafter.num_taps, c.drafter.block_size = 1, 2, 4
    c.regen.update(
        prompt_source="file",
        prompt_file=str(data),
        output=out_file,
        only=True,
        max_new_tokens=4,
        batch_size=4,
        holdout_fraction=0.3,
    )
    config_checks.check_train_config(c)
    res = trainer.train_and_evaluate(c, str(tmp_path / "work"))
    assert res["status"] == "regenerated"
    recs = regen.read_records(out_file, vocab_size=128)
    assert [len(r["turns"]) for r in recs] == [2, 3, 1]
    for r in recs:  # rows through the template; loss only on the answers
        assert tok.decode(r["input_ids"]).startswith("<|im_start|>")
        assert _runs(r["input_ids"], r["loss_mask"]) == [t["response_ids"] for t in r["turns"]]
    # The experiment trains on those rows: its batches carry the rows' loss masks.
    exp = experiment.build_experiment(c, str(tmp_path / "work"))
    batch = next(exp.train_iter)
    assert 0 < batch["loss_mask"].sum() < batch["loss_mask"].size
    for bad, message in [
        (dict(prompt_file=""), "needs regen.prompt_file"),
        (dict(prompt_file=str(tmp_path / "nope.jsonl")), "no such file"),
        (dict(chat_template="yes"), "regen.chat_template must be True or"),
    ]:
        import ml_collections

        d2 = _default_config().to_dict()
        d2["regen"].update({"prompt_source": "file", "prompt_file": str(data), **bad})
        c2 = ml_collections.ConfigDict(d2)  # a config file can hold any type
        with pytest.raises(config_checks.ConfigError, match=message):
            config_checks.check_train_config(c2)


def test_conversations_end_where_the_next_prompt_would_not_fit(chat_target, tmp_path):
    d, target, tok = chat_target
    render, _ = chat.template_renderer(d)
    long = "z" * (target.config.max_position_embeddings + 10)  # one token per character
    convs = [
        [{"role": "user", "content": "hi"}, {"role": "user", "content": long}],
        [{"role": "user", "content": long}],
    ]
    recs = regen.regenerate_chat(
        target,
        convs,
        str(tmp_path / "r.jsonl"),
        render=render,
        encode=tok.encode,
        max_new_tokens=4,
        batch_size=2,
        stop_token_ids=(tok.eos_id,),
    )
    assert len(recs) == 1 and len(recs[0]["turns"]) == 1  # cut before turn 2; one dropped
    assert long not in tok.decode(recs[0]["input_ids"])


def test_an_interrupted_regeneration_resumes_from_its_finished_batches(
    chat_target, tmp_path, monkeypatch
):
    """Stopped after two batches (an exception from generation, as Ctrl-C would raise), the run
    leaves OUT.partial with those batches; rerun, it generates only the others (a cut last line
    is redone) and writes what an uninterrupted run writes, then removes OUT.partial. Other
    settings against the partial file are one line, the file kept."""
    d, target, tok = chat_target
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    kw = dict(max_new_tokens=5, batch_size=1, stop_token_ids=(tok.eos_id,))
    ref = regen.regenerate_from_file(target, tok, d, str(data), str(tmp_path / "ref.jsonl"), **kw)
    assert not os.path.exists(tmp_path / "ref.jsonl.partial")

    real, calls = regen.Generator.__call__, []  # each batch: one call of the run's Generator

    def stopping(*a, **k):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **k)

    out = str(tmp_path / "out.jsonl")
    monkeypatch.setattr(regen.Generator, "__call__", stopping)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate_from_file(target, tok, d, str(data), out, **kw)
    partial = out + ".partial"
    assert not os.path.exists(out) and len(open(partial).read().splitlines()) == 1 + 3
    with open(partial, "a") as f:
        f.write('{"key": [1, 0], "respo')  # a batch cut mid-line by the interruption
    saved = open(partial).read()

    with pytest.raises(ValueError, match=r"out\.jsonl\.partial: an interrupted regeneration"):
        regen.regenerate_from_file(target, tok, d, str(data), out, **dict(kw, max_new_tokens=4))
    assert open(partial).read() == saved  # refused, kept

    calls.clear()
    monkeypatch.setattr(
        regen.Generator, "__call__", lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    )
    got = regen.regenerate_from_file(target, tok, d, str(data), out, **kw)
    assert got == ref and [json.loads(l) for l in open(out)] == ref
    assert len(calls) == 6 - 3  # 6 turns in batches of 1: the 3 recorded ones are not redone
    assert not os.path.exists(partial)


def test_rows_as_given_keep_the_conversations_own_answers(chat_target, tmp_path):
    """Teacher-forced data (`regenerate --as_given`): the conversation with its own assistant
    answers (each cut to max_new_tokens, then the stop id) through the template, the loss mask
    exactly on those answers, the first turn's generation prompt as prompt_ids; no target."""
    d, _, tok = chat_target
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    convs = regen.given_conversations(str(data))
    assert [m["role"] for m in convs[0]] == ["system", "user", "assistant", "user", "assistant"]
    render = lambda msgs, gen: prompting.render_chat(TEMPLATE, msgs, add_generation_prompt=gen)
    eos = tok.eos_id
    out = str(tmp_path / "given.jsonl")
    recs = regen.rows_as_given(
        convs, out, render=render, encode=tok.encode, max_new_tokens=5, stop_token_ids=(eos,)
    )
    assert [json.loads(l) for l in open(out)] == recs
    assert len(recs) == 2  # the plain prompt has no answer to learn
    answers = [["old answer", "4"], ["x", "y"]]
    for rec, conv, given in zip(recs, convs, answers):
        want = [tok.encode(a)[:5] + [eos] for a in given]
        assert _runs(rec["input_ids"], rec["loss_mask"]) == want
        kept = [m for m in conv if m["role"] != "assistant"][: 1 + (conv[0]["role"] == "system")]
        assert tok.decode(rec["prompt_ids"]) == render(kept, True)
    with pytest.raises(ValueError, match=r"given.jsonl:1: no 'messages'"):
        (tmp_path / "given.jsonl").write_text('{"text": "x"}\n')
        regen.given_conversations(str(tmp_path / "given.jsonl"))
