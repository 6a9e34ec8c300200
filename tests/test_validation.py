"""The validation layer (dflash_jax/support/checks.py), prompt files, sandboxed chat templates,
confined safetensors indexes, and the CLIs' one-line errors (subprocess)."""

import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.models.target import init_params
from dflash_jax.data import prompting
from dflash_jax.frontend import infer_flags
from dflash_jax.support import checks
from dflash_jax.training import config_checks
from dflash_jax.support.checks import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------- table over the layer

V = 100
GOOD, BAD = "ok", "error"

CASES = [
    # (call, expected: value or (BAD, message fragment))
    (lambda: checks.int_param("block_size", 8), 8),
    (lambda: checks.int_param("block_size", np.int64(8)), 8),
    (lambda: checks.int_param("block_size", 8.0), (BAD, "must be an integer, got 8.0")),
    (lambda: checks.int_param("block_size", True), (BAD, "must be an integer")),
    (lambda: checks.int_param("block_size", "8"), (BAD, "must be an integer")),
    (lambda: checks.int_param("x", 0, lo=1), (BAD, "x must be >= 1, got 0")),
    (lambda: checks.int_param("x", 65, lo=2, hi=64), (BAD, "in [2, 64]")),
    (lambda: checks.float_param("t", 1), 1.0),
    (lambda: checks.float_param("t", float("nan")), (BAD, "finite")),
    (lambda: checks.float_param("t", float("inf")), (BAD, "finite")),
    (lambda: checks.float_param("t", "1"), (BAD, "must be a number")),
    (lambda: checks.sampling_params(0.7, 5, 0.9), (0.7, 5, 0.9)),
    (lambda: checks.sampling_params(0, None, None), (0.0, None, None)),
    (lambda: checks.sampling_params(float("nan"), None, None), (BAD, "temperature")),
    (lambda: checks.sampling_params(-0.1, None, None), (BAD, "temperature must be >= 0")),
    (lambda: checks.sampling_params(1.0, None, 0.0), (BAD, "top_p must be in (0.0, 1.0]")),
    (lambda: checks.sampling_params(1.0, None, -0.5), (BAD, "top_p")),
    (lambda: checks.sampling_params(1.0, None, 1.5), (BAD, "top_p")),
    (lambda: checks.sampling_params(1.0, None, float("nan")), (BAD, "top_p")),
    (lambda: checks.sampling_params(1.0, 0, None), (BAD, "top_k must be >= 1")),
    (lambda: checks.sampling_params(1.0, -3, None), (BAD, "top_k must be >= 1")),
    (lambda: checks.sampling_params(1.0, 2.5, None), (BAD, "top_k must be an integer")),
    # Greedy samples nothing: a top-k or nucleus filter there is refused, never ignored.
    (lambda: checks.sampling_params(0, 5, None), (BAD, "top_k needs temperature > 0")),
    (lambda: checks.sampling_params(0.0, None, 0.9), (BAD, "top_p needs temperature > 0")),
    (lambda: checks.confidence_threshold(0.5), 0.5),
    (lambda: checks.confidence_threshold(None), None),
    (lambda: checks.confidence_threshold(2), (BAD, "confidence_threshold must be in")),
    (lambda: checks.confidence_threshold(-1), (BAD, "confidence_threshold")),
    (lambda: checks.prompt_ids([[1, 2], (3,)], V), [[1, 2], [3]]),
    (lambda: checks.prompt_ids(np.array([[1, 2]]), V), [[1, 2]]),
    (lambda: checks.prompt_ids([1, 2, 3], V), (BAD, "flat list of 3 ints")),
    (lambda: checks.prompt_ids("def f", V), (BAD, "list of token-id lists")),
    (lambda: checks.prompt_ids(["a b", "c"], V), (BAD, "prompt 0 is a string")),
    (lambda: checks.prompt_ids([["1", "2"]], V), (BAD, "prompt 0[0] must be an integer")),
    (
        lambda: checks.prompt_ids([[1.5, 2]], V),
        (BAD, "prompt 0[0] must be an integer token id, got 1.5"),
    ),
    (lambda: checks.prompt_ids([[1, 2.0]], V), (BAD, "prompt 0[1]")),
    (lambda: checks.prompt_ids([[1], []], V), (BAD, "prompt 1 is empty")),
    (lambda: checks.prompt_ids([], V), (BAD, "non-empty")),
    (lambda: checks.prompt_ids([[1, 100]], V), (BAD, "outside [0, 100): 100")),
    (lambda: checks.prompt_ids([[-1]], V), (BAD, "outside")),
    (lambda: checks.stop_id_tuple([5, 3, 5], V), (3, 5)),
    (lambda: checks.stop_id_tuple([], V), ()),
    (lambda: checks.stop_id_tuple([100], V), (BAD, "stop_token_ids has token ids outside")),
    (lambda: checks.stop_id_tuple(7, V), (BAD, "must be a list")),
    (lambda: checks.block_size_for(8, 16), 8),
    (lambda: checks.block_size_for(8.0, 16), (BAD, "block_size must be an integer")),
    (lambda: checks.block_size_for(1, 16), (BAD, "block_size must be in [2, 64]")),
    (lambda: checks.writable_file("/nonexistent_dir_i19/out.json"), (BAD, "does not exist")),
    (lambda: checks.writable_file("/etc/hostname/x.json"), (BAD, "does not exist")),
    (lambda: checks.writable_file(ROOT), (BAD, "is a directory")),
    (lambda: checks.writable_dir("/etc/hostname/sub"), (BAD, "is not a directory")),
]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_validation_table(i):
    call, expected = CASES[i]
    if isinstance(expected, tuple) and expected and expected[0] == BAD:
        with pytest.raises(ValueError) as e:
            call()
        assert expected[1] in str(e.value) and "\n" not in str(e.value)
    else:
        assert call() == expected


