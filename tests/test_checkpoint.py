"""Hugging Face checkpoint I/O: round trips, transformers interop, config variants, bad input."""

import gc
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import dflash_jax as dj
from dflash_jax.models.safetensors_io import (
    SafetensorsDir,
    SafetensorsFile,
    save_sharded,
    write_safetensors,
)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


@pytest.mark.parametrize("kind", ("qwen3_tied", "qwen3_untied", "llama3"))
def test_save_load_round_trip_exact_and_loads_in_transformers(
    kind, hf_checkpoints, hf_models64, tmp_path
):
    src, ref_model = hf_checkpoints[kind][0], hf_models64[kind]
    t = dj.load_target(src)
    out = tmp_path / "saved"
    dj.save_target(t, out)
    t2 = dj.load_target(out)
    for a, b in zip(jax.tree_util.tree_leaves(t.params), jax.tree_util.tree_leaves(t2.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert t2.config == t.config
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64).eval()
    ids = np.random.RandomState(3).randint(0, 128, (1, 20))
    with torch.no_grad():  # both in float64 (see hf_models64): the same weights agree closely
        want = ref_model(torch.tensor(ids)).logits.numpy()
        got = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-9)


def test_bfloat16_storage_and_float32_compute(hf_checkpoints, tmp_path):
    src, _ = hf_checkpoints["qwen3_untied"]
    t = dj.load_target(src)
    dj.save_target(t, tmp_path / "bf16", dtype="bfloat16")
    with SafetensorsFile(str(tmp_path / "bf16" / "model.safetensors")) as f:
        assert f.info("model.norm.weight")[0] == "BF16"
    cfg = json.load(open(tmp_path / "bf16" / "config.json"))
    assert cfg["torch_dtype"] == "bfloat16"
    t32 = dj.load_target(tmp_path / "bf16", dtype="float32")
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(t32.params))
    tbf = dj.load_target(tmp_path / "bf16", dtype="float32", param_dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(tbf.params))
    ids = np.arange(12)[None]
    a, b = t.forward(ids).logits, t32.forward(ids).logits
    assert float(jnp.abs(a - b).max()) < 0.1  # bf16 rounding only
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "bf16"), dtype=torch.float64
    )
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.tensor(ids)).logits.numpy(), np.asarray(b), atol=1e-4)


