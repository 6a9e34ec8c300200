"""Quantized targets (issue 29): block-FP8 checkpoints as they ship, int8 weight-only at load.

- FP8: a checkpoint written here with ml_dtypes (float8_e4m3fn weights, bfloat16
  `weight_scale_inv` per block, ragged last blocks) loads to exactly the weights of a NumPy
  block-by-block dequantization, and the model's logits equal those of a float model built
  from those weights.
- int8: logits close to the float model's; quantize / save / load round trip (the file holds
  int8 weights and float32 scales, the reload is bit-identical, the LM head too when asked).
- Losslessness: DFlash over each quantized target (the bundled pair's target quantized to int8,
  and written as block FP8) equals autoregressive decoding of the same quantized target, batch
  and single, with the trained drafter accepted.
- The compiled matmul reads the int8 kernel (s8 parameters; on TPU, compiled with libtpu for
  a v5e chip, no float copy of a weight outside the dot's fusion).
- Bad input: an unsupported quant_method, fmt or bit width is one line naming it, before any
  weight is read.
"""

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _pair import assert_accepted
from flax import traverse_util

import dflash_jax as dj
from dflash_jax.models import checkpoint, quantization
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.safetensors_io import SafetensorsDir, save_sharded
from dflash_jax.models.target import init_params

NEW = 40
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def _is_linear(name):
    return any(f".{n}.weight" in name for n in quantization.LINEAR_NAMES)


