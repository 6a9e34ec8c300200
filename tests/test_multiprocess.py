"""Several JAX processes on this machine (a pod slice in miniature), through the launcher:
`python -m dflash_jax.launch --num_processes=2 --devices_per_process=4 -- ...` gives 2 CPU
processes of 4 fake devices each, one process group of 8 devices (gloo collectives).

- generate on a mesh over both processes equals the single-process result computed in the test
  process itself (tokens, acceptance lengths and every drafted token) on every process, DFlash
  with the bundled trained pair (accepted) and autoregressive; infer.py reports from process 0
  only;
- train.py, a drafter against a frozen Qwen3-MoE target on data=2,expert=2,fsdp=2 over 2
  processes (the experts split over `expert`, run expert parallel), gives the losses, tau and
  exported drafter of 1 process with 8 devices, and survives SIGTERM of one process (both save,
  coordinated; the resumed run has the same losses). (A crash's checkpoints:
  `test_training.py`'s resume and corrupt-checkpoint checks. Dense sharded training, data=2,fsdp=4
  with resume and export, is the 8-device `fsdp_training` check of `test_sharding.py`.)
- the launcher names a process that dies, stops the rest and exits non-zero in time.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

# Minutes of subprocess launches: left out of `make test-fast` (the edit loop), run by `make test`.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = [sys.executable, "-m", "dflash_jax.launch"]


def _env(**extra):
    """This session's environment without an inherited device count (the launcher sets its
    own); the suite's other XLA flags (conftest's cheap compiles) stay."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")
    ).strip()
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


def _launch(args, timeout, **env):
    t0 = time.monotonic()
    proc = subprocess.run(
        LAUNCH + args, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def _lines(out, process):
    return [
        line[len(f"[{process}] ") :]
        for line in out.splitlines()
        if line.startswith(f"[{process}] ")
    ]


# ------------------------------------------------------------------------------- generate


def _worker_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_multiprocess_worker", os.path.join(ROOT, "tests", "_multiprocess_worker.py")
    )
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker


@pytest.fixture(scope="module")
def generation(tmp_path_factory):
    """(results by process, launch output, out_dir, reference). The reference is this (pytest)
    process alone, one device, no process group: the same pair, prompts and settings
    (tests/_multiprocess_worker.py's `reference`), computed while the group runs."""
    out_dir = tmp_path_factory.mktemp("mp_generate")
    args = [
        "--num_processes=2",
        "--devices_per_process=4",
        "--timeout=500",
        "--",
        "tests/_multiprocess_worker.py",
        "generate",
        str(out_dir),
    ]
    log = out_dir / "launch.log"
    with open(log, "w") as f:  # a file, not a pipe: nothing blocks while the reference runs
        proc = subprocess.Popen(
            LAUNCH + args, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT
        )
    try:
        reference = _worker_module().reference()
        proc.wait(timeout=560)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    assert proc.returncode == 0, out[-6000:]
    results = {}
    for p in (0, 1):
        found = [
            json.loads(line[len("RESULT ") :])
            for line in _lines(out, p)
            if line.startswith("RESULT ")
        ]
        assert len(found) == 1, out[-6000:]
        results[p] = found[0]
    return results, out, out_dir, reference