def test_sharded_checkpoint_loads(hf_checkpoints, tmp_path):
    src, _ = hf_checkpoints["llama3"]
    t = dj.load_target(src)
    d = tmp_path / "sharded"
    tensors = dj.models.checkpoint.params_to_hf(t.params, prefix="model.", dtype="float32")
    save_sharded(str(d), tensors, max_shard_bytes=200_000)
    shutil.copy(os.path.join(src, "config.json"), d / "config.json")
    index = json.load(open(d / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1
    t2 = dj.load_target(d)
    np.testing.assert_array_equal(
        np.asarray(t.forward(np.arange(9)[None]).logits),
        np.asarray(t2.forward(np.arange(9)[None]).logits),
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d))  # transformers reads it too
    assert hf.config.num_hidden_layers == 4
    # Saved again into the same directory as one file: the old shards and index are gone (a
    # loader would otherwise read the stale weights); other files stay.
    old_shards = set(index["weight_map"].values())
    (d / "notes.txt").write_text("mine")
    doubled = {k: 2 * v for k, v in tensors.items()}
    save_sharded(str(d), doubled)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    t3 = dj.load_target(d)
    np.testing.assert_array_equal(
        np.asarray(t3.params["embed_tokens"]["embedding"]),
        2 * np.asarray(t.params["embed_tokens"]["embedding"]),
    )
    # And back to fewer shards than before: only the new ones remain.
    save_sharded(str(d), tensors, max_shard_bytes=400_000)
    new_index = json.load(open(d / "model.safetensors.index.json"))
    names = {p.name for p in d.iterdir()}
    assert "model.safetensors" not in names
    assert {n for n in names if n.startswith("model-")} == set(new_index["weight_map"].values())
    assert len(set(new_index["weight_map"].values())) < len(old_shards)


def test_transformers_4_and_5_config_styles_agree(hf_checkpoints, tmp_path):
    src, _ = hf_checkpoints["llama3"]
    cfg = json.load(open(os.path.join(src, "config.json")))
    v5 = dict(cfg)
    v5.pop("rope_theta", None)
    v5.pop("rope_scaling", None)
    v5["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    v4 = dict(cfg)
    v4.pop("rope_parameters", None)
    v4["rope_theta"] = 5e5
    v4["rope_scaling"] = {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    a = dj.ModelConfig.from_hf(v5)
    b = dj.ModelConfig.from_hf(v4)
    assert a == b
    assert a.rope_theta == 5e5 and a.rope_scaling_dict["rope_type"] == "llama3"
    assert not a.qk_norm and not a.tie_word_embeddings


def _write_config(d, **changes):
    p = os.path.join(d, "config.json")
    cfg = json.load(open(p))
    cfg.update(changes)
    json.dump(cfg, open(p, "w"))


def _rewrite_tensor(d, name, fn):
    path = os.path.join(d, "model.safetensors")
    with SafetensorsFile(path) as f:
        tensors = {k: np.array(f.get(k)) for k in f.keys()}
    fn(tensors)
    write_safetensors(path, tensors)


def test_bad_checkpoints_give_clear_errors(hf_checkpoints, tmp_path):
    src, _ = hf_checkpoints["qwen3_untied"]

    d = _copy(src, tmp_path / "arch")
    _write_config(d, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(dj.CheckpointError, match="unsupported architecture.*Mistral"):
        dj.load_target(d)

    d = _copy(src, tmp_path / "missing")
    _rewrite_tensor(d, None, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(dj.CheckpointError, match=r"missing tensor 'model.layers.2.mlp.up_proj"):
        dj.load_target(d)

    d = _copy(src, tmp_path / "shape")

    def bad_shape(t):
        t["model.layers.1.self_attn.k_proj.weight"] = np.zeros((3, 64), np.float32)

    _rewrite_tensor(d, None, bad_shape)
    with pytest.raises(
        dj.CheckpointError,
        match=r"model.safetensors: tensor 'model.layers.1.self_attn.k_proj.weight'"
        r" has shape \(3, 64\), expected \(64, 64\)",
    ):
        dj.load_target(d)

    d = _copy(src, tmp_path / "dtype")
    path = os.path.join(d, "model.safetensors")
    raw = open(path, "rb").read()
    raw = raw.replace(b'"dtype":"F32"', b'"dtype":"Q32"', 1)
    open(path, "wb").write(raw)
    with pytest.raises(dj.CheckpointError, match="unknown dtype 'Q32'"):
        dj.load_target(d)

    d = _copy(src, tmp_path / "rope")
    _write_config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        dj.load_target(d)

    with pytest.raises(dj.CheckpointError, match="not a directory"):
        dj.load_target(tmp_path / "does_not_exist")

    with pytest.raises(ValueError, match="unknown dtype"):
        dj.load_target(src, dtype="int4")


def _mapped(directory) -> int:
    """How many of this process's memory mappings are files of `directory`."""
    with open("/proc/self/maps") as f:
        return sum(str(directory) in line for line in f)


def _load_fails(d, match):
    """load_target(d) raises CheckpointError(match); the live JAX arrays and the files mapped
    from d are as before (nothing is kept of what was read before the error)."""
    gc.collect()
    before = len(jax.live_arrays())
    try:
        dj.load_target(d)
    except dj.CheckpointError as e:  # the traceback (and the frames' locals) go with `e`
        assert re.search(match, str(e)), e
    else:
        raise AssertionError("loaded")
    gc.collect()
    assert len(jax.live_arrays()) == before and _mapped(d) == 0


def test_a_failing_load_keeps_nothing_half_loaded(hf_checkpoints, tmp_path):
    """docs/usage.md: "nothing is half-loaded". The tensor read last (model.norm) is wrong, so
    every other one was read and placed first: the error names the file and the tensor, and
    afterwards no array of the load is alive and no shard stays memory-mapped; likewise when
    the last of 30 shards lacks a tensor its index lists (that was a raw SafetensorError)."""
    src, _ = hf_checkpoints["qwen3_untied"]
    gc.collect()
    before = len(jax.live_arrays())
    target = dj.load_target(src)  # the control: a load that succeeds keeps its arrays alive
    assert len(jax.live_arrays()) - before == len(jax.tree_util.tree_leaves(target.params))
    del target
    store = SafetensorsDir(src)  # and an open store is seen mapped
    store.get("model.norm.weight")
    assert _mapped(src) >= 1
    store.close()
    assert _mapped(src) == 0

    d = _copy(src, tmp_path / "late")
    _rewrite_tensor(d, None, lambda t: t.update({"model.norm.weight": np.ones(3, np.float32)}))
    _load_fails(d, r"late/model.safetensors: tensor 'model.norm.weight' has shape \(3,\)")

    d = _copy(src, tmp_path / "shards")
    with SafetensorsFile(os.path.join(d, "model.safetensors")) as f:
        tensors = {k: np.array(f.get(k)) for k in f.keys()}
    os.remove(os.path.join(d, "model.safetensors"))
    save_sharded(d, tensors, max_shard_bytes=40_000)
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        shard = json.load(f)["weight_map"]["model.norm.weight"]
    assert shard.startswith("model-00030-of-00030")  # the last shard read
    with SafetensorsFile(os.path.join(d, shard)) as f:
        kept = {k: np.array(f.get(k)) for k in f.keys() if k != "model.norm.weight"}
    write_safetensors(os.path.join(d, shard), kept)
    _load_fails(d, rf"{shard}: missing tensor 'model.norm.weight' \(listed in the index\)")


def test_written_weights_get_the_umask_permissions(tmp_path):
    """safetensors writes owner-only files; a saved checkpoint gets what the user's umask gives
    (0644 under the usual 022), like any other file they write."""
    old = os.umask(0o022)
    try:
        save_sharded(str(tmp_path), {"w": np.ones((2, 3), np.float32)})
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "model.safetensors").st_mode & 0o777 == 0o644