def write_fp8(target, path, block, scale_dtype=ml_dtypes.bfloat16):
    """Writes `target` as a block-FP8 checkpoint (as Qwen3-*-FP8 ship, with `block` as
    weight_block_size) and returns {name: float32 [out, in]}: the NumPy dequantization,
    block by block, of what was written."""
    tensors = checkpoint.params_to_hf(target.params, prefix="model.", dtype="float32")
    ref = {}
    b0, b1 = block
    for name in [n for n in tensors if _is_linear(n)]:
        w = tensors[name]
        n0, n1 = math.ceil(w.shape[0] / b0), math.ceil(w.shape[1] / b1)
        q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
        scale = np.zeros((n0, n1), scale_dtype)
        deq = np.zeros(w.shape, np.float32)
        for i in range(n0):
            for j in range(n1):
                rows, cols = slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1)
                blk = w[rows, cols]
                scale[i, j] = max(float(np.abs(blk).max()), 1e-12) / FP8_MAX
                s = np.float32(scale[i, j])  # the stored (bfloat16-rounded) scale
                q[rows, cols] = np.clip(blk / s, -FP8_MAX, FP8_MAX).astype(q.dtype)
                deq[rows, cols] = q[rows, cols].astype(np.float32) * s
        tensors[name], tensors[name + "_scale_inv"], ref[name] = q, scale, deq
    save_sharded(str(path), tensors)
    hf = target.config.to_hf(torch_dtype="bfloat16")
    hf["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    return ref


def _kernels(params):
    """{HF name: Flax kernel as [out, in] numpy} of the linears."""
    flat = traverse_util.flatten_dict(params)
    return {
        checkpoint.flax_path_to_hf(k, "model."): np.asarray(v).T
        for k, v in flat.items()
        if k[-1] == "kernel" and k[-2] != "lm_head"
    }


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """An untied Llama with dims that are not multiples of 128 (hidden 200, q 200, k/v 100,
    MLP 328): every [128, 128] block grid has a ragged last row and column of blocks."""
    cfg = ModelConfig(
        vocab_size=300,
        hidden_size=200,
        intermediate_size=328,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=50,
        arch="llama",
        qk_norm=False,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    # Random weights in NumPy on the model's abstract tree (init_params runs Flax's init op by
    # op: ~4 s here); norms 1 +- 0.1, matrices std 0.05.
    rng = np.random.RandomState(3)
    abstract = jax.eval_shape(lambda: init_params(cfg))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(
            (1.0 if path[-1].key == "scale" else 0.0)
            + rng.normal(0, 0.1 if path[-1].key == "scale" else 0.05, x.shape).astype(np.float32)
        ),
        abstract,
    )
    target = dj.Target(cfg, params)
    d = tmp_path_factory.mktemp("fp8_small")
    ref = write_fp8(target, d, (128, 128))
    return target, str(d), ref


@pytest.fixture(scope="module")
def pair_int8(bundled_pair):
    target, drafter, prompts = bundled_pair
    return dj.quantize_target(target), drafter, prompts


@pytest.fixture(scope="module")
def pair_fp8(bundled_pair, tmp_path_factory):
    """The bundled target written as block FP8 (blocks [96, 80]: ragged against its 128, 256
    and 768 wide linears) and loaded again, with its drafter."""
    target, drafter, prompts = bundled_pair
    d = tmp_path_factory.mktemp("fp8_pair")
    ref = write_fp8(target, d, (96, 80))
    return dj.load_target(str(d)), drafter, prompts, ref


IDS = np.array([[5, 17, 99, 3, 250, 42, 7, 11], [1, 2, 3, 4, 5, 6, 7, 8]])


def test_fp8_blocks_dequantize_as_the_numpy_reference_ragged_blocks(small, pair_fp8):
    target, d, ref = small
    loaded = dj.load_target(d)
    assert loaded.config.quantization is None  # FP8 is dequantized at load
    got = _kernels(loaded.params)
    assert set(got) == set(ref) and len(ref) == 14
    for name, want in ref.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
        # ...and the FP8 grid really is coarser than the original weights.
        assert np.abs(want - _kernels(target.params)[name]).max() > 0
    # The bundled target at blocks [96, 80] (the block size read from the config).
    fp8_target, _, _, ref2 = pair_fp8
    got2 = _kernels(fp8_target.params)
    for name, want in ref2.items():
        np.testing.assert_array_equal(got2[name], want, err_msg=name)
    # Embeddings, norms and the LM head are read as stored.
    for key in (("embed_tokens", "embedding"), ("lm_head", "kernel"), ("norm", "scale")):
        a, b = loaded.params, target.params
        for k in key:
            a, b = a[k], b[k]
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_logits_equal_a_float_model_of_the_dequantized_weights(small):
    target, d, ref = small
    fp8 = dj.load_target(d)
    flat = traverse_util.flatten_dict(target.params)
    for k in flat:
        name = checkpoint.flax_path_to_hf(k, "model.")
        if name in ref:
            flat[k] = jnp.asarray(ref[name].T)
    float_ref = dj.Target(target.config, traverse_util.unflatten_dict(flat))
    want = np.asarray(float_ref.forward(IDS).logits)
    np.testing.assert_allclose(np.asarray(fp8.forward(IDS).logits), want, rtol=0, atol=1e-6)
    # Not the original weights' logits: the test would see a loader that ignored the scales.
    assert np.abs(np.asarray(target.forward(IDS).logits) - want).max() > 1e-4


def test_int8_logits_close_to_float_and_round_trip(small, tmp_path):
    target, d, _ = small
    q = dj.quantize_target(target, lm_head=True)
    flat = traverse_util.flatten_dict(q.params)
    int8 = [k for k, v in flat.items() if v.dtype == jnp.int8]
    assert len(int8) == 2 * 7 + 1 and ("lm_head", "kernel") in int8
    for k in int8:  # symmetric, per output channel: every column reaches +-127
        assert np.abs(np.asarray(flat[k])).max(axis=0).min() == 127, k
    ref = np.asarray(target.forward(IDS).logits)
    got = np.asarray(q.forward(IDS).logits)
    err = np.abs(got - ref).max()
    assert 0 < err < 0.02 * np.abs(ref).max(), (err, np.abs(ref).max())
    # Round trip: int8 + float32 scales in the file, the reload bit-identical.
    save_dir = tmp_path / "int8"
    dj.save_target(q, str(save_dir))
    hf = json.load(open(save_dir / "config.json"))
    assert hf["quantization_config"] == quantization.quantization_config(lm_head=True)
    store = SafetensorsDir(str(save_dir))
    try:
        assert store.info("model.layers.1.mlp.down_proj.weight") == ("I8", (200, 328))
        assert store.info("model.layers.1.mlp.down_proj.weight_scale") == ("F32", (200,))
        assert store.info("lm_head.weight") == ("I8", (300, 200))
        assert store.info("model.embed_tokens.weight")[0] == "F32"
    finally:
        store.close()
    back = dj.load_target(str(save_dir))
    assert back.config == q.config
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
        back.params,
        q.params,
    )
    np.testing.assert_array_equal(np.asarray(back.forward(IDS).logits), got)
    # quantize at load (here from the FP8 checkpoint: requantized per channel) gives int8.
    from_fp8 = dj.load_target(d, quantize="int8")
    assert from_fp8.config.quantization == "int8"
    kern = from_fp8.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert kern.dtype == jnp.int8 and kern.shape == (200, 200)
    assert from_fp8.params["lm_head"]["kernel"].dtype == jnp.float32  # lm_head optional