def test_generate_across_processes_equals_single_process(generation):
    results, _, _, (ref_tokens, ref_acc, ref_drafts, ref_moe) = generation
    r0, r1 = results[0], results[1]
    assert len(set(r0["prompt_lens"])) == 4  # mixed lengths
    # The drafter is accepted (a drafter never accepted would make DFlash == AR anyway):
    # over 1.5 tokens per target pass, and some step commits 3 or more.
    flat = [a for seq in ref_acc for a in seq]
    assert sum(flat) / len(flat) > 1.5 and max(flat) >= 3, ref_acc
    # Every step's draft is recorded whole: the block's 15 drafted ids, rejected ones too.
    assert [len(seq) for seq in ref_drafts] == [len(seq) for seq in ref_acc]
    assert all(len(d) == 15 for seq in ref_drafts for d in seq)
    for r in (r0, r1):
        tokens, acc, drafts = r["got"]
        assert tokens == ref_tokens and acc == ref_acc
        # The sharded drafter drafts the same blocks: every accepted draft exactly, and all
        # but a few rejected ones. A rejected draft is a low-confidence argmax, where another
        # reduction order (heads split over tensor) may flip a near-tie (seen here on jax
        # 0.10.2, as in test_sharding on 0.12: the floats differ in the last bits).
        accepted = (
            lambda ds_all: [  # noqa: E731
                [d[: a - 1] for d, a in zip(ds, ac)] for ds, ac in zip(ds_all, acc)
            ]
        )
        assert accepted(drafts) == accepted(ref_drafts)
        pairs = [
            (x, y)
            for dg, dr in zip(drafts, ref_drafts)
            for sg, sr in zip(dg, dr)
            for x, y in zip(sg, sr)
        ]
        assert len(pairs) > 0 and sum(x == y for x, y in pairs) >= 0.9 * len(pairs)
        assert r["got_ar"] == ref_tokens  # sharded AR: lossless DFlash = greedy AR
        assert r["stats"]["mesh"] == "data=2,tensor=4"
        assert r["stats"]["tau"] > 1.5 and max(max(a) for a in acc) >= 3, acc
    # A Qwen3-MoE target expert parallel over both processes (expert=4,data=2): the
    # single-process tokens and acceptance, the drafter accepted.
    moe_tokens, moe_acc = ref_moe
    assert max(max(a) for a in moe_acc) >= 3, moe_acc
    for r in (r0, r1):
        assert r["moe"] == [moe_tokens, moe_acc, "data=2,expert=4"]
    # Every process returns the same result, stats included (timings are process 0's).
    assert r0["got"] == r1["got"]
    assert r0["stats"] == r1["stats"] and r0["stats_ar"] == r1["stats_ar"]


def test_infer_reports_from_process_zero_only(generation):
    _, out, out_dir, reference = generation
    assert sum(line.startswith("=== prompt") for line in _lines(out, 0)) == 4
    assert not any("=== prompt" in line or line.startswith("DFlash:") for line in _lines(out, 1)), (
        out[-4000:]
    )
    written = [json.loads(x) for x in open(os.path.join(out_dir, "infer.json"))]  # JSON Lines
    assert [r["tokens"] for r in sorted(written, key=lambda r: r["index"])] == reference[0]


# ------------------------------------------------------------------------------- training


COMMON = [
    "--config=configs/tiny_test.py",
    "--config.mesh=data=2,expert=2,fsdp=2",
    "--config.num_train_steps=12",
    "--config.log_every=1",
    "--config.eval_every=12",
    "--config.checkpoint_every=3",
    "--config.regen.num_prompts=64",
    "--config.eval_num_prompts=4",
    "--config.eval_max_new_tokens=16",
]


def _records(workdir, split):
    """{step: record}, the last record of each step (a resumed run logs some steps again)."""
    out = {}
    for line in open(os.path.join(workdir, "metrics.jsonl")):
        rec = json.loads(line)
        if rec["split"] == split:
            out[rec["step"]] = rec
    return out


def _launch_until(args, workdir, trigger_dir, action, timeout, **env):
    """Runs the launcher; once `workdir/checkpoints/<trigger_dir>` exists calls
    action(pids). Returns (exit code, output)."""
    log = os.path.join(workdir + ".log")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            LAUNCH + args, cwd=ROOT, env=_env(**env), stdout=f, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + timeout
    pids, fired = None, False
    while proc.poll() is None and time.monotonic() < deadline:
        if pids is None:
            m = re.search(r"pids (\d+) (\d+)", open(log).read())
            pids = [int(m.group(1)), int(m.group(2))] if m else None
        if not fired and pids and os.path.isdir(os.path.join(workdir, "checkpoints", trigger_dir)):
            action(pids)
            fired = True
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    assert fired, open(log).read()[-6000:]
    return proc.returncode, open(log).read()


