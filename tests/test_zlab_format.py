"""The z-lab DFlash drafter format against the published facts of a real drafter.

`tests/fixtures/zlab/Qwen3-8B-DFlash-b16/` holds the config.json fields and the tensor names,
shapes and dtypes of z-lab's published drafter for Qwen/Qwen3-8B (sources, field by field, in
`tests/fixtures/zlab/README.md`; the shapes are derived from the config by the format of
shared/docs/dflash.md and checked below against the published file size). Until now the format
was tested only as this project's own round trip (`test_drafter.py`), which cannot tell a
writer and a loader that agree with each other from ones that agree with the published file.

The real drafter is 2.1 GB; the checkpoint built here has the same 58 tensor names, the same
dtype (bfloat16) and every published config field, with the widths scaled down consistently
(hidden 4096 -> 64, heads 32/8 -> 4/1 of head_dim 128 -> 16, intermediate 3 x hidden), so each
shape is the published shape under the same rule. Layer count, taps, target_layer_ids,
num_target_layers, block_size, mask_token_id, vocabulary and RoPE stay as published; the target
is a random Qwen3 of 36 layers at the same reduced width. The checkpoint file is written here by
a few lines of the safetensors format, not by the project's writer.
"""

import copy
import json
import math
import os
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import traverse_util

import dflash_jax as dj
from dflash_jax.drafters.dflash import read_drafter_config

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "zlab", "Qwen3-8B-DFlash-b16")
PUBLISHED_TARGET_HIDDEN = 4096  # Qwen/Qwen3-8B hidden_size: the width of one tap
PUBLISHED_FILE_GB = 2.1  # model.safetensors size on the model card (README.md of the fixture)

# The scaled-down widths; every other field keeps its published value.
SHRINK = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
}
TARGET_HIDDEN = 64

# Keys of the published config.json the project's writer does not write: token ids of the
# target's tokenizer (the drafter shares the target's embedding and vocabulary; this loader
# reads neither) and the version stamp of the library that wrote the file.
NOT_WRITTEN = {"bos_token_id", "eos_token_id", "transformers_version"}


def _json(name):
    with open(os.path.join(FIXTURE, name)) as f:
        return json.load(f)


def derive_shapes(cfg, target_hidden):
    """name -> shape of a z-lab drafter with config `cfg` (PyTorch [out, in] linear weights)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    n, k, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    taps = len(cfg["dflash_config"]["target_layer_ids"])
    out = {"fc.weight": [h, taps * target_hidden], "hidden_norm.weight": [h], "norm.weight": [h]}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_proj.weight": [n * d, h],
                p + "self_attn.k_proj.weight": [k * d, h],
                p + "self_attn.v_proj.weight": [k * d, h],
                p + "self_attn.o_proj.weight": [h, n * d],
                p + "self_attn.q_norm.weight": [d],
                p + "self_attn.k_norm.weight": [d],
                p + "mlp.gate_proj.weight": [inter, h],
                p + "mlp.up_proj.weight": [inter, h],
                p + "mlp.down_proj.weight": [h, inter],
            }
        )
    return out


def expected_param(name):
    """The Flax parameter a published tensor must land in, and whether it is transposed
    (written out here, not taken from the loader): `layers.i.` -> `layers_i`, a linear
    weight ([out, in]) -> `kernel` ([in, out]), a norm weight -> `scale`."""
    parts = name.split(".")
    assert parts[-1] == "weight", name
    path = parts[:-1]
    if path[0] == "layers":
        path = [f"layers_{path[1]}"] + path[2:]
    linear = path[-1] == "fc" or path[-1].endswith("_proj")
    return tuple(path) + ("kernel" if linear else "scale",), linear


def write_safetensors(path, tensors):
    """A safetensors file as Hugging Face writes one: 8-byte little-endian header length,
    the JSON header (dtype, shape, data_offsets; `__metadata__` format pt), the raw bytes."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, arr in tensors.items():
        assert arr.dtype == ml_dtypes.bfloat16
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def write_checkpoint(path, cfg, tensors):
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return str(path)


@pytest.fixture(scope="module")
def published():
    return _json("config.json"), _json("tensors.json")


@pytest.fixture(scope="module")
def shrunk(published):
    """(config, name -> random bfloat16 tensor) of the scaled-down published drafter."""
    cfg = copy.deepcopy(published[0])
    cfg.update(SHRINK)
    rs = np.random.RandomState(0)
    tensors = {
        name: rs.standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16)
        for name, shape in derive_shapes(cfg, TARGET_HIDDEN).items()
    }
    return cfg, tensors