def _check_lossless(target, drafter, prompts):
    """DFlash == AR over `target`, batch (block 8) and single (block 16), the drafter accepted.
    The calls are test_decoding.py's (same shapes and settings), so a target of the float
    config (the FP8 one, dequantized at load) reuses those compiled programs."""
    ar = dj.generate(target, None, prompts, max_new_tokens=NEW)
    batch = dj.generate(target, drafter, prompts, NEW, block_size=8)
    assert_accepted(batch, 8)
    assert batch.tokens == ar.tokens
    one = dj.generate(target, drafter, prompts[:1], NEW, block_size=16)
    assert_accepted(one, 16)
    assert one.tokens == ar.tokens[:1]


def test_dflash_equals_ar_over_the_int8_target(pair_int8, bundled_pair):
    target, drafter, prompts = pair_int8
    _check_lossless(target, drafter, prompts)
    # The int8 model is another model than the float one (its logits differ), so the
    # equality above is with the quantized target, not a float run in disguise.
    logits_q = np.asarray(target.forward(prompts[0]).logits)
    logits_f = np.asarray(bundled_pair[0].forward(prompts[0]).logits)
    assert np.abs(logits_q - logits_f).max() > 1e-3


def test_dflash_equals_ar_over_the_fp8_target(pair_fp8):
    target, drafter, prompts, _ = pair_fp8
    _check_lossless(target, drafter, prompts)


def test_compiled_int8_forward_reads_s8_kernels(pair_int8):
    """XLA:CPU: every int8 kernel is an s8 parameter of the compiled forward (XLA:CPU has no
    dot that fuses a convert, so it converts the kernel in a loop fusion first: the HBM
    claim is checked on TPU below)."""
    from dflash_jax.models.target import _forward

    target = pair_int8[0]
    ids = jnp.zeros((1, 8), jnp.int32)
    text = _forward.lower(target.module, target.params, ids, ()).compile().as_text()
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", text).group(1)
    assert layout.count("s8[") == 6 * 7  # 6 layers x q/k/v/o/gate/up/down


def _computations(text):
    """{name: body} of an HLO module's text."""
    out, name, lines = {}, None, []
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m and name is None:
            name, lines = ("ENTRY" if m.group(1) else m.group(2)), []
        elif line.strip() == "}" and name is not None:
            out[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return out


@pytest.mark.skipif(
    __import__("dflash_jax.dry_run", fromlist=["x"]).libtpu_missing(),
    reason='needs libtpu: pip install "jax[tpu]" (make test does)',
)
def test_int8_matmul_on_tpu_converts_inside_the_dot_fusion():
    """libtpu, one v5e chip, Qwen3-8B widths (in 4096, out 12288 / 4096) at 1, 16 and 512
    rows (AR, verify, prefill): the kernel enters as s8, a fusion contracts the s8 kernel
    (converting it inside, if at all), and no float array of the kernel's shape exists outside a fusion (nothing dequantized
    in HBM)."""
    from dflash_jax import dry_run
    from dflash_jax.models.layers import Int8Dense

    devices, _ = dry_run.topology_devices("v5e:2x4")
    one = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(devices[:1]), ("x",)), jax.sharding.PartitionSpec()
    )
    SD = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=one)
    for n_out in (12288, 4096):
        m = Int8Dense(n_out, dtype=jnp.bfloat16)
        p = {"kernel": SD((4096, n_out), jnp.int8), "kernel_scale": SD((n_out,), jnp.float32)}
        for rows in (1, 16, 512):
            fn = jax.jit(lambda p, x: m.apply({"params": p}, x))
            text = fn.lower(p, SD((1, rows, 4096), jnp.bfloat16)).compile().as_text()
            comps = _computations(text)
            shape = rf"\[(4096,{n_out}|{n_out},4096)\]"
            assert re.search(rf"s8{shape}\S* parameter\(0\)", comps["ENTRY"])
            assert not re.search(rf"= (bf16|f32|f16){shape}", comps["ENTRY"]), (n_out, rows)
            # A fusion takes the s8 kernel and contracts it: a dot (a convolution in TPU HLO,
            # which reads the s8 operand itself) or, for one row, a convert-multiply-reduce.
            dots = [
                c
                for c in comps.values()
                if re.search(rf"s8{shape}", c) and re.search(r" (convolution|dot|reduce)\(", c)
            ]
            assert dots, (n_out, rows)  # the int8 kernel is an operand of the dot's fusion

    # Control: a kernel dequantized behind an optimization barrier is materialised, and the
    # check above sees the float copy in the entry computation.
    def dequantized_first(p, x):
        w = jax.lax.optimization_barrier(p["kernel"].astype(jnp.bfloat16))
        return (x @ w) * p["kernel_scale"]

    text = jax.jit(dequantized_first).lower(p, SD((1, 16, 4096), jnp.bfloat16)).compile()
    assert re.search(rf"= (bf16|f32){shape}", _computations(text.as_text())["ENTRY"])


