"""Using the tools as a new user would: hub ids (a fake hub: a monkeypatched download and a
local Hugging Face cache), prompt files in length-grouped batches with resume, quiet start-up
and training output, progress and logging helpers.

One small random target + drafter (with a real BPE tokenizer) is written once per module, as a
hub-cache snapshot that the CLI reads with HF_HUB_OFFLINE=1.
"""

import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import types

import jax
import pytest

import dflash_jax as dj
from dflash_jax.models.target import init_params
from dflash_jax.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from dflash_jax.frontend import batch_runner
from dflash_jax.models import hub
from dflash_jax.support import console

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "class Foo:\n    def __init__(self):\n        self.x = 1\n",
] * 20
TARGET_ID, DRAFTER_ID = "dflash-test/tiny-target", "dflash-test/tiny-drafter"
MAX_NEW = 10
# Files a real hub repository has that the loaders do not read: never fetched.
EXTRA_FILES = ("pytorch_model.bin", "README.md", "modeling_dflash.py")


def _cache_snapshot(hf_home, repo_id, src):
    """Puts `src`'s files where huggingface_hub's cache keeps repo_id's main revision."""
    repo = os.path.join(hf_home, "hub", "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", "0" * 40)
    shutil.copytree(src, snap)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write("0" * 40)
    return snap


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_usage")
    tok = train_bpe_tokenizer(CODE, str(root / "target"), vocab_size=300)
    cfg = dj.ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=512,
    )
    target = dj.Target(cfg, init_params(cfg, 0), path=str(root / "target"))
    dj.save_target(target, root / "target")
    dcfg = dj.make_drafter_config(
        cfg, num_layers=1, num_taps=1, block_size=4, mask_token_id=tok.mask_id
    )
    dj.save_drafter(dj.Drafter(dcfg, dj.init_drafter_params(dcfg, 0)), root / "drafter")
    for d in ("target", "drafter"):
        for name in EXTRA_FILES:
            (root / d / name).write_text("not a model file")
    hf_home = str(root / "hf_home")
    _cache_snapshot(hf_home, TARGET_ID, root / "target")
    _cache_snapshot(hf_home, DRAFTER_ID, root / "drafter")
    # 50 prompts of 3..16 tokens, in no length order (one prompt-length bucket: one compile).
    prompts = [
        [(7 * i + 3 * j) % (tok.vocab_size - 2) + 2 for j in range(3 + (i * 5) % 14)]
        for i in range(50)
    ]
    target = dj.load_target(str(root / "target"))
    drafter = dj.load_drafter(str(root / "drafter"), target=target)
    return types.SimpleNamespace(
        root=root, tok=tok, hf_home=hf_home, prompts=prompts, target=target, drafter=drafter
    )


@pytest.fixture(scope="module")
def one_at_a_time(models):
    """Reference: every prompt alone, autoregressive greedy (stopping at eos, as the CLI)."""
    return [
        dj.generate(models.target, None, [p], MAX_NEW, stop_token_ids=[0]).tokens[0]
        for p in models.prompts
    ]


# ------------------------------------------------------------------------------- hub ids


