"""Shared fixtures: small random Hugging Face checkpoints written once per test session; the
one mechanism of the 8-device tests (`eight_devices`: tests/_multidevice_worker.py checks in
8-fake-device subprocesses); one persistent compilation cache for the whole session (below);
and the longest-first file order for pytest-xdist (at the end)."""

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types

import _pair
import numpy as np
import pytest

# The suite runs on the CPU, also where libtpu is installed (it is, for the TPU ahead-of-time
# compiles of tests/test_tpu_compile.py): without this JAX would probe for a TPU at start-up.
# Set before any test module imports JAX; subprocesses inherit it.
if not os.environ.get("JAX_PLATFORMS"):
    os.environ["JAX_PLATFORMS"] = "cpu"

# One persistent compilation cache for the session: both pytest-xdist workers and every
# subprocess they start (infer.py, train.py, the 8-device and 2-process launches) read and write
# it, so a program compiled once (the same tiny model's prefill/decode/train step, built by many
# test files and CLI runs) is loaded, not compiled again: compiling is most of this suite's time
# on a CPU. Set here, at conftest import in the controller, before any worker or JAX starts;
# workers and subprocesses inherit it. Fresh per session (a stale cache proves nothing) and
# removed at the end by the process that made it. A cached executable is the same binary, so
# results are unchanged; DFLASH_TEST_NO_COMPILE_CACHE=1 turns it off.
if not os.environ.get("DFLASH_TEST_NO_COMPILE_CACHE") and not os.environ.get(
    "JAX_COMPILATION_CACHE_DIR"
):
    _cache_dir = tempfile.mkdtemp(prefix="dflash-jax-test-compile-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    atexit.register(shutil.rmtree, _cache_dir, True)


def _xla_accepts(flag):
    """Whether this jaxlib's XLA knows `flag` (it aborts the process on an unknown one, so ask
    a throwaway subprocess)."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flag).strip())
    probe = "import jax.numpy as jnp; (jnp.zeros(2) + 1).block_until_ready()"
    try:
        return (
            subprocess.run(
                [sys.executable, "-c", probe], env=env, capture_output=True, timeout=120
            ).returncode
            == 0
        )
    except subprocess.TimeoutExpired:
        return False


# Cheap compiles. The suite's programs are tiny and each runs a few times, so XLA's CPU
# compiler is most of its time (measured: 72% of test_tree.py's seconds, tests/_compile_report.py;
# the settings compared by benchmarks/compile_flags.py); its optimizations are
# not what the tests check. jax's own switch (`jax_disable_most_optimizations`: LLVM at -O0, no
# expensive LLVM passes) halves the CPU compile of the decode programs on the newest jax; on the
# oldest, XLA's loop-fusion emitters must also be off for the same gain (on alone they cost
# more). Set in the controller before workers start, so workers and subprocesses inherit it
# (the probe runs once). The files that check TPU and GPU ahead-of-time compiles (bytes,
# collectives, HBM) turn jax's switch off for their tests (`_production_compiles` below): they
# check the programs users get. DFLASH_TEST_FULL_OPTIMIZATION=1 compiles everything as users do.
_CHEAP_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"
if not os.environ.get("DFLASH_TEST_FULL_OPTIMIZATION") and not os.environ.get(
    "JAX_DISABLE_MOST_OPTIMIZATIONS"
):
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    if _xla_accepts(_CHEAP_COMPILE_FLAG):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " " + _CHEAP_COMPILE_FLAG
        ).strip()

# The directories derived from GGUF files (dflash_jax/models/gguf_io/) go to a session temp dir,
# not the user's ~/.cache (shared by workers and subprocesses, removed at the end).
if not os.environ.get("DFLASH_JAX_CACHE"):
    _gguf_cache = tempfile.mkdtemp(prefix="dflash-jax-test-cache-")
    os.environ["DFLASH_JAX_CACHE"] = _gguf_cache
    atexit.register(shutil.rmtree, _gguf_cache, True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VOCAB = 128
MULTIDEVICE_WORKER = os.path.join(ROOT, "tests", "_multidevice_worker.py")


def eight_device_env(**extra):
    """The environment of a subprocess whose JAX sees 8 fake CPU devices (JAX fixes its device
    count at start-up, so the 8-device tests run in subprocesses). `extra`: more variables."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = (flags.strip() + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def run_multidevice_checks(workdir, checks, timeout=1800, env=None):
    """The one mechanism of the 8-device tests: runs `checks` (check names of
    tests/_multidevice_worker.py) in one 8-device subprocess and returns its findings (a dict:
    check name -> findings, "num_devices", "seconds")."""
    proc = subprocess.run(
        [sys.executable, MULTIDEVICE_WORKER, str(workdir), *checks],
        cwd=ROOT,
        env=eight_device_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"checks {checks} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    found = json.loads(lines[-1][len("RESULT ") :])
    assert found["num_devices"] == 8, found["num_devices"]
    return found


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """Environment variables giving a subprocess the session's persistent compilation cache
    (the environment already carries it unless DFLASH_TEST_NO_COMPILE_CACHE is set; then a
    fresh one for subprocesses only): a process or launch that repeats an earlier one's
    programs (a resumed training run) loads them instead of compiling."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        keys = (
            "JAX_COMPILATION_CACHE_DIR",
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
        )
        return {k: os.environ[k] for k in keys if k in os.environ}
    return {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_compile_cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
    }


@pytest.fixture(scope="session")
def eight_devices(compile_cache):
    """`.checks(workdir, checks, timeout=1800)`: run_multidevice_checks; `.env(**extra)`:
    eight_device_env, for running another program (e.g. train.py) on 8 devices. Both with
    the session's compile_cache."""
    return types.SimpleNamespace(
        checks=lambda workdir, checks, timeout=1800: run_multidevice_checks(
            workdir, checks, timeout=timeout, env=compile_cache
        ),
        env=lambda **extra: eight_device_env(**{**compile_cache, **extra}),
    )


def make_hf_model(kind: str, seed: int = 0):
    """A small random transformers model: 'qwen3_tied', 'qwen3_untied' or 'llama3'."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    if kind.startswith("qwen3"):
        cfg = transformers.Qwen3Config(
            head_dim=32, tie_word_embeddings=(kind == "qwen3_tied"), rope_theta=1e6, **common
        )
        model = transformers.Qwen3ForCausalLM(cfg)
    elif kind == "llama3":
        cfg = transformers.LlamaConfig(
            tie_word_embeddings=False,
            rope_theta=5e5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # Larger-than-default init so that logits are far from uniform and tests discriminate.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
    return model.eval()


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """{kind: (directory, torch model)} for the three reference architectures."""
    out = {}
    for kind in ("qwen3_tied", "qwen3_untied", "llama3"):
        d = str(tmp_path_factory.mktemp(kind))
        model = make_hf_model(kind)
        model.save_pretrained(d)
        out[kind] = (d, model)
    return out


@pytest.fixture(scope="session")
def hf_models64(hf_checkpoints):
    """{kind: float64 copy of the transformers model}: the reference side of parity tests.

    transformers' float32 CPU forward was seen to differ between runs of the same input by
    ~4e-4 on these models (about one run in eight); in float64 run-to-run differences are
    ~1e-12, far below every tolerance, so a parity failure means this project is off."""
    import copy

    return {k: copy.deepcopy(m).double() for k, (_, m) in hf_checkpoints.items()}


@pytest.fixture(scope="session")
def bundled_pair():
    """(target, drafter, prompts): the bundled trained pair in float32 and the code prompts
    tokenized (tests/_pair.py: the drafter that losslessness tests use)."""
    import dflash_jax as dj
    from dflash_jax.data.tokenizer import load_tokenizer

    target = dj.load_target(os.path.join(_pair.PAIR, "target"), dtype="float32")
    drafter = dj.load_drafter(os.path.join(_pair.PAIR, "drafter"), target=target)
    tok = load_tokenizer(os.path.join(_pair.PAIR, "target"))
    return target, drafter, [tok.encode(c) for c in _pair.CODE]


# The test files whose subject is what the TPU / GPU compiler makes of a program.
PRODUCTION_COMPILE_FILES = ("test_tpu_compile.py", "test_gpu_compile.py", "test_hbm_model.py")


@pytest.fixture(autouse=True)
def _production_compiles(request):
    """Full compiler optimization for the tests of PRODUCTION_COMPILE_FILES (see the cheap
    compiles above)."""
    if os.path.basename(str(request.path)) not in PRODUCTION_COMPILE_FILES:
        yield
        return
    import jax

    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="session")
def rng():
    return np.random.RandomState(1234)


# ------------------------------------------------------------------------ xdist scheduling
# `make test` runs two workers with --dist loadfile (a file's tests stay on one worker). xdist
# would hand out files by their number of tests, which puts the few-test, minutes-long files
# (subprocess launches) last, where one worker runs them while the other idles. Instead the
# files go out longest first (per-file seconds from `--durations=0`, 2026-12-03; the
# subprocess launches first), so both workers stay busy until near the end; unlisted files
# (seconds each) follow in collection order. The two files that keep more than one core busy
# (the 8-device subprocess of test_sharding.py; test_multiprocess.py's 8-device and 2-process
# launches) start together here: side by side they took 228 s and 373 CPU-s against 231 s one
# after the other. Started apart (each beside an in-process file: 2abaf35) four files on -n 2
# took 451 s against 502, but the whole suite 26:42 against 20:31-24:57 before (the 8-device
# fixture then ran beside test_tpu_compile.py's libtpu compiles, and both were slower): kept
# as it was until a side-by-side whole-suite comparison says otherwise (tests/README.md).
LONGEST_FIRST = (
    "test_multiprocess.py",
    "test_sharding.py",
    "test_training.py",
    "test_tpu_compile.py",
    "test_decoding.py",
    "test_infer.py",
    "test_sampled_lossless.py",
    "test_gguf.py",
    "test_tree.py",
    "test_notebook.py",
    "test_eagle3_decoding.py",
    "test_pallas_kernels.py",
    "test_training_fidelity.py",
    "test_gpu_compile.py",
    "test_moe.py",
    "test_layer_stack.py",
    "test_regen_reliability.py",
    "test_benchmark_cli_inputs.py",
    "test_grouped_matmul.py",
    "test_dflash2.py",
    "test_sliding_window.py",
    "test_prompt_lookup.py",
    "test_eval_tau.py",
    "test_cli_usage.py",
    "test_target_flash.py",
    "test_quantized.py",
    "test_bf16_divergence.py",
    "test_chat_regen.py",
    "test_cli_probe.py",
    "test_drafter_grid.py",
    "test_compare_drafters.py",
    "test_grad_accum.py",
    "test_validation.py",
    "test_model.py",
    "test_checkpoint.py",
    "test_interrupts.py",
    "test_drafter.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


# The newest jax (`make test-newest`) runs a named subset: every file but the host-side tests
# marked `once` and these, marked `variant` here. Each runs the programs of a core file (decoding,
# training, the model, the kernels, sharding, the compiles) under another drafter kind, loss or
# data path, through the same jax APIs (jit, while_loop, scan, shard_map, Pallas, Orbax) that the
# core files exercise on both versions; the oldest jax runs them all (tests/README.md).
VARIANT_FILES = (
    "test_eagle3.py",
    "test_eagle3_decoding.py",
    "test_eagle3_training.py",
    "test_dflash2.py",
    "test_sliding_window.py",
    "test_prompt_lookup.py",
    "test_bf16_divergence.py",
    "test_training_fidelity.py",
    "test_grad_accum.py",
    "test_draft_vocab.py",
    "test_tap_store.py",
    "test_chat_regen.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if os.path.basename(str(item.path)) in VARIANT_FILES:
            item.add_marker(pytest.mark.variant)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))
