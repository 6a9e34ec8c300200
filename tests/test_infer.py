"""infer.py end to end on a small random pair with a real tokenizer (subprocess)."""

import io
import json
import os
import re
import subprocess
import sys

import pytest

import dflash_jax as dj
from dflash_jax.models.target import init_params
from dflash_jax.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from dflash_jax.frontend import batch_runner, report, textgen

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = os.path.join(ROOT, "assets", "tiny-code")  # the bundled trained pair
CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "class Foo:\n    def __init__(self):\n        self.x = 1\n",
] * 20


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("infer")
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
    return root


def _run(*args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "infer.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@pytest.mark.once
def test_infer_cli_compares_with_ar_and_writes_json_and_profile(tmp_path):
    """On the bundled pair (a drafter that is accepted: some step commits several tokens), the
    tokens --json_out holds are those of an autoregressive run made here, not just what the
    program's own `identical_to_ar` says; the prompt-file forms; the profile trace and its
    named scopes."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "class Stack:\n    def __init__(self):\n        self.items = []"})
        + "\n"
        + json.dumps({"ids": [5, 6, 7]})
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    r = _run(
        f"--target={PAIR}/target",
        f"--drafter={PAIR}/drafter",
        f"--prompt_file={prompts}",
        "--max_new_tokens=12",
        f"--json_out={out}",
        f"--profile_dir={tmp_path / 'trace'}",
        "--compare_ar",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "speedup" in r.stdout and "tau" in r.stdout
    recs = sorted((json.loads(line) for line in open(out)), key=lambda rec: rec["index"])
    assert [rec["index"] for rec in recs] == [0, 1]
    assert recs[1]["prompt_ids"] == [5, 6, 7]
    assert all(rec["identical_to_ar"] is True for rec in recs)
    assert all(len(rec["tokens"]) == 12 for rec in recs)  # the bundled pair has no stop here
    # The drafter was accepted: some step committed more than one token.
    assert max(max(rec["acceptance_lengths"]) for rec in recs) > 1, recs
    # Greedy autoregressive decoding of the same prompt ids, in this process (the batch padded
    # as infer.py pads it, so the session's compile cache has the program).
    target = dj.load_target(f"{PAIR}/target", dtype="float32")
    stop = textgen.stop_token_ids(f"{PAIR}/target", load_tokenizer(f"{PAIR}/target"))
    ids = [rec["prompt_ids"] for rec in recs]
    ar = dj.generate(target, None, ids + [ids[-1]] * 6, max_new_tokens=12, stop_token_ids=stop)
    assert [rec["tokens"] for rec in recs] == ar.tokens[:2]
    # The trace, with the named scopes of the decode step (docs/usage.md): the XPlane holds
    # the programs' op names, jit(...)/.../draft/... and so on.
    traces = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "trace") for f in fs]
    xplanes = [f for f in traces if f.endswith(".xplane.pb")]
    assert xplanes, traces
    blob = b"".join(open(f, "rb").read() for f in xplanes)
    for scope in (b"/prefill/", b"/draft/", b"/verify/", b"/accept/"):
        assert scope in blob, scope


@pytest.mark.once
def test_infer_cli_streams_the_completion_it_reports():
    """--stream with --tree_budget on the bundled pair (trees that are accepted): an extra run
    prints the prompt and the completion as steps commit it; the timed runs after it report
    the same text, identical to autoregressive decoding, with several tokens per step."""
    r = _run(
        f"--target={PAIR}/target",
        f"--drafter={PAIR}/drafter",
        "--prompt=def add(a, b):",
        "--max_new_tokens=24",
        "--tree_budget=8",
        "--stream",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "\x1b" not in r.stdout  # a pipe, not a terminal: no escape codes (console.style)
    streamed, reported = r.stdout.split("\n=== prompt 0: ")
    text = reported.split("\n", 1)[1].split("\n\nDFlash: ")[0]
    assert text.startswith("def add(a, b):") and len(text) > len("def add(a, b):")
    # Streamed pieces may split a multi-byte character: compared on the ASCII characters,
    # which decode alike either way.
    ascii_ = lambda t: "".join(ch for ch in t if ord(ch) < 128).strip("\n")
    assert ascii_(streamed.split("backend cpu\n", 1)[1]) == ascii_(text)
    assert "outputs identical: True" in r.stdout
    tau = float(re.search(r"tau ([0-9.]+)", r.stdout).group(1))
    assert tau > 1.5, r.stdout


class _CharTok:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class _TTY(io.StringIO):
    def isatty(self):
        return True


def test_report_prints_what_infer_prints_and_bolds_only_on_a_terminal(monkeypatch):
    """report.print_run: the per-prompt sections, the totals and the comparison line."""
    monkeypatch.delenv("NO_COLOR", raising=False)
    prompts = [[ord(c) for c in "ab"], [ord(c) for c in "cd"]]
    recs = [
        {"new_tokens": 2, "tau": 2.0, "tokens_per_s": 10.0, "tokens": [120, 121], "text": "xy"},
        {"new_tokens": 1, "tau": 1.0, "tokens_per_s": 5.0, "tokens": [122], "text": "z"},
    ]
    recs[1]["identical_to_ar"] = False
    totals = {
        "prompts": 2,
        "new_tokens": 3,
        "tau": 1.5,
        "decode_tokens_per_s": 7.5,
        "prefill_s": 0.002,
        "tau_per_prompt": {"min": 1.0, "median": 1.5, "max": 2.0},
        "ar_decode_tokens_per_s": 5.0,
        "speedup": 1.5,
        "identical_to_ar": False,
    }
    rep = batch_runner.BatchReport(records=recs, totals=totals)
    kw = dict(tokenizer=_CharTok(), batch_size=2, with_drafter=True)
    out = io.StringIO()
    report.print_run(rep, prompts, out=out, **kw)
    assert out.getvalue() == (
        "\n=== prompt 0: 2 tokens, tau 2.00, 10.0 tok/s (batch of 2) ===\nabxy\n"
        "\n=== prompt 1: 1 tokens, tau 1.00, 5.0 tok/s (batch of 2) ===\ncdz\n"
        "!!! speculative output differs from autoregressive output\n"
        "\nDFlash: 2 prompts in batches of 2, 3 tokens, tau 1.50 (per prompt 1.00..2.00), "
        "7.5 tok/s decode, prefill 2.0 ms\n"
        "autoregressive: 5.0 tok/s decode; speedup 1.50x; outputs identical: False\n"
    )
    tty = _TTY()
    report.print_run(rep, prompts, out=tty, **kw)
    assert "ab\x1b[1mxy\x1b[0m" in tty.getvalue()
    monkeypatch.setenv("NO_COLOR", "1")
    tty = _TTY()
    report.print_run(rep, prompts, out=tty, **kw)
    assert "\x1b" not in tty.getvalue()
    # Written to a file: headers only, and where it went.
    out = io.StringIO()
    report.print_run(rep, prompts, out=out, json_out="o.jsonl", **dict(kw, tokenizer=None))
    assert "abxy" not in out.getvalue() and out.getvalue().endswith(
        "wrote o.jsonl (2 JSON lines)\n"
    )
    assert report.completion(None, [1, 2], recs[0]) == "[1, 2] -> [120, 121]"
    assert report.interrupted_line(None) is None
    assert "was not written" in report.interrupted_line("o.jsonl", batches_done=0)


def test_stop_token_ids_join_the_tokenizer_eos_and_generation_config(tmp_path):
    class Tok:
        eos_id = 1

    assert textgen.stop_token_ids(str(tmp_path), Tok()) == [1]
    assert textgen.stop_token_ids(str(tmp_path)) == [] and textgen.stop_token_ids(None) == []
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1]}))
    assert textgen.stop_token_ids(str(tmp_path), Tok()) == [1, 7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert textgen.stop_token_ids(str(tmp_path)) == [3]


@pytest.mark.once
def test_infer_cli_rejects_bad_input_clearly(pair_dirs):
    """Bad input: exit status 2 and one `error:` line on stderr (README, dflash_jax/support/cli.py)."""
    for args, says in (
        (
            [f"--target={pair_dirs / 'target'}", "--prompt=", "--max_new_tokens=4"],
            "prompt 0 is empty",
        ),
        (
            [f"--target={pair_dirs / 'target'}", "--prompt=x", "--max_new_tokens=100000"],
            "max_position_embeddings",
        ),
        (["--target=/nonexistent/dir"], "not found"),
    ):
        r = _run(*args)
        assert r.returncode == 2, (args, r.returncode, r.stderr[-2000:])
        lines = r.stderr.strip().splitlines()
        assert lines[-1].startswith("error: ") and says in lines[-1], (args, lines)
        assert "Traceback" not in r.stderr, args


@pytest.mark.slow  # a benchmark script end to end: `make test`, not `make test-fast`
@pytest.mark.once
def test_dry_run_clis_report_memory_and_flops():
    r = _run(
        "--dry_run",
        "--dry_run_model=small",
        "--topology=cpu:2",
        "--mesh=tensor=2",
        "--context=64",
        "--max_new_tokens=16",
        "--attention_impl=xla",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mesh [tensor=2]" in r.stdout and "TOTAL GiB/dev" in r.stdout
    assert "dflash_decode" in r.stdout and "ar_decode" in r.stdout
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "--config=" + os.path.join(ROOT, "configs/tiny_test.py"),
            "--dry_run",
            "--dry_run_model=small",
            "--topology=cpu:2",
            "--mesh=fsdp=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train_step" in r.stdout and "batch 8x64" in r.stdout  # the config's batch


def test_dry_run_on_a_cpu_topology_works_with_the_default_attention(tmp_path):
    """`python -m dflash_jax.dry_run --topology=cpu:N` as documented, without --attention: XLA's
    attention on CPU devices (the Pallas kernels have no compiled CPU version); --hlo_dir
    writes the compiled program's optimized HLO, whose loop body the HLO reader finds."""
    from dflash_jax.dry_run import hlo

    r = subprocess.run(
        [sys.executable, "-m", "dflash_jax.dry_run", "--topology=cpu:2", "--model=small"]
        + ["--context=64", "--max_new_tokens=16", "--programs=dflash_decode"]
        + [f"--hlo_dir={tmp_path}/hlo"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dflash_decode" in r.stdout and "TOTAL GiB/dev" in r.stdout
    assert sorted(os.listdir(tmp_path / "hlo")) == ["dflash_decode.hlo"]
    text = (tmp_path / "hlo" / "dflash_decode.hlo").read_text()
    assert "HloModule" in text and hlo.loop_body_computations(text)


@pytest.mark.once
def test_dry_run_cli_bad_input_is_one_line_exit_2():
    for args, says in (
        (["--topology=v9x:2x4"], "unknown topology"),
        (["--topology=cpu:2", "--mesh=tensor=4"], "mesh"),
        (["--topology=cpu:2", "--dry_run_model=nope"], "unknown model"),
    ):
        r = _run("--dry_run", *args)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and says in last, last


@pytest.mark.slow  # a benchmark script end to end: `make test`, not `make test-fast`
@pytest.mark.once
def test_benchmark_script_writes_results_and_checks_greedy_identity(tmp_path):
    """benchmarks/bench_dflash.py on the bundled pair (two prompts, one setting per temperature,
    16 tokens): JSON, Markdown and plots written; greedy DFlash matched AR (else it exits 1)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "import os\n\n\ndef read(path):"})
        + "\n"
        + json.dumps({"prompt": "class Stack:\n    def push(self, x):"})
        + "\n"
    )
    out = tmp_path / "bench"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "bench_dflash.py"),
            f"--prompt_file={prompts}",
            f"--out_dir={out}",
            "--max_new_tokens=16",
            "--repeats=1",
            "--block_sizes=8",
            "--temperatures=0,1",
            "--denoise_steps=1",
            "--batch_sizes=1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.load(open(out / "results.json"))
    assert [(row["temperature"], row["block_size"]) for row in res["rows"]] == [(0, 8), (1, 8)]
    g = res["meta"]["greedy_text"]
    assert g["completions"] == 2 and 0 < g["distinct_4gram_median"] <= 1
    assert all(1 <= row["tau"] <= 8 and row["speedup"] > 0 for row in res["rows"])
    assert "token-identical" in (out / "results.md").read_text()
    assert (out / "acceptance.png").stat().st_size > 0 and (out / "speedup.png").stat().st_size > 0


@pytest.mark.once
def test_op_costs_script_times_the_token_choosers():
    r = subprocess.run(
        # A few calls per chooser: the script end to end, not its figures (1000 by default).
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "experiments", "token_choosers", "op_costs.py"),
            "--iters=5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])["choosers_us"]
    assert set(res) == {
        "jnp.argmax",
        "sampling.greedy_argmax",
        "jax.random.categorical",
        "sampling.sample_categorical",
    } and all(v > 0 for v in res.values())


@pytest.mark.once
def test_compile_flags_script_refuses_a_bad_depth_before_any_compile():
    """`benchmarks/compile_flags.py --layers` (compile seconds per target depth): a depth the
    drafter's 3 taps do not fit, or not a number, is refused in one line, nothing compiled."""
    script = os.path.join(ROOT, "benchmarks", "compile_flags.py")
    for value, message in (("2", "--layers: at least 3"), ("4,x", "whole numbers, got 4,x")):
        bad = subprocess.run(
            [sys.executable, script, f"--layers={value}"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert bad.returncode != 0 and message in bad.stderr and not bad.stdout, bad.stderr


@pytest.mark.once
def test_repetition_script_compares_greedy_completions_with_the_real_continuation(tmp_path):
    """benchmarks/repetition.py: the real continuation of a looping file scores low, a varied
    one high; the bundled target's completions are scored per prompt cut."""
    loop = "x = 1\n" * 40
    varied = "".join(f"value_{i} = compute_{i}(arg_{i}) + {i * 7}\n" for i in range(40))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "def f():\n", "reference": loop})
        + "\n"
        + json.dumps({"prompt": "def g():\n", "reference": varied})
        + "\n"
    )
    out = tmp_path / "rep.json"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "repetition.py"),
            f"--prompt_file={prompts}",
            f"--out={out}",
            "--max_new_tokens=16",
            "--prompt_tokens=8,4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.load(open(out))
    assert res["reference"]["n"] == 2 and res["reference"]["share_below"] == 0.5
    assert res["reference"]["mean"] < 0.8
    for key in ("greedy_prompt8", "greedy_prompt4"):
        assert res[key]["n"] == 2 and 0 < res[key]["median"] <= 1
    assert res["greedy_prompt4"]["median_prompt_tokens"] <= 4


@pytest.mark.slow  # a benchmark script end to end: `make test`, not `make test-fast`
@pytest.mark.once
def test_scale_costs_script_times_both_loops_per_target_size(tmp_path):
    out = tmp_path / "scale.json"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "scale_costs.py"),
            "--sizes=128x6",
            "--tokens=8",
            "--repeats=1",
            "--context=16",
            f"--json_out={out}",
            f"--plot={tmp_path / 'scale.png'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (row,) = json.load(open(out))["rows"]
    assert (row["width"], row["layers"]) == (128, 6) and row["params"] > 1e6
    assert row["ar_step_ms"] > 0 and row["dflash_step_ms"] > 0
    assert abs(row["ceiling"] * row["step_over_ar"] - 16) < 1e-6
    assert (tmp_path / "scale.png").stat().st_size > 0
    redraw = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "scale_costs.py"),
            f"--from_json={out}",
            f"--plot={tmp_path / 're.png'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert redraw.returncode == 0 and (tmp_path / "re.png").stat().st_size > 0, redraw.stderr
    bad = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "scale_costs.py"), "--sizes=100x2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert bad.returncode != 0 and "multiple of 128" in bad.stderr