def test_a_json_file_with_a_number_that_is_not_finite_names_the_field(tmp_path):
    """NaN, Infinity and 1e999 (Python's reader takes them, JSON does not) anywhere in a JSON
    object file (a model's config.json) are one line naming the file and the field; finite
    numbers and strings pass."""
    p = tmp_path / "config.json"
    for text, field, value in (
        ('{"dflash_config": {"output_multiplier": NaN}}', "dflash_config.output_multiplier", "nan"),
        ('{"a": [1.0, {"b": -Infinity}]}', "a[1].b", "-inf"),
        ('{"rms_norm_eps": 1e999}', "rms_norm_eps", "inf"),
    ):
        p.write_text(text)
        with pytest.raises(ValueError) as e:
            checks.json_object_file(str(p))
        assert str(e.value) == f"{p}: {field} must be a finite number, got {value}"
    p.write_text('{"a": [1.5, {"b": 1e300}], "c": "NaN"}')
    assert checks.json_object_file(str(p)) == {"a": [1.5, {"b": 1e300}], "c": "NaN"}


def test_block_size_beyond_the_drafter_warns_explicitly():
    with pytest.warns(UserWarning, match="larger than the drafter's trained block size 16"):
        assert checks.block_size_for(32, 16) == 32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checks.block_size_for(16, 16)


def _cfg(**kw):
    from configs import tiny_test

    c = tiny_test.get_config()
    for key, value in kw.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return c


CONFIG_CASES = [
    ({"drafter.block_size": 1}, "drafter.block_size must be in [2, 64], got 1"),
    ({"data.batch_size": 0}, "data.batch_size must be >= 1, got 0"),
    ({"num_anchors": 0}, "num_anchors must be >= 1, got 0"),
    ({"learning_rate": float("nan")}, "learning_rate must be a finite number"),
    ({"mode": "drafterr"}, "did you mean 'drafter'?"),
    ({"gamma": 0.0}, "gamma must be > 0.0, got 0.0"),
    ({"regen.holdout_fraction": 1.5}, "regen.holdout_fraction must be in [0.0, 1.0]"),
    ({"keep_checkpoints": 0}, "keep_checkpoints must be >= 1"),
    ({"num_train_steps": 0}, "num_train_steps must be >= 1"),
    ({"stop_at_step": 0}, "stop_at_step must be >= 1 (or -1: run the whole schedule), got 0"),
    ({"mask_schedule": "mdml"}, "did you mean 'mdlm'?"),
    ({"mask_full_fraction": 1.5}, "mask_full_fraction must be a number in [0, 1], got 1.5"),
    ({"drafter.kind": "eagle"}, "did you mean 'eagle3'?"),
    (
        {"drafter.kind": "eagle3", "drafter.target_layer_ids": (0, 1)},
        "an eagle3 drafter reads 3 target layers",
    ),
    (
        {"drafter.kind": "eagle3", "drafter.target_layer_ids": (), "drafter.eagle3.ttt_steps": 0},
        "drafter.eagle3.ttt_steps must be in [1, 32], got 0",
    ),
    (
        {"drafter.kind": "eagle3", "drafter.target_layer_ids": (), "drafter.eagle3.ttt_decay": 0},
        "drafter.eagle3.ttt_decay must be",
    ),
    (
        {"drafter.kind": "eagle3", "drafter.target_layer_ids": (), "loss": "kl"},
        "drafter.kind='eagle3' trains in mode 'drafter' with loss 'ce'",
    ),
]