@pytest.fixture(scope="module")
def target(published):
    """A random Qwen3 target of Qwen3-8B's layer count, vocabulary and RoPE, 64 wide."""
    hf = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": published[0]["vocab_size"],
        "hidden_size": TARGET_HIDDEN,
        "intermediate_size": 3 * TARGET_HIDDEN,
        "num_hidden_layers": published[0]["num_target_layers"],
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rope_theta": 1000000,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
    }
    cfg = dj.ModelConfig.from_hf(hf, dtype="float32", param_dtype="bfloat16")
    model = dj.Transformer(cfg)
    abstract = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jax.numpy.zeros((1, 1), "int32"))["params"]
    )
    rs = np.random.RandomState(1)
    params = jax.tree_util.tree_map(
        lambda s: rs.uniform(-0.1, 0.1, s.shape).astype(np.float32).astype(s.dtype), abstract
    )
    return dj.Target(config=cfg, params=params)


@pytest.fixture(scope="module")
def checkpoint_dir(shrunk, tmp_path_factory):
    cfg, tensors = shrunk
    return write_checkpoint(tmp_path_factory.mktemp("zlab") / "Qwen3-8B-DFlash-b16", cfg, tensors)


@pytest.fixture(scope="module")
def loaded(checkpoint_dir, target):
    return dj.load_drafter(checkpoint_dir, target=target)


def test_fixture_shapes_follow_from_the_published_config(published, shrunk):
    cfg, tensors = published
    assert {n: t["shape"] for n, t in tensors.items()} == derive_shapes(
        cfg, PUBLISHED_TARGET_HIDDEN
    )
    assert len(tensors) == 3 + 11 * cfg["num_hidden_layers"] == 58
    assert {t["dtype"] for t in tensors.values()} == {"BF16"}
    assert cfg["dtype"] == "bfloat16"
    # The derived shapes give the file size the model card states (2 bytes a weight).
    total = 2 * sum(math.prod(t["shape"]) for t in tensors.values())
    assert round(total / 1e9, 1) == PUBLISHED_FILE_GB
    # The scaled-down copy keeps every published field, and changes only the widths.
    small = shrunk[0]
    assert set(small) == set(cfg)
    assert {k for k in cfg if small[k] != cfg[k]} == set(SHRINK)
    assert set(shrunk[1]) == set(tensors)


def test_loader_consumes_every_published_tensor_into_its_parameter(
    loaded, shrunk, checkpoint_dir, target, caplog
):
    _, tensors = shrunk
    flat = traverse_util.flatten_dict(jax.device_get(loaded.params))
    for name, arr in tensors.items():
        path, transpose = expected_param(name)
        assert path in flat, f"{name} has no parameter {'/'.join(path)}"
        want = np.asarray(arr, np.float32)
        np.testing.assert_array_equal(np.asarray(flat.pop(path)), want.T if transpose else want)
    assert not flat, f"parameters no published tensor filled: {sorted(flat)}"
    with caplog.at_level("WARNING", logger="dflash_jax.models.checkpoint"):
        dj.load_drafter(checkpoint_dir, target=target)
    assert "ignoring" not in caplog.text  # every tensor of the file was consumed