def test_plot_training_chains_stages_and_rejects_empty_files(tmp_path):
    def write(name, rows):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    t1 = write(
        "t1.jsonl",
        [{"split": "train", "step": s, "loss": 5.0 - s / 100} for s in range(10, 110, 10)]
        + [{"split": "eval", "step": 100, "loss": 4.2}],
    )
    t2 = write("t2.jsonl", [{"split": "train", "step": s, "loss": 4.0} for s in (10, 20)])
    d1 = write("d1.jsonl", [{"split": "eval", "step": 50, "loss": 2.0, "tau": 2.5}])
    script = os.path.join(ROOT, "benchmarks", "plot_training.py")
    out = tmp_path / "curves.png"
    r = subprocess.run(
        [
            sys.executable,
            script,
            f"--target_runs={t1},{t2}",
            f"--drafter_runs={d1}",
            f"--out={out}",
            "--smooth=3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.stat().st_size > 0
    from benchmarks import plot_training

    stages = plot_training.read_stages([t1, t2])
    assert [s[2] for s in stages] == [0, 100]  # stage 2 starts after stage 1's last step
    empty = write("e.jsonl", [{"split": "other", "step": 1}])
    bad = subprocess.run(
        [sys.executable, script, f"--target_runs={empty}", f"--drafter_runs={d1}", f"--out={out}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert bad.returncode != 0 and "no train or eval rows" in bad.stderr


@pytest.mark.slow  # a benchmark script end to end: `make test`, not `make test-fast`
@pytest.mark.once
def test_gpu_steps_tiny_configuration_times_ar_and_dflash_steps(tmp_path):
    """benchmarks/gpu_steps.py --preset=tiny on CPU (XLA attention only there): every row has
    AR and DFlash step times > 0 and their ratio; the JSON names the command, jax, the device
    kind and the commit."""
    out = tmp_path / "gpu_steps.json"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "gpu_steps.py"),
            "--preset=tiny",
            "--contexts=64",
            "--batches=1,2",
            "--loop_tokens=8",
            "--repeats=1",
            "--compile_threads=2",
            f"--json_out={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.load(open(out))
    assert res["command"].startswith("python benchmarks/gpu_steps.py --preset=tiny")
    assert res["jax_version"] and res["device_kind"] and res["commit"]
    assert res["settings"]["impls"] == ["xla"] and not res["skipped"]
    assert [(row["batch"], row["context"]) for row in res["rows"]] == [(1, 64), (2, 64)]
    for row in res["rows"]:
        assert "error" not in row, row
        assert row["ar_step_ms"] > 0 and row["dflash_step_ms"] > 0
        assert row["ratio"] == pytest.approx(row["dflash_step_ms"] / row["ar_step_ms"])
        assert row["projected_speedup"] == pytest.approx(6.5 / row["ratio"])
        assert row["ar_steps"] == 7 and 1 <= row["dflash_steps"] <= 7
    assert "| xla | 2 | 64 |" in r.stdout


def test_gpu_steps_cudnn_variant_is_an_attention_impl(monkeypatch):
    """What `for_devices` makes of "pallas" for a GPU under DFLASH_PALLAS_GPU_BACKEND=cudnn
    (gpu_steps' cuDNN rows) is an attention_impl the models accept, run by the cuDNN kernels."""
    from dflash_jax.models import attention

    monkeypatch.setenv("DFLASH_PALLAS_GPU_BACKEND", "cudnn")
    impl = attention.for_devices("pallas", "cuda")
    assert impl == "pallas_cudnn" and attention.resolve_impl(impl) == impl
    assert attention._kernel_impl(impl) == "cudnn" and attention.causal_kernel(impl) == "xla"