@pytest.mark.parametrize("kw,message", CONFIG_CASES)
def test_train_config_values_are_checked(kw, message):
    with pytest.raises(ConfigError) as e:
        config_checks.check_train_config(_cfg(**kw))
    assert message in str(e.value)


def test_the_config_checks_ask_the_drafters_training_kind(monkeypatch):
    """`check_train_config` asks config.drafter.kind's training kind
    (`drafter_setup.TRAINED_KINDS`) for that kind's settings and its reading of the shared ones;
    a registered drafter kind that no training kind trains is refused with the trained ones."""
    from dflash_jax.training import drafter_setup

    with pytest.raises(ConfigError, match="must be one of 'dflash', 'eagle3', got 'prompt_lookup'"):
        config_checks.check_train_config(_cfg(**{"drafter.kind": "prompt_lookup"}))

    class Refusing(drafter_setup.DFlashTraining):
        takes_draft_vocab_size = False  # (DFlash's does)

        def check_config(self, c, error):
            raise error(f"refused by the test's training kind at block {c.drafter.block_size}")

    kinds = (Refusing(), drafter_setup.Eagle3Training())
    monkeypatch.setattr(drafter_setup, "TRAINED_KINDS", kinds)
    with pytest.raises(ConfigError, match="refused by the test's training kind at block 16"):
        config_checks.check_train_config(_cfg(**{"drafter.block_size": 16}))
    with pytest.raises(ConfigError, match="drafter.draft_vocab_size is for DFlash drafters"):
        config_checks.check_train_config(_cfg(**{"drafter.draft_vocab_size": 64}))
    config_checks.check_train_config(  # EAGLE-3's training kind is unchanged
        _cfg(**{"drafter.kind": "eagle3", "drafter.target_layer_ids": ()})
    )


INFER_FLAGS = dict(
    resume=False,
    json_out=None,
    batch_size=None,
    profile_dir=None,
    temperature=0.0,
    top_k=None,
    top_p=None,
    confidence_threshold=None,
    max_new_tokens=128,
    denoise_steps=1,
    block_size=None,
    dtype="float32",
    param_dtype=None,
)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"resume": True}, "--resume needs --json_out"),
        ({"batch_size": 0}, "--batch_size must be >= 1, got 0"),
        ({"max_new_tokens": 0}, "--max_new_tokens must be >= 1, got 0"),
        ({"block_size": 65}, "--block_size must be in [2, 64], got 65"),
        ({"tree_budget": 0}, "--tree_budget must be in [1, 1024], got 0"),
        ({"denoise_steps": 2, "remask": True}, "--remask needs denoise_steps >= 3"),
        (
            {"denoise_steps": 4, "remask": True, "denoise_schedule": "fixed"},
            "--remask needs denoise_schedule='confidence'",
        ),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p must be in (0.0, 1.0], got 0.0"),
        ({"param_dtype": "float8"}, "unknown dtype 'float8'"),
        (
            {"quantize": "int4"},
            "--quantize must be int8 (weight-only, per output channel), got 'int4'",
        ),
        ({"quantize_lm_head": True}, "--quantize_lm_head needs --quantize=int8"),
        ({"top_k": 5}, "top_k needs temperature > 0"),
        ({"seed": 3}, "--seed needs --temperature > 0"),
    ],
)
def test_infer_flags_are_checked(kw, message):
    infer_flags.check_infer_flags(INFER_FLAGS)  # the defaults pass
    with pytest.raises(ValueError) as e:
        infer_flags.check_infer_flags(dict(INFER_FLAGS, **kw))
    assert message in str(e.value)


