"""benchmarks/experiments/regen/regen_speed.py end to end on the bundled tiny target: every
case and the capacity sweep timed (a larger cache gives the same tokens), the projection
written, the analytic step cost equal to a count of the target's parameters, and a bad flag one
line, exit 2, nothing written."""

import json
import os
import subprocess
import sys

import _pair
import pytest

from benchmarks.experiments.regen import regen_speed as rs

ROOT = _pair.ROOT
TARGET = os.path.join(_pair.PAIR, "target")
SCRIPT = os.path.join(ROOT, "benchmarks", "experiments", "regen", "regen_speed.py")


def _run(*args):
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def _records(tmp_path):
    """Regenerated-style records: the code prompts, recorded answers of 2..5 tokens."""
    from dflash_jax.data import load_tokenizer

    tok = load_tokenizer(TARGET)
    path = tmp_path / "responses.jsonl"
    lines = []
    for i, code in enumerate(_pair.CODE):
        p = list(tok.encode(code))
        lines.append({"prompt_ids": p, "turns": [{"prompt_ids": p, "response_ids": [5] * (2 + i)}]})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


@pytest.mark.once  # a script end to end
def test_cases_sweep_and_projection(tmp_path):
    out = tmp_path / "speed.json"
    ok = _run(
        f"--target={TARGET}", f"--prompts_from={_records(tmp_path)}", "--num_prompts=3",
        "--batch_sizes=1,3", "--new_tokens=3", "--capacities=256", "--project_new_tokens=4",
        f"--json_out={out}",
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "ms/step" in ok.stdout and "capacity sweep" in ok.stdout
    rec = json.loads(out.read_text())
    assert (
        rec["command"].startswith("python benchmarks/experiments/regen/regen_speed.py")
        and rec["commit"]
    )
    assert [(c["batch"], c["new_tokens"]) for c in rec["cases"]] == [(1, 3), (3, 3)]
    for c in rec["cases"]:
        assert c["batches"] == -(-3 // c["batch"]) and c["rows"] == 3
        assert 0 < c["answer_tokens"] <= 3 * 3 and 0 < c["row_utilization"] <= 1
        assert c["decode_s"] > 0 and c["decode_ms_per_step"] > 0 and c["capacity"] == [128]
        assert 0 < c["floor_live_ms"] <= c["floor_ms"]
    first, wide = rec["capacity_sweep"]
    assert first["capacity"] == [128] and wide["capacity"] == [256] and wide["same_tokens"]
    assert rec["step_model"]["capacities"] == [128.0, 256.0]
    proj = rec["projection"]
    assert proj["records"] == 4 and proj["answer_tokens"] == 2 + 3 + 4 + 4  # capped at 4
    assert set(proj["variants"]) == {name for name, _ in rs.VARIANTS}


def test_step_cost_counts_the_parameters():
    import jax
    from dflash_jax.models.target import load_target

    target = load_target(TARGET)
    cfg = target.config
    leaves = jax.tree_util.tree_flatten_with_path(target.params)[0]
    kernels = sum(x.size for path, x in leaves if "kernel" in str(path[-1]))
    head = cfg.vocab_size * cfg.hidden_size  # tied or not, the LM head is one V x H product
    cost = rs.step_cost(cfg, 1000, batch=4, slots=100)
    assert cost["flops"] - cost["flops_attention"] == 2 * 4 * (kernels + head)
    assert cost["flops_attention"] == 4 * 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 100
    assert cost["bytes_kv"] == 2 * cfg.num_layers * 4 * 100 * cfg.num_kv_heads * cfg.head_dim * 4
    assert cost["bytes"] == 1000 + cost["bytes_kv"]


def test_bad_flags_are_one_line_exit_2_and_write_nothing(tmp_path):
    out, recs = tmp_path / "speed.json", _records(tmp_path)
    for args, words in (
        ([f"--prompts_from={recs}", "--batch_sizes=0"], "--batch_sizes must be >= 1, got 0"),
        ([f"--prompts_from={recs}", "--capacities=x"], "--capacities: 'x' is not an integer"),
        ([f"--prompts_from={tmp_path / 'gone.jsonl'}"], "gone.jsonl: no such file"),
        ([f"--prompts_from={recs}", "--max_prompt_len=2"], "no prompt of at most 2 tokens"),
    ):
        bad = _run(*args, f"--target={TARGET}", f"--json_out={out}")
        assert bad.returncode == 2, bad.stderr
        assert bad.stderr.startswith("error: ") and words in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and not out.exists()