def test_hub_ids_resolve_through_the_download_with_only_model_files(models, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors
    from huggingface_hub.utils import filter_repo_objects

    mirror = {TARGET_ID: models.root / "target", DRAFTER_ID: models.root / "drafter"}
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision))
        if repo_id not in mirror:
            raise errors.RepositoryNotFoundError(
                "404", response=types.SimpleNamespace(headers={}, request=None)
            )
        names = sorted(os.listdir(mirror[repo_id]))
        out = tmp_path / "snapshots" / repo_id.replace("/", "--")
        out.mkdir(parents=True)
        for name in filter_repo_objects(names, allow_patterns=allow_patterns):
            shutil.copy(mirror[repo_id] / name, out / name)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    target = dj.load_target(TARGET_ID)
    drafter = dj.load_drafter(DRAFTER_ID + "@v1", target=target)
    assert calls == [(TARGET_ID, None), (DRAFTER_ID, "v1")]
    fetched = set(os.listdir(target.path))
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= fetched
    assert not fetched & set(EXTRA_FILES)
    assert load_tokenizer(target.path) is not None  # the tokenizer came along with the weights
    for got, ref in ((target, models.target), (drafter, models.drafter)):
        assert jax.tree_util.tree_all(
            jax.tree_util.tree_map(lambda a, b: bool((a == b).all()), got.params, ref.params)
        )
    # A directory is used as it is; a missing path that cannot be an id never reaches the hub.
    assert hub.resolve(str(models.root / "target")) == str(models.root / "target")
    with pytest.raises(hub.HubError, match="not found"):
        hub.resolve(str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(hub.HubError, match="'nobody/nothing': no such hub repository"):
        dj.load_target("nobody/nothing")
    assert len(calls) == 3


def _env(models, **extra):
    env = dict(os.environ, HF_HOME=models.hf_home, HF_HUB_OFFLINE="1", **extra)
    env.pop("HF_HUB_CACHE", None)
    return env


@pytest.mark.once
def test_offline_unknown_hub_id_is_one_line_and_exit_2(models, tmp_path):
    for args in (
        [os.path.join(ROOT, "infer.py"), "--target=nobody/nothing"],
        [
            os.path.join(ROOT, "train.py"),
            "--config=" + os.path.join(ROOT, "configs/tiny_test.py"),
            f"--workdir={tmp_path / 'w'}",
            "--config.target_path=nobody/nothing",
        ],
    ):
        r = subprocess.run(
            [sys.executable, *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=_env(models),
        )
        assert r.returncode == 2, r.stderr[-2000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "'nobody/nothing'" in lines[0], r.stderr
        assert "HF_HUB_OFFLINE" in lines[0] and "local directory" in lines[0]
        assert not os.path.exists(tmp_path / "w")  # nothing ran, nothing was written


# ---------------------------------------------------------------------- prompt-file batches


def test_length_batches_group_similar_lengths():
    lengths = [5, 40, 6, 39, 7, 38, 5]
    batches = batch_runner.length_batches(lengths, 3)
    assert sorted(i for b in batches for i in b) == list(range(7))
    assert [[lengths[i] for i in b] for b in batches] == [[5, 5, 6], [7, 38, 39], [40]]


def test_batches_of_8_match_one_at_a_time_and_an_interrupted_run_resumes(
    models, one_at_a_time, tmp_path, capsys
):
    out = str(tmp_path / "out.jsonl")
    seen = []

    def stop_after_three(b, recs):
        seen.extend(r["index"] for r in recs)
        if len(seen) >= 24:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        batch_runner.run_prompts(
            models.target,
            models.drafter,
            models.prompts,
            batch_size=8,
            out_path=out,
            max_new_tokens=MAX_NEW,
            stop_token_ids=[0],
            on_batch=stop_after_three,
        )
    with open(out) as f:
        kept = [json.loads(line) for line in f]
    assert sorted(r["index"] for r in kept) == sorted(seen) and len(kept) == 24
    with open(out, "a") as f:
        f.write('{"index": 3, "tok')  # killed in the middle of a line

    ran = []
    console.set_progress(True)
    try:
        rep = batch_runner.run_prompts(
            models.target,
            models.drafter,
            models.prompts,
            batch_size=8,
            out_path=out,
            resume=True,
            max_new_tokens=MAX_NEW,
            stop_token_ids=[0],
            on_batch=lambda b, recs: ran.extend(r["index"] for r in recs),
        )
    finally:
        console.set_progress(None)
    bar = capsys.readouterr().err  # the progress bar: prompts left, tokens/s, tau, ETA
    assert "generate" in bar and "/26" in bar and "tok/s, tau" in bar and "<" in bar
    assert rep.resumed == 24 and sorted(ran) == sorted(set(range(50)) - set(seen))
    assert [r["tokens"] for r in rep.records] == one_at_a_time
    with open(out) as f:
        lines = [json.loads(line) for line in f]
    assert sorted(r["index"] for r in lines) == list(range(50))
    t = rep.totals
    assert t["prompts"] == 50 and t["new_tokens"] == sum(len(x) for x in one_at_a_time)
    assert t["tau_per_prompt"]["min"] <= t["tau"] <= t["tau_per_prompt"]["max"] <= 4
    assert t["tau"] >= 1
    assert t["decode_tokens_per_s"] > 0
    # The file belongs to these prompts and settings: anything else is refused, not mixed in.
    with pytest.raises(ValueError, match="other generation settings"):
        batch_runner.run_prompts(
            models.target,
            models.drafter,
            models.prompts,
            batch_size=8,
            out_path=out,
            resume=True,
            max_new_tokens=MAX_NEW + 1,
            stop_token_ids=[0],
        )
    with pytest.raises(ValueError, match="different prompt"):
        batch_runner.run_prompts(
            models.target,
            models.drafter,
            models.prompts[::-1],
            batch_size=8,
            out_path=out,
            resume=True,
            max_new_tokens=MAX_NEW,
            stop_token_ids=[0],
        )


def test_sampled_batches_use_seed_plus_batch_number(models):
    """docs/usage.md: sampled prompt-file batches use `seed + batch number` (wrapped into the
    64-bit range): the same prompt in three batches of one gives three samples, each the one
    `generate` draws alone with that batch's seed."""
    prompt = models.prompts[0]
    kw = dict(max_new_tokens=MAX_NEW, temperature=1.0, stop_token_ids=[0])
    rep = batch_runner.run_prompts(  # autoregressive (a cheap compile): the same _batch_seed
        models.target,
        None,
        [prompt] * 3,
        batch_size=1,
        warmup=False,
        seed=2**63 - 2,
        **kw,
    )
    recs = sorted(rep.records, key=lambda r: r["batch"])
    assert [r["batch"] for r in recs] == [0, 1, 2]
    for r, seed in zip(recs, (2**63 - 2, 2**63 - 1, -(2**63))):
        alone = dj.generate(models.target, None, [prompt], seed=seed, **kw)
        assert r["tokens"] == alone.tokens[0], seed
    samples = {tuple(r["tokens"]) for r in recs}
    assert len(samples) == 3, samples  # a random model at temperature 1: three different draws


@pytest.mark.once
def test_infer_cli_with_hub_ids_batches_a_prompt_file_and_resumes_quietly(
    models, one_at_a_time, tmp_path
):
    pfile = tmp_path / "prompts.jsonl"
    pfile.write_text("".join(json.dumps({"ids": p}) + "\n" for p in models.prompts))
    out = tmp_path / "out.jsonl"

    def run(*extra, rc=0):
        r = subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "infer.py"),
                f"--target={TARGET_ID}",
                f"--drafter={DRAFTER_ID}",
                f"--prompt_file={pfile}",
                "--batch_size=8",
                f"--max_new_tokens={MAX_NEW}",
                f"--json_out={out}",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            env=_env(models),
        )
        assert r.returncode == rc, r.stderr[-3000:]
        return r

    r = run()
    # Start-up: the first line is the model summary; no backend probing, no library logs.
    assert r.stdout.splitlines()[0].startswith(f"target {TARGET_ID}: 2 layers, hidden 32")
    assert r.stderr.strip() == "", r.stderr[-2000:]
    assert "tau" in r.stdout and "in batches of 8" in r.stdout
    lines = out.read_text().splitlines()
    assert len(lines) == 50
    recs = {json.loads(line)["index"]: json.loads(line) for line in lines}
    assert [recs[i]["tokens"] for i in range(50)] == one_at_a_time
    # An interrupted run: the first 17 lines survive (and a torn 18th); --resume does the rest.
    out.write_text("\n".join(lines[:17]) + "\n" + lines[17][:30])
    r = run("--resume")
    assert "resumed: 17 of 50 prompts" in r.stdout
    again = {json.loads(line)["index"]: json.loads(line) for line in out.read_text().splitlines()}
    assert sorted(again) == list(range(50))
    assert [again[i]["tokens"] for i in range(50)] == one_at_a_time
    # Resuming with other settings is refused in one line, before any model is loaded.
    r = run("--resume", "--block_size=2", rc=2)  # (--seed: greedy draws nothing, refused)
    assert len(r.stderr.strip().splitlines()) == 1 and "other generation settings" in r.stderr
    assert r.stdout == ""


# -------------------------------------------------------------------------- quiet output


@pytest.mark.once
def test_train_cli_prints_only_what_was_asked_and_logs_the_rest_to_a_file(tmp_path):
    work = tmp_path / "w"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "--config=" + os.path.join(ROOT, "configs/tiny_test.py"),
            f"--workdir={work}",
            "--config.data.kind=synthetic",
            "--config.num_train_steps=4",
            "--config.log_every=2",
            "--config.eval_every=0",
            "--config.checkpoint_every=2",
            f"--profile_dir={tmp_path / 'trace'}",
            "--profile_steps=1:2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip().splitlines()
    kinds = [
        "drafter training",
        "step 2/4",
        "checkpoint step 2",
        f"profile of steps 1..2 written to {tmp_path / 'trace'}",
        "step 4/4",
        "checkpoint step 4",
        "exported to",
    ]
    assert len(out) == len(kinds), r.stdout
    assert [line for line, k in zip(out, kinds) if not line.startswith(k)] == []
    assert r.stderr.strip() == "", r.stderr[-2000:]  # no Orbax INFO, no backend probe
    log = (work / "train.log").read_text()
    assert "step 2/4" in log and "exported to" in log
    assert "orbax" in log.lower()  # the library lines went to the file
    # --profile_steps=1:2 (docs/training.md): one jax.profiler trace, in --profile_dir, of the
    # jitted training step.
    (run,) = os.listdir(tmp_path / "trace" / "plugins" / "profile")
    xplanes = glob.glob(str(tmp_path / "trace" / "plugins" / "profile" / run / "*.xplane.pb"))
    assert len(xplanes) == 1 and b"jit(step)" in open(xplanes[0], "rb").read(), xplanes


def test_console_logging_levels_and_progress_switch(tmp_path, capsys, monkeypatch):
    from absl import logging as absl_logging

    handler = absl_logging.get_absl_handler()
    root_level, handler_level = logging.root.level, handler.level
    monkeypatch.setattr(logging.root, "handlers", [handler])
    try:
        console.configure_logging(verbose=False, log_file=str(tmp_path / "run.log"))
        logging.getLogger("orbax.checkpoint").info("library detail")
        console.say("step 1 loss 2.0")
        logging.getLogger("jax").warning("a real warning")
        for h in logging.root.handlers:
            h.flush()
        err = capsys.readouterr()
        assert err.out == "step 1 loss 2.0\n"
        assert "library detail" not in err.err and "step 1" not in err.err
        assert "a real warning" in err.err
        log = (tmp_path / "run.log").read_text()
        assert "library detail" in log and "step 1 loss 2.0" in log and "a real warning" in log
        console.configure_logging(verbose=True)
        logging.getLogger("orbax.checkpoint").info("shown when verbose")
        console.say("said once")
        err = capsys.readouterr()
        assert "shown when verbose" in err.err and "said once" not in err.err
    finally:
        for h in logging.root.handlers:
            if isinstance(h, logging.FileHandler):
                h.close()
        logging.root.setLevel(root_level)
        handler.setLevel(handler_level)
    monkeypatch.setenv("DFLASH_PROGRESS", "0")
    assert console.progress(range(3)).disable
    train_bpe_tokenizer(CODE, vocab_size=300)
    assert capsys.readouterr().err == ""  # not a terminal, or switched off: no bar
    monkeypatch.setenv("DFLASH_PROGRESS", "1")
    train_bpe_tokenizer(CODE, vocab_size=300)
    err = capsys.readouterr().err
    assert "tokenizer" in err and f"/{len(CODE)} [" in err  # the total is known: an ETA
    console.set_progress(False)
    try:
        assert console.progress(range(3)).disable
    finally:
        console.set_progress(None)