def test_infer_flags_the_run_would_ignore_are_refused():
    """A dry-run flag without --dry_run, and with --dry_run a flag that the dry run does not
    read, are refused by name; what each run reads passes."""
    infer_flags.check_flags_used(["max_new_tokens", "seed", "drafter"], dry_run=False)
    infer_flags.check_flags_used(infer_flags.DRY_RUN_USES, dry_run=True)
    for given, dry_run, message in (
        (["seed", "topology"], False, "--topology is for --dry_run"),
        (["context"], False, "--context is for --dry_run"),
        (["topology", "temperature"], True, "--temperature is not used by --dry_run"),
        (["drafter"], True, "--drafter is not used by --dry_run"),
    ):
        with pytest.raises(ValueError) as e:
            infer_flags.check_flags_used(given, dry_run)
        assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_config_key_names_the_nearest_valid_key():
    config_checks.check_train_config(_cfg())  # the shipped config passes
    c = _cfg()
    c.drafter.num_layer = 2  # a typo of num_layers
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'drafter.num_layer' \(did you "
        r"mean 'drafter.num_layers'\?\)",
    ):
        config_checks.check_train_config(c)


def test_train_and_evaluate_checks_its_config_before_writing(tmp_path):
    from dflash_jax.training import trainer

    wd = tmp_path / "never"
    with pytest.raises(ConfigError, match="num_anchors"):
        trainer.train_and_evaluate(_cfg(num_anchors=0), str(wd))
    assert not wd.exists()  # nothing written


# ----------------------------------------------------------------------- generate (API)


@pytest.fixture(scope="module")
def small_pair():
    cfg = dj.ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=256,
    )
    target = dj.Target(cfg, init_params(cfg, 0))
    dcfg = dj.make_drafter_config(cfg, num_layers=1, num_taps=1, block_size=4, mask_token_id=63)
    return target, dj.Drafter(dcfg, dj.init_drafter_params(dcfg, 0))


GENERATE_CASES = [
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=1.0, top_p=0.0), "top_p must be in (0.0, 1.0]"),
    (dict(temperature=1.0, top_p=-1.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, top_k=0), "top_k must be >= 1"),
    (dict(confidence_threshold=2.0), "confidence_threshold"),
    (dict(stop_token_ids=[64]), "stop_token_ids has token ids outside [0, 64)"),
    (dict(block_size=8.0), "block_size must be an integer, got 8.0"),
    (dict(prompts=[1, 2, 3]), "flat list"),
    (dict(prompts=[["1", "2"]]), "must be an integer token id"),
    (dict(prompts=[[1.5, 2]]), "got 1.5"),
    (dict(max_new_tokens=4.0), "max_new_tokens must be an integer"),
    (dict(seed=0.5), "seed must be an integer"),
    (dict(prefill_chunk=-1), "prefill_chunk must be >= 0, got -1"),
    (dict(prefill_chunk=2.5), "prefill_chunk must be an integer"),
    # Settings that cannot apply without a drafter: refused, never ignored.
    (dict(drafter=None, denoise_steps=2), "denoise_steps needs a drafter"),
    (dict(drafter=None, confidence_threshold=0.5), "confidence_threshold needs a drafter"),
    (dict(drafter=None, denoise_schedule="fixed"), "denoise_schedule needs a drafter"),
    (dict(drafter=None, remask=True), "remask needs a drafter"),
    (dict(drafter=None, tree_budget=4), "tree_budget needs a drafter"),
    (dict(drafter=None, block_size=4), "block_size needs a drafter"),
    # Greedy: no top-k or nucleus; one drafter pass: no schedule (refused, never ignored).
    (dict(top_k=4), "top_k needs temperature > 0"),
    (dict(top_p=0.5), "top_p needs temperature > 0"),
    (dict(denoise_schedule="fixed"), "denoise_schedule needs denoise_steps >= 2"),
]