def test_loader_reads_the_published_config_fields(loaded, published, target, tmp_path):
    cfg, body = loaded.config, loaded.config.body
    pub = published[0]
    assert cfg.block_size == pub["block_size"] == 16
    assert cfg.mask_token_id == pub["dflash_config"]["mask_token_id"] == 151669
    assert cfg.target_layer_ids == tuple(pub["dflash_config"]["target_layer_ids"])
    assert cfg.num_target_layers == pub["num_target_layers"] == 36
    assert cfg.target_hidden_size == TARGET_HIDDEN
    assert body.rope_theta == pub["rope_theta"] and body.rope_scaling is None
    assert body.num_layers == pub["num_hidden_layers"] == len(pub["layer_types"])
    assert body.vocab_size == pub["vocab_size"]
    assert body.rms_norm_eps == pub["rms_norm_eps"]
    assert body.max_position_embeddings == pub["max_position_embeddings"]
    assert (body.hidden_size, body.intermediate_size) == (64, 192)
    assert (body.num_heads, body.num_kv_heads, body.head_dim) == (4, 1, 16)
    assert not body.attention_bias and body.qk_norm

    def variant(edit):  # config.json only: what load_drafter reads before any weight
        hf = copy.deepcopy(pub)
        hf.update(SHRINK)
        edit(hf)
        with open(tmp_path / "config.json", "w") as f:
            json.dump(hf, f)
        return read_drafter_config(str(tmp_path), target.config)

    # Each field is read from the file: a changed value comes back changed.
    def top_block(hf):  # older files: block_size at the top level only
        hf["block_size"] = 10
        hf["dflash_config"].pop("block_size", None)

    def both_disagree(hf):
        hf["block_size"] = 10
        hf["dflash_config"]["block_size"] = 16

    def inner_block(hf):  # newer files: block_size inside dflash_config only
        del hf["block_size"]
        hf["dflash_config"]["block_size"] = 8

    def mask(hf):
        hf["dflash_config"]["mask_token_id"] = 151670

    def taps(hf):
        hf["dflash_config"]["target_layer_ids"] = [2, 10, 18, 26, 34]

    def rope_parameters(hf):  # transformers 5.x: RoPE settings under rope_parameters
        del hf["rope_theta"], hf["rope_scaling"]
        hf["rope_parameters"] = {"rope_theta": 5000000, "rope_type": "default"}

    assert variant(top_block).block_size == 10
    assert variant(inner_block).block_size == 8
    assert variant(both_disagree).block_size == 16  # dflash_config first, as the reference
    assert variant(mask).mask_token_id == 151670
    assert variant(taps).target_layer_ids == (2, 10, 18, 26, 34)
    assert variant(rope_parameters).body.rope_theta == 5e6

    # layer_types is read: sliding layers with their window (z-lab's newer drafters), as
    # transformers reads a Qwen3 config; a layer kind this code does not implement, a sliding
    # layer without a positive window or a list that does not match the layer count is
    # refused, never loaded as full attention.
    def sliding(hf):
        hf["layer_types"][3] = "sliding_attention"
        hf["sliding_window"] = 2048

    def sliding_no_window(hf):
        hf["layer_types"][3] = "sliding_attention"

    def sliding_zero(hf):
        hf["layer_types"] = ["sliding_attention"] * 5
        hf["sliding_window"] = 0

    def chunked(hf):
        hf["layer_types"][1] = "chunked_attention"

    def short(hf):
        hf["layer_types"] = hf["layer_types"][:4]

    got = variant(sliding)
    assert got.layer_windows == (None, None, None, 2048, None) and got.context_window is None
    with pytest.raises(dj.CheckpointError, match="sliding_window must be a positive integer"):
        variant(sliding_no_window)
    with pytest.raises(dj.CheckpointError, match="got 0"):
        variant(sliding_zero)
    with pytest.raises(dj.CheckpointError, match=r"layer_types\[1\] is 'chunked_attention'"):
        variant(chunked)
    with pytest.raises(dj.CheckpointError, match="layer_types has 4 entries"):
        variant(short)

    def no_layer_types(hf):  # older files: no layer_types, only use_sliding_window
        del hf["layer_types"]

    def no_layer_types_sliding(hf):  # Qwen3's rule: layers >= max_window_layers slide
        del hf["layer_types"]
        hf.update(use_sliding_window=True, max_window_layers=2, sliding_window=64)

    def sliding_but_unused(hf):  # use_sliding_window false: the window is not read
        hf["sliding_window"] = 4096

    assert variant(no_layer_types).layer_windows == (None,) * 5
    assert variant(no_layer_types_sliding).layer_windows == (None, None, 64, 64, 64)
    assert variant(sliding_but_unused).layer_windows == (None,) * 5


def test_writer_writes_the_published_names_shapes_and_config_keys(
    loaded, published, shrunk, target, tmp_path
):
    out = tmp_path / "written"
    dj.save_drafter(loaded, out, dtype="bfloat16")
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    header = {}
    for f in files:
        header.update(read_header(os.path.join(out, f)))
    want = derive_shapes(shrunk[0], TARGET_HIDDEN)
    assert {n: h["shape"] for n, h in header.items()} == want
    assert set(header) == set(published[1])
    assert {h["dtype"] for h in header.values()} == {"BF16"}

    with open(out / "config.json") as f:
        written = json.load(f)
    pub = published[0]
    missing = set(pub) - set(written) - NOT_WRITTEN
    assert not missing, f"the writer drops published config keys: {sorted(missing)}"
    for key in set(pub) - NOT_WRITTEN - set(SHRINK) - {"dflash_config"}:
        assert written[key] == pub[key], key
    assert {k: written["dflash_config"][k] for k in pub["dflash_config"]} == pub["dflash_config"]
    assert {k: written[k] for k in SHRINK} == SHRINK

    # What the writer wrote loads back to the same drafter.
    back = dj.load_drafter(out, target=target)
    assert back.config == loaded.config
    for a, b in zip(
        jax.tree_util.tree_leaves(loaded.params), jax.tree_util.tree_leaves(back.params)
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("case", ["missing", "misnamed", "misshaped"])
def test_a_missing_or_misnamed_tensor_is_one_clear_error(case, shrunk, target, tmp_path):
    cfg, tensors = shrunk
    tensors = dict(tensors)
    if case == "missing":
        del tensors["layers.4.self_attn.k_norm.weight"]
        match = r"missing tensor 'layers\.4\.self_attn\.k_norm\.weight'"
    elif case == "misnamed":  # a target-style `model.` prefix on one drafter tensor
        tensors["model.fc.weight"] = tensors.pop("fc.weight")
        match = r"missing tensor 'fc\.weight'"
    else:
        tensors["layers.0.mlp.down_proj.weight"] = tensors["layers.0.mlp.down_proj.weight"].T
        match = r"'layers\.0\.mlp\.down_proj\.weight' has shape \(192, 64\), expected \(64, 192\)"
    path = write_checkpoint(tmp_path / case, cfg, tensors)
    with pytest.raises(dj.CheckpointError, match=match) as err:
        dj.load_drafter(path, target=target)
    assert str(tmp_path / case) in str(err.value)  # names the checkpoint
    assert "\n" not in str(err.value)
