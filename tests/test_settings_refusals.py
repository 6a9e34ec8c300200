"""Nothing lost on the new paths (issue 66, class 7, settings): every setting a run would
ignore is refused in one line before anything is computed, a drafter is recognised by its
config.json and never by its name, and prompt lookup compares with autoregressive decoding.

The refusals run as the CLI probe's rows do (`test_cli_probe`: each command in a child forked
from one interpreter that imported jax once, its exit status, its one `error:` line, no
traceback, and the files named `unchanged` as they were).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from test_cli_probe import PAIR, ROOT, Case, _copy_model, _set, check, run_forked

# Host-side refusals and one CLI run of the tiny pair: once, in the oldest jax's suite.
pytestmark = pytest.mark.once

_INFER = ["infer.py", "--target={pair}/target", "--max_new_tokens=2"]
_DRY = ["-m", "dflash_jax.dry_run", "--topology=cpu:2"]


def _dflash2(**fields):
    """A config edit: the bundled DFlash drafter declared a DFlash 2 one (DFlash 2's fields at
    sizes its width takes), with `fields` in dflash_config."""

    def edit(cfg):
        extra = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
        extra.update(fields)
        return {
            **cfg,
            "architectures": ["DFlash2DraftModel"],
            "dflash_config": {**cfg["dflash_config"], **extra},
        }

    return edit


CASES = [
    # Sampling filters under greedy decoding, and a block size without a drafter: ignored
    # before, refused now as --denoise_steps and --tree_budget are.
    Case("greedy_top_k", _INFER + ["--top_k=5"], want_err=r"top_k needs temperature > 0"),
    Case("greedy_top_p", _INFER + ["--top_p=0.9"], want_err=r"top_p needs temperature > 0"),
    Case("greedy_seed", _INFER + ["--seed=7"], want_err=r"--seed needs --temperature > 0"),
    Case(
        "block_size_no_drafter",
        _INFER + ["--drafter=", "--block_size=8"],
        want_err=r"block_size needs a drafter",
    ),
    Case(
        "schedule_one_pass",
        _INFER + ["--denoise_schedule=fixed"],
        want_err=r"denoise_schedule needs denoise_steps >= 2",
    ),
    # infer.py's dry-run flags without --dry_run, and with it a flag the dry run never reads.
    Case(
        "dry_run_flag_without_dry_run",
        _INFER + ["--context=64"],
        want_err=r"--context is for --dry_run",
    ),
    Case(
        "infer_dry_run_ignores_temperature",
        ["infer.py", "--dry_run", "--topology=cpu:2", "--dry_run_model=tiny", "--temperature=1"],
        want_err=r"--temperature is not used by --dry_run",
    ),
    # The dry run: --tree_budget against the model and --draft_vocab_size against its
    # vocabulary, before any compile (no prefill.hlo written first).
    Case(
        "dry_run_tree_over_hybrid",
        _DRY + ["--model=tiny_hybrid", "--tree_budget=4", "--hlo_dir={tmp}/hlo"],
        want_err=r"^error: tiny_hybrid: --tree_budget is not supported over a hybrid",
        unchanged=("{tmp}/hlo/prefill.hlo",),
    ),
    Case(  # infer.py --dry_run passes --tree_budget on (it was dropped: a chain compiled)
        "infer_dry_run_tree_over_hybrid",
        ["infer.py", "--dry_run", "--topology=cpu:2", "--dry_run_model=tiny_hybrid"]
        + ["--tree_budget=4"],
        want_err=r"tiny_hybrid: --tree_budget is not supported over a hybrid",
    ),
    Case(
        "dry_run_draft_vocab_past_vocabulary",
        _DRY
        + ["--model=small", "--drafter=eagle3", "--draft_vocab_size=1000000000"]
        + ["--hlo_dir={tmp}/hlo"],
        want_err=r"small: --draft_vocab_size 1000000000 exceeds the target's vocabulary of "
        r"19008 tokens",
        unchanged=("{tmp}/hlo/prefill.hlo",),
    ),
    # Drafter configs: a scalar that is not finite, named by file and field.
    *[
        Case(
            f"dflash2_{field}_{shown}",
            _INFER + ["--drafter={tmp}/drafter"],
            want_err=rf"drafter/config\.json: dflash_config\.{field} must be a finite number, "
            rf"got {shown}",
            setup=lambda t, f=field, v=value: _copy_model(t, "drafter", _dflash2(**{f: v})),
        )
        for field, value, shown in (
            ("output_multiplier", float("nan"), "nan"),
            ("input_embedding_scale", float("inf"), "inf"),
            ("final_logit_softcapping", -float("inf"), "-inf"),
        )
    ],
    Case(
        "drafter_rms_norm_eps_nan",
        _INFER + ["--drafter={tmp}/drafter"],
        want_err=r"drafter/config\.json: rms_norm_eps must be a finite number, got nan",
        setup=lambda t: _copy_model(t, "drafter", _set(rms_norm_eps=float("nan"))),
    ),
    # train.py: stop_at_step=0 meant "no limit" (as -1).
    Case(
        "train_stop_at_step_0",
        ["train.py", "--config=configs/tiny_test.py", "--workdir={tmp}/w"]
        + ["--config.stop_at_step=0"],
        want_err=r"stop_at_step must be >= 1 \(or -1: run the whole schedule\), got 0",
        unchanged=("{tmp}/w/train.log",),
    ),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    names = [c.name for c in CASES]
    assert len(set(names)) == len(names), "case names must be unique"
    return run_forked(CASES, str(tmp_path_factory.mktemp("settings")))


@pytest.mark.slow  # a dozen CLI commands, two at a time
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_refused_in_one_line_before_any_compute(case, results):
    proc, before, after = results[case.name]
    wrong = check(case, proc, before, after)
    assert not wrong, f"{case.name}: {'; '.join(wrong)}\nstderr:\n{proc.stderr[-3000:]}"


def test_a_drafter_directory_is_recognised_by_its_config_not_its_name(tmp_path):
    """A drafter directory whose name starts with prompt_lookup is read as the drafter its
    config.json says (here a DFlash one with a bad block size, refused naming that file),
    --compare_ar included; --drafter=prompt_lookup where ./prompt_lookup exists names both."""
    with open(os.path.join(PAIR, "drafter", "config.json")) as f:
        cfg = json.load(f)
    cfg["dflash_config"]["block_size"] = 0
    for name in ("prompt_lookup_tiny", "prompt_lookup"):  # config.json alone: refused first
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    env = dict(os.environ, JAX_PLATFORMS="cpu", NO_COLOR="1")
    bad_block = r"config\.json: (dflash_config\.)?block_size must be >= 2, got 0"
    for drafter, want in (
        ("prompt_lookup_tiny", r"prompt_lookup_tiny/" + bad_block),
        ("./prompt_lookup", r"prompt_lookup/" + bad_block),
        ("prompt_lookup", r"--drafter=prompt_lookup names prompt lookup, but prompt_lookup "
         r"is also a path here: pass \./prompt_lookup"),
    ):  # fmt: skip
        r = subprocess.run(
            [sys.executable, os.path.join(ROOT, "infer.py"), f"--target={PAIR}/target"]
            + [f"--drafter={drafter}", "--compare_ar", "--max_new_tokens=2"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
        assert r.returncode == 2 and len(lines) == 1, (drafter, r.stderr[-2000:])
        assert re.search(want, lines[0]), (drafter, lines[0])


def test_prompt_lookup_compares_with_autoregressive_decoding(tmp_path):
    """infer.py --drafter=prompt_lookup --compare_ar on the bundled target, end to end: the
    comparison is printed, the looked-up drafts were accepted (some step commits several
    tokens), and the tokens are those of autoregressive decoding run here on the same prompt
    ids (lossless), as the run itself reports."""
    import dflash_jax as dj
    from dflash_jax.frontend import textgen

    out = tmp_path / "out.jsonl"
    # (a completion that repeats the prompt's text: some step commits 5 tokens)
    prompt = (
        "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):"
    )
    new = 24
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "infer.py"), f"--target={PAIR}/target"]
        + ["--drafter=prompt_lookup", "--compare_ar", f"--max_new_tokens={new}"]
        + [f"--prompt={prompt}", f"--json_out={out}", "--stream=false"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu", NO_COLOR="1"),
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "drafter: prompt_lookup;" in r.stdout
    assert "autoregressive: " in r.stdout and "outputs identical: True" in r.stdout
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["identical_to_ar"] is True and len(rec["tokens"]) == new
    assert max(rec["acceptance_lengths"]) >= 3, rec["acceptance_lengths"]

    target_dir = os.path.join(PAIR, "target")
    target = dj.load_target(target_dir)
    ar = dj.generate(
        target,
        None,
        [rec["prompt_ids"]],
        new,
        stop_token_ids=textgen.load_text(target_dir).stop_token_ids,
    )
    assert ar.tokens[0] == rec["tokens"]


@pytest.mark.parametrize(
    "which,field", [("drafter_eagle3", "rope_theta"), ("drafter_dflash2", "dflash_config.x")]
)
def test_a_drafter_config_with_a_number_that_is_not_finite_is_refused(tmp_path, which, field):
    """The shipped EAGLE-3 and DFlash 2 configs with a NaN at `field` (read or not): one
    CheckpointError naming the file and the field, from the loaders' config reading."""
    from dflash_jax.drafters.dflash import read_drafter_config
    from dflash_jax.drafters.eagle3 import Eagle3Config
    from dflash_jax.models import checkpoint

    src = os.path.join(ROOT, "assets", "smollm2-135m-instruct", which, "config.json")
    with open(src) as f:
        cfg = json.load(f)
    read = (
        (lambda d: Eagle3Config.from_hf(checkpoint.read_config(d)))
        if which == "drafter_eagle3"
        else read_drafter_config
    )
    read(os.path.dirname(src))  # as shipped: read
    *path, last = field.split(".")
    node = cfg
    for key in path:
        node = node[key]
    node[last] = float("nan")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(checkpoint.CheckpointError) as e:
        read(str(tmp_path))
    assert str(e.value) == f"{tmp_path}/config.json: {field} must be a finite number, got nan"