@pytest.mark.parametrize("kw,message", GENERATE_CASES)
def test_generate_rejects_bad_arguments_before_compute(small_pair, kw, message, monkeypatch):
    from dflash_jax.decoding.programs import _Compiled

    target, drafter = small_pair
    # Nothing may be compiled or run: the program cache must not be consulted.
    monkeypatch.setattr(
        _Compiled, "get", classmethod(lambda cls, *a: pytest.fail("compute started"))
    )
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4)
    args.update(kw)
    drafter = args.pop("drafter", drafter)
    with pytest.raises(ValueError) as e:
        dj.generate(target, drafter, **args)
    assert message in str(e.value)


def test_generate_warns_for_a_block_larger_than_the_drafters(small_pair):
    target, drafter = small_pair
    with pytest.warns(UserWarning, match="trained block size 4"):
        res = dj.generate(target, drafter, [[1, 2, 3]], 4, block_size=6)
    assert len(res.tokens[0]) == 4


def test_a_request_is_built_once_from_the_configs_and_gives_the_plan(small_pair):
    """`Request.build` (what generate and the batch runner's pre-load check both call) from
    the configs alone: normalized values, the settings named once (`Settings`' fields are
    build's keywords, generate's keywords with their defaults, and the Plan fields they fill by
    name), frozen, and the plan of generate's programs."""
    import dataclasses
    import inspect

    from dflash_jax.decoding.request import Request, Settings
    from dflash_jax.decoding.step import Plan

    target, drafter = small_pair
    names = Settings.names()
    assert Request.SETTINGS == names and len(names) == 14
    gen = inspect.signature(dj.generate).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    assert {n: gen[n].default for n in names} == {n: defaults[n] for n in names}
    plan_fields = {f.name for f in dataclasses.fields(Plan)}
    assert plan_fields - set(names) == {"stream", "attention_impl"}  # the rest by name
    with pytest.raises(TypeError, match="'blocksize' is not a generation setting"):
        Request.build(target.config, drafter.config, [[1]], 2, blocksize=4)

    r = Request.build(
        target.config,
        drafter.config,
        np.array([[1, 2, 3]]),
        np.int64(5),
        stop_token_ids=[9, 3, 9],
        confidence_threshold=0.5,
    )
    s = r.settings
    assert r.prompts == ((1, 2, 3),) and r.max_new_tokens == 5 and s.block_size == 4
    assert s.stop_token_ids == (3, 9) and s.top_k is None and s.prefill_chunk is None
    assert s.is_checked_for(target.config, drafter.config)
    assert not s.is_checked_for(target.config, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.block_size = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.max_new_tokens = 8
    plan = r.plan("xla")
    assert plan == Plan(block_size=4, stop_token_ids=(3, 9), confidence_threshold=0.5)
    assert r.plan("xla") == plan and hash(r.plan("xla")) == hash(plan)  # a jit key
    with pytest.raises(ValueError, match="needs checked settings"):
        Settings(block_size=4).plan("xla")
    ar = Request.build(target.config, None, [[1]], 2, return_drafts=True, prefill_chunk=0)
    assert ar.settings.block_size == 1 and ar.settings.return_drafts is False
    assert ar.plan("xla").prefill_chunk == 0 and not ar.plan("xla").return_drafts
    sampled = Request.build(target.config, drafter.config, [[1]], 2, temperature=0.7, top_k=4)
    assert (sampled.plan("xla").top_k, sampled.plan("xla").temperature) == (4, 0.7)


def test_a_generator_checks_its_settings_once_and_decodes_like_generate(small_pair, monkeypatch):
    """`Generator`: settings checked when it is built (a bad one refused before any prompt),
    not again per call, nor when they come checked for these configs (the batch runner's
    pre-load check); each call's seed and prompts its own; tokens equal `generate`'s."""
    from dflash_jax.decoding import generation, request

    target, drafter = small_pair
    with pytest.raises(ValueError, match="temperature"):
        dj.Generator(target, drafter, dj.Settings(temperature=-1.0))
    with pytest.raises(TypeError, match="settings must be a Settings"):
        dj.Generator(target, drafter, {"temperature": 0.5})
    calls = []
    real = request.Settings.check
    monkeypatch.setattr(
        request.Settings, "check", lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    )
    gen = dj.Generator(target, drafter, dj.Settings(stop_token_ids=[3]))
    assert len(calls) == 1 and gen.settings.block_size == drafter.config.block_size
    prompts = [[1, 2, 3], [4, 5]]
    a, b = gen(prompts, 6), gen(prompts[:1], 6)
    assert len(calls) == 1
    want = dj.generate(target, drafter, prompts, 6, stop_token_ids=[3])
    assert a.tokens == want.tokens and b.tokens == want.tokens[:1]
    assert a.tokens == dj.generate(target, None, prompts, 6, stop_token_ids=[3]).tokens
    pre = request.Request.build(target.config, drafter.config, [[1]], 2, stop_token_ids=[3])
    calls.clear()
    again = dj.Generator(target, drafter, pre.settings)
    assert calls == [] and again(prompts, 6).tokens == want.tokens
    with pytest.raises(ValueError, match="prompt 1 has token ids outside"):
        gen([[1], [999]], 4)
    with pytest.raises(ValueError, match="seed"):
        gen(prompts, 4, seed="x")
    sampled = dj.Generator(target, drafter, dj.Settings(temperature=1.0))
    s0, s1 = sampled(prompts, 8, seed=0), sampled(prompts, 8, seed=1)
    assert s0.tokens == dj.generate(target, drafter, prompts, 8, temperature=1.0).tokens
    assert s1.tokens == dj.generate(target, drafter, prompts, 8, temperature=1.0, seed=1).tokens
    assert generation.Generator is dj.Generator


@pytest.mark.parametrize(
    "prompts,message",
    [
        ([[1], "abc"], "b.jsonl:7 is a string"),
        ([[1], []], "b.jsonl:7 is empty"),
        ([[1], [70]], "b.jsonl:7 has token ids outside [0, 64)"),
        ([[1], [1] * 255], "b.jsonl:7: 255 prompt tokens + max_new_tokens 4 exceed"),
    ],
)
def test_a_request_names_a_bad_prompt_by_its_label(small_pair, prompts, message):
    from dflash_jax.decoding.request import Request

    target, drafter = small_pair
    with pytest.raises(ValueError) as e:
        Request.build(target.config, drafter.config, prompts, 4, labels=["a.jsonl:1", "b.jsonl:7"])
    assert message in str(e.value)


# ------------------------------------------------------------------------- prompt files


PROMPT_FILE_CASES = [
    (b'{"prompt": "x"}\n[1, 2]\n', ":2: expected a JSON object"),
    (b'{"prompt": null}\n', ":1: 'prompt' must be a string"),
    (b'{"ids": "abc"}\n', ":1: 'ids' must be a list of integer token ids"),
    (b'{"ids": [1.7, 2.2]}\n', ":1: 'ids'[0] must be an integer token id, got 1.7"),
    (b'{"ids": []}\n', ":1: 'ids' is empty"),
    (b'{"messages": [{"role": "user"}]}\n', ":1: messages[0] must be an object"),
    (b'{"prompt": "a", "ids": [1]}\n', ":1: expected exactly one of"),
    (b'\n{"prompt": "a"}\n{oops\n', ":3: not valid JSON"),
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", ":1: not UTF-8 text"),
    (b"\n\n", "no prompts"),
]


@pytest.mark.parametrize("content,message", PROMPT_FILE_CASES)
def test_prompt_file_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        prompting.read_prompt_file(str(path))
    assert str(e.value).startswith(str(path)) and message in str(e.value), str(e.value)


def test_prompt_file_reads_and_ids_outside_vocab_name_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('"plain"\n\n{"ids": [1, 2]}\n{"ids": [3, 99]}\n')
    items, labels = prompting.read_prompt_file(str(path), with_labels=True)
    assert items[0] == {"prompt": "plain"} and items[1] == {"ids": [1, 2]}
    assert labels == [f"{path}:1", f"{path}:3", f"{path}:4"]
    with pytest.raises(ValueError, match=r"p.jsonl:4: token id 99 outside the vocabulary"):
        prompting.encode_prompts(items[1:], None, None, vocab_size=64, labels=labels[1:])
    with pytest.raises(ValueError, match="is a directory"):
        prompting.read_prompt_file(str(tmp_path))


def test_regenerated_data_errors_name_file_and_line(tmp_path):
    from dflash_jax.training.regenerate import read_records

    good = json.dumps({"prompt_ids": [1, 2], "response_ids": [3]})
    for body, message in [
        (good + "\n{bad json\n", ":2: not a valid JSON line"),
        (json.dumps({"prompt_ids": [1]}) + "\n", ":1: missing key 'response_ids'"),
        (
            json.dumps({"prompt_ids": [1], "response_ids": [1.5]}) + "\n",
            ":1: response_ids[0] must be an integer",
        ),
        (
            good + "\n" + json.dumps({"prompt_ids": [1], "response_ids": [70]}),
            ":2: response_ids has token ids outside [0, 64)",
        ),
    ]:
        path = tmp_path / "r.jsonl"
        path.write_text(body)
        with pytest.raises(ValueError) as e:
            read_records(str(path), vocab_size=64)
        assert str(e.value).startswith(str(path)) and message in str(e.value), str(e.value)
    path.write_text(good + "\n\n" + good + "\n")
    assert len(read_records(str(path), vocab_size=64)) == 2


# ------------------------------------------------------------------------ chat templates

# Representative copies of the Qwen3 and Llama-3.1 chat templates: the constructs they use
# (namespace, reversed loops, string methods, tojson, raise_exception, strftime_now,
# bos_token, enable_thinking).
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {{- tool_call.arguments | tojson }}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Write <b>fib</b> & 'quote' in Python."}],
    [
        {"role": "system", "content": "You are terse.  "},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nplan\n</think>\n\nhello"},
        {"role": "user", "content": "déjà vu? 你好"},
    ],
]