@pytest.mark.parametrize(
    "qc,message",
    [
        ({"quant_method": "awq", "bits": 4}, "unsupported quantization_config.quant_method 'awq'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "unsupported fp8 quantization fmt 'e5m2'"),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [1, 1]},
            "unsupported fp8 activation_scheme 'static'",
        ),
        ({"quant_method": "fp8"}, "fp8 weight_block_size must be two positive integers"),
        ({"quant_method": "dflash_int8", "bits": 4}, "unsupported dflash_int8 bit width 4"),
    ],
)
def test_unsupported_quantization_is_one_line_before_any_weight(tmp_path, qc, message):
    hf = dj.ModelConfig(16, 8, 16, 1, 2, 1, 4).to_hf()
    hf["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(hf))  # no weights at all
    with pytest.raises(ValueError) as e:
        dj.load_target(str(tmp_path))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert "config.json" in str(e.value)


def test_unsupported_quantize_request_is_one_line_before_any_weight(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dj.ModelConfig(16, 8, 16, 1, 2, 1, 4).to_hf()))
    for kw, message in (
        ({"quantize": "int4"}, "quantize='int4' is not supported; supported: int8"),
        ({"quantize_lm_head": True}, "quantize_lm_head needs quantize='int8'"),
        ({"quantize": "int8", "quantize_lm_head": True}, "untied LM head"),  # a tied head
    ):
        with pytest.raises(ValueError) as e:
            dj.load_target(str(tmp_path), **kw)
        assert message in str(e.value) and "\n" not in str(e.value), kw
        if kw.get("quantize") == "int8":  # int8 was given: the line names only the tied head
            assert "needs quantiz" not in str(e.value), str(e.value)


def test_dry_run_quantize_builds_the_int8_8b_and_refuses_bad_requests(capsys):
    """`python -m dflash_jax.dry_run --quantize=int8` compiles Qwen3-8B with its 36 x 7
    decoder linears int8 (the drafter and the embedding / LM head unchanged): the abstract
    parameters it lowers, and bad requests refused with one line before any compile."""
    from dflash_jax import dry_run

    tcfg, dcfg = dry_run.build_configs("qwen3_8b", quantize="int8")
    tparams, dparams = dry_run.abstract_params(tcfg, dcfg)
    leaves = jax.tree_util.tree_leaves(tparams)
    assert sum(x.dtype == jnp.int8 for x in leaves) == 36 * 7
    assert all(x.dtype != jnp.int8 for x in jax.tree_util.tree_leaves(dparams))
    bf16_cfg, _ = dry_run.build_configs("qwen3_8b")
    nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(t))
    linears = 36 * 4096 * (4096 + 1024 + 1024 + 4096 + 3 * 12288)  # q, k, v, o, MLP
    full = nbytes(dry_run.abstract_params(bf16_cfg, dcfg)[0])
    assert nbytes(tparams) == full - linears + 4 * 36 * (4096 * 3 + 1024 * 2 + 12288 * 2)
    for argv, message in (
        (["--quantize=int4"], "--quantize must be int8, got 'int4'"),
        (["--quantize_lm_head"], "--quantize_lm_head needs --quantize=int8"),
        (["--model=qwen3_4b", "--quantize=int8", "--quantize_lm_head"], "untied LM head"),
    ):
        with pytest.raises(SystemExit) as e:
            dry_run.main(["--topology=cpu:1", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, err