def _moe_target(path):
    """configs/tiny_test.py's fresh random peaky target (2 layers, hidden 64, vocab 64) turned
    Qwen3-MoE (`_pair.moe_from_dense`: 4 experts, each a perturbed copy of its layer's MLP,
    top 2, random routers, both layers MoE), written as a Hugging Face checkpoint."""
    from _pair import moe_from_dense

    import dflash_jax as dj
    from configs import tiny_test
    from dflash_jax.training.experiment import fresh_target_params, model_config_from

    c = tiny_test.get_config()
    cfg = model_config_from(c, 0)
    dense = dj.Target(cfg, fresh_target_params(cfg, c.target_model))
    target = moe_from_dense(dense, mlp_only_layers=())
    assert target.config.num_experts == 4 and all(target.config.layer_is_moe(i) for i in (0, 1))
    dj.save_target(target, path)
    return path


@pytest.fixture(scope="module")
def training(tmp_path_factory, eight_devices, compile_cache):
    """A drafter against a frozen MoE target on data=2,expert=2,fsdp=2: (reference workdir, the
    2-process workdir, {run: (exit code, output)}). The mesh puts each process on one `data`
    index: the expert and fsdp groups lie within a process, the gradients' data all-reduce
    spans both (gloo)."""
    base = tmp_path_factory.mktemp("mp_train")
    ref_dir, mp_dir = str(base / "one_process"), str(base / "two_processes")
    common = [*COMMON, f"--config.target_path={_moe_target(str(base / 'moe_target'))}"]
    # Reference: 1 process, 8 devices, the same global batches (2 data streams).
    proc = subprocess.run(
        [sys.executable, "train.py", *common, f"--workdir={ref_dir}", "--config.data.num_shards=2"],
        cwd=ROOT,
        env=eight_devices.env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {"reference": (proc.returncode, proc.stdout + proc.stderr)}
    regen = os.path.join(ref_dir, "regenerated.jsonl")
    mp = [
        "--num_processes=2",
        "--devices_per_process=4",
        "--timeout=1100",
        "--grace=20",
        "--",
        "train.py",
        *common,
        f"--workdir={mp_dir}",
        f"--config.regen.output={regen}",
    ]

    # Two launches of the same programs (the 2nd loads them from the cache):
    # 1. SIGTERM to process 1 alone once step 6 is saved: both save and stop (coordinated).
    runs["terminated"] = _launch_until(
        mp, mp_dir, "6", lambda pids: os.kill(pids[1], signal.SIGTERM), 1200, **compile_cache
    )
    # 2. Resumed to the end (in-loop tau on step 12 with the 2-process generate; export).
    runs["finished"] = _launch(mp, 1200, **compile_cache)[:2]
    return ref_dir, mp_dir, runs


def test_two_process_training_equals_one_process_and_resumes(training):
    ref_dir, mp_dir, runs = training
    # Both layouts: the MoE target's 4 experts 2 per device, E over `expert` (H over `fsdp`).
    moe = (
        "MoE target: 4 experts (top 2) in 2 layers, 2 per device; "
        "gate_proj [E over expert, I replicated, H over fsdp]"
    )
    assert "mesh data=2,fsdp=2,expert=2]" in runs["reference"][1]
    assert moe in runs["reference"][1], runs["reference"][1][-3000:]
    for run in ("terminated", "finished"):
        assert f"[0] {moe}" in runs[run][1], runs[run][1][-3000:]
    rc, out = runs["terminated"]
    assert rc == 3, out[-6000:]  # preempted: saved and stopped (cli.EXIT_PREEMPTED), not success
    m = re.search(r"\[0\] signal (\d+|to another process): saving step (\d+)", out)
    assert m and 6 <= int(m.group(2)) < 12, out[-3000:]
    stopped = int(m.group(2))
    rc, out = runs["finished"]
    assert rc == 0, out[-6000:]
    assert f"[0] resumed from step {stopped}" in out, out[-3000:]
    assert "exported to" in out

    ref, got = _records(ref_dir, "train"), _records(mp_dir, "train")
    assert sorted(ref) == sorted(got) == list(range(1, 13))
    l1 = [ref[s]["loss"] for s in range(1, 13)]
    l2 = [got[s]["loss"] for s in range(1, 13)]
    # The same partitioned program on the same global batches; only the order in which
    # float32 partial sums are reduced differs (in-process vs gloo all-reduce): ~1e-7 relative
    # per step, 1e-5 leaves room for 12 AdamW steps. A wrong batch or resume point is O(1).
    assert np.allclose(l1, l2, atol=0, rtol=1e-5), (l1, l2)
    assert l2[-1] < l2[0] - 1.0  # it trained
    tau1, tau2 = _records(ref_dir, "eval")[12]["tau"], _records(mp_dir, "eval")[12]["tau"]
    assert tau1 == pytest.approx(tau2, abs=1e-6)
    # Written once: a second writer would add lines / event files.
    lines = [json.loads(x) for x in open(os.path.join(mp_dir, "metrics.jsonl"))]
    assert sum(r["split"] == "eval" for r in lines) == 1
    assert len(os.listdir(os.path.join(mp_dir, "tb", "eval"))) == 1
    assert len(os.listdir(os.path.join(mp_dir, "tb", "train"))) == 2  # one per run
    from safetensors.numpy import load_file

    def weights(d):
        d = os.path.join(d, "export", "drafter")
        return {
            k: v
            for f in os.listdir(d)
            if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(d, f)).items()
        }

    w1, w2 = weights(ref_dir), weights(mp_dir)
    assert sorted(w1) == sorted(w2)
    for k in w1:
        np.testing.assert_allclose(w1[k], w2[k], atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------- launcher


def test_launcher_names_a_dying_process_and_stops_the_group():
    # Process 1 raises; process 0 sits in a barrier ignoring SIGTERM: SIGKILL after --grace.
    rc, out, seconds = _launch(
        [
            "--num_processes=2",
            "--devices_per_process=1",
            "--timeout=120",
            "--grace=2",
            "--",
            "tests/_multiprocess_worker.py",
            "die",
        ],
        180,
    )
    assert rc == 1, out[-3000:]
    assert "[launch] process 1 exited with code 1; stopping the others" in out
    assert "RuntimeError: process 1 fails" in out
    assert "SIGKILL" in out and seconds < 100, (seconds, out[-3000:])
    # A group that outlives --timeout is stopped with exit code 124.
    rc, out, seconds = _launch(
        [
            "--num_processes=2",
            "--timeout=2",
            "--grace=1",
            "--",
            "-c",
            "import time; time.sleep(60)",
        ],
        60,
    )
    assert rc == 124 and "timeout" in out and seconds < 20, (rc, seconds, out)


# ---------------------------------------------------------------------- data streams (1 process)


def test_sharded_batches_are_the_streams_stacked_and_resume():
    """The global batch of `num_shards` streams (what 2 processes read, one stream each) is the
    same in one process, and its per-stream position resumes exactly."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dflash_jax.data.packing import PackedBatchIterator
    from dflash_jax.parallel import distributed

    rng = np.random.RandomState(0)
    docs = [
        (rng.randint(1, 50, n).astype(np.int32), np.ones(n, np.int32))
        for n in rng.randint(3, 40, 30)
    ]

    def make(**kw):
        return PackedBatchIterator(docs, lambda d: d, seq_len=16, seed=3, **kw)

    sh = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
    it = distributed.shard_batches(make(batch_size=4), sh, num_shards=2)
    assert (
        distributed.shard_batches(make(batch_size=4), sh, num_shards=1).__class__
        is PackedBatchIterator
    )
    streams = [make(batch_size=2, host_id=s, num_hosts=2) for s in (0, 1)]
    batches = [next(it) for _ in range(5)]
    for b in batches:
        want = [next(s) for s in streams]
        for k in ("input_ids", "loss_mask", "segment_ids"):
            np.testing.assert_array_equal(b[k], np.concatenate([w[k] for w in want]))
    it2 = distributed.shard_batches(make(batch_size=4), sh, num_shards=2)
    for _ in range(2):
        next(it2)
    state = it2.get_state()
    assert state["num_shards"] == 2 and len(state["shards"]) == 2
    it3 = distributed.shard_batches(make(batch_size=4), sh, num_shards=2)
    it3.set_state(json.loads(json.dumps(state)))
    for b in batches[2:]:
        np.testing.assert_array_equal(next(it3)["input_ids"], b["input_ids"])
    with pytest.raises(ValueError, match="data.num_shards=1"):
        it3.set_state(make(batch_size=4).get_state())
    with pytest.raises(ValueError, match="not divisible"):
        distributed.shard_batches(make(batch_size=4), sh, num_shards=3)