def _template_dir(tmp_path, name, template, bos="<|begin_of_text|>"):
    d = tmp_path / name
    d.mkdir()
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": template,
                "bos_token": {"content": bos, "special": True},
                "eos_token": "<|eot_id|>",
            }
        )
    )
    return str(d)


@pytest.mark.parametrize("name,template", [("qwen3", QWEN3_TEMPLATE), ("llama3", LLAMA3_TEMPLATE)])
def test_real_chat_templates_render_as_transformers_does(tmp_path, name, template):
    import tokenizers
    import transformers

    model = tokenizers.models.WordLevel(
        {"<unk>": 0, "<|begin_of_text|>": 1, "<|eot_id|>": 2}, unk_token="<unk>"
    )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(model),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        unk_token="<unk>",
    )
    hf.chat_template = template
    d = _template_dir(tmp_path, name, template)
    assert prompting.chat_template(d) == template
    for messages in CONVERSATIONS:
        ours = prompting.render_chat(template, messages, **prompting.special_tokens(d))
        theirs = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        assert ours == theirs
        assert ("<think>\n\n</think>" in ours) == (name == "qwen3")
    with pytest.raises(ValueError, match="single tool-calls"):  # raise_exception works
        prompting.render_chat(
            LLAMA3_TEMPLATE, [{"role": "assistant", "content": "", "tool_calls": [1, 2]}]
        )


HOSTILE = [
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ lipsum.__globals__['os'].popen('touch MARKER').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ self.__init__.__globals__ }}"
    "{{ joiner.__init__.__globals__.os.system('touch MARKER') }}",
    "{% set x = messages.append({'role': 'x'}) %}{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['os'].system('touch MARKER') }}",
    "{{ strftime_now.__globals__.datetime }}{{ cycler.__init__.__globals__.os.system("
    "'touch MARKER') }}",
]


@pytest.mark.parametrize("i", range(len(HOSTILE)))
def test_hostile_chat_template_cannot_reach_python(tmp_path, i, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        prompting.render_chat(HOSTILE[i], [{"role": "user", "content": "hi"}], where="cfg")
    assert "refused to render" in str(e.value) and "unsafe" in str(e.value), str(e.value)
    assert not (tmp_path / "MARKER").exists()


def test_sharded_index_naming_files_outside_the_directory_is_refused(tmp_path):
    from dflash_jax.models.safetensors_io import SafetensorsDir, write_safetensors

    d = tmp_path / "model"
    d.mkdir()
    write_safetensors(str(tmp_path / "outside.safetensors"), {"w": np.zeros(2, np.float32)})
    write_safetensors(str(d / "shard-1.safetensors"), {"w": np.ones(2, np.float32)})
    for fname in (
        "../outside.safetensors",
        str(tmp_path / "outside.safetensors"),
        "sub/../../outside.safetensors",
    ):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": fname}}))
        with pytest.raises(dj.CheckpointError, match="outside the model directory"):
            SafetensorsDir(str(d))
    os.symlink(tmp_path / "outside.safetensors", d / "link.safetensors")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "link.safetensors"}})
    )
    with pytest.raises(dj.CheckpointError, match="outside the model directory"):
        SafetensorsDir(str(d))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "shard-1.safetensors"}})
    )
    assert SafetensorsDir(str(d)).get("w").tolist() == [1.0, 1.0]


# ---------------------------------------------------------------- CLIs: one line, exit 2


@pytest.mark.once
def test_cli_user_errors_are_one_line_exit_2_before_any_compute(tmp_path):
    """Bad inputs to infer.py and train.py: each exits 2 with exactly one stderr line
    `error: ...`, prints nothing else, writes nothing, and ends in the time it takes to start
    Python (no model compiled or run). The command lines run through the CLI probe's fork server
    (tests/_probe_zygote.py: jax and the library imported once, each a child forked from there
    and run as the interpreter runs a script); the --verbose one in an interpreter of its own."""
    bundled = os.path.join(ROOT, "assets", "tiny-code", "target")
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        os.symlink(os.path.join(bundled, f), hostile / f)
    (hostile / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": (
                    "{{ cycler.__init__.__globals__.os.system('touch "
                    + str(tmp_path / "MARKER")
                    + "') }}"
                )
            }
        )
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n{"ids": [1.7, 2.2]}\n')
    from test_cli_probe import Case, run_forked

    infer = ["infer.py", "--max_new_tokens=2000", "--compare_ar"]
    train = [
        "train.py",
        f"--config={os.path.join(ROOT, 'configs', 'tiny_test.py')}",
        f"--workdir={tmp_path / 'wd'}",
    ]
    cases = [
        (infer + ["--temperature=1", "--top_p=0"], "top_p must be in (0.0, 1.0], got 0.0"),
        (infer + [f"--json_out={tmp_path / 'missing' / 'out.json'}"], "does not exist"),
        (infer + [f"--prompt_file={prompts}"], f"{prompts}:2: 'ids'[0] must be an integer"),
        # (no drafter for this target: without --compare_ar, which needs one)
        (infer[:-1] + [f"--target={hostile}", "--prompt=hi"], "refused to render"),
        (
            train + ["--config.drafter.num_layer=2"],
            "unknown config key 'drafter.num_layer' (did you mean '--config.drafter.num_layers'?)",
        ),
        (train + ["--config.data.batch_size=0"], "data.batch_size must be >= 1, got 0"),
    ]
    t0 = time.time()
    runs = run_forked(
        [Case(f"case{i}", args) for i, (args, _) in enumerate(cases)], str(tmp_path / "runs")
    )
    elapsed = time.time() - t0
    for i, (args, message) in enumerate(cases):
        p = runs[f"case{i}"][0]
        out, err = p.stdout, p.stderr
        lines = [l for l in err.splitlines() if l.strip()]
        assert p.returncode == 2, (args[-1], err[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (
            args[-1],
            err,
        )
        assert "Traceback" not in err and not out.strip(), (args[-1], out)
    assert not (tmp_path / "MARKER").exists()  # the template's command never ran
    assert not (tmp_path / "wd").exists() and not (tmp_path / "missing").exists()
    # 2000 tokens with and without a drafter would take far longer than starting 6 Pythons.
    assert elapsed < 90, elapsed
    # --verbose: the same error with its traceback (for bug reports).
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, *infer, "--temperature=nan", "--verbose"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" in r.stderr and "finite" in r.stderr


def test_tau_is_none_when_no_decode_step_ran(small_pair):
    """max_new_tokens=1: the one token comes from the prefill, so there is no tau (not 0.0)."""
    target, drafter = small_pair
    res = dj.generate(target, drafter, [[1, 2, 3]], max_new_tokens=1)
    assert len(res.tokens[0]) == 1 and res.acceptance_lengths == [[]]
    assert res.stats["tau"] is None and res.tau is None
    res = dj.generate(target, drafter, [[1, 2, 3]], max_new_tokens=3)
    assert res.tau >= 1.0
