"""The drafter forward against an independent PyTorch implementation read from the z-lab
files, and z-lab format round trips."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import dflash_jax as dj
from dflash_jax.decoding.step import Decoder, Plan

pass
from dflash_jax.drafters.dflash import (
    ContextCache,
    DFlashDrafter,
    decode_attend,
    default_target_layer_ids,
)


def test_default_target_layer_ids_follow_the_doc():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)
    with pytest.raises(ValueError, match="pass target_layer_ids"):
        default_target_layer_ids(2, 2)


@pytest.fixture(scope="module")
def pair(hf_checkpoints):
    target = dj.load_target(hf_checkpoints["qwen3_tied"][0])
    cfg = dj.make_drafter_config(
        target.config, num_layers=2, num_taps=2, block_size=8, mask_token_id=120
    )
    params = jax.tree_util.tree_map(
        lambda x: x * 3.0 if x.ndim == 2 else x + 0.1, dj.init_drafter_params(cfg, seed=5)
    )
    return target, dj.Drafter(cfg, params)


def _torch_drafter(state, hf_cfg, taps, block_emb, ctx_pos, blk_pos):
    """DFlash drafter forward written plainly from ../shared/docs/dflash.md, in PyTorch; a
    layer that config.json's layer_types calls sliding_attention lets a block query at
    position p see keys at positions j with |p - j| < sliding_window. DFlash 2
    (DFlash2DraftModel): block embeddings x input_embedding_scale; around attention and the
    MLP the grouped dynamic causal convolution of ../shared/docs/dflash.md, its dynamic taps
    from kernel_projection of the sublayer's normed input (the first set convolves that input
    with base_kernel[0], the second the sublayer's output with base_kernel[1])."""
    eps = hf_cfg["rms_norm_eps"]
    n, kh, d = hf_cfg["num_attention_heads"], hf_cfg["num_key_value_heads"], hf_cfg["head_dim"]
    theta = hf_cfg["rope_theta"]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, pos):  # x [L, heads, d]
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = pos[:, None].double() * inv[None]
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
        rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rot * sin

    ctx = rms(taps @ state["fc.weight"].T, state["hidden_norm.weight"])
    dcfg = hf_cfg["dflash_config"]
    v2 = hf_cfg["architectures"] == ["DFlash2DraftModel"]
    h = block_emb * (dcfg.get("input_embedding_scale", 1.0) if v2 else 1.0)
    t, c = h.shape[0], ctx.shape[0]

    def conv(which, x, dyn, side):  # x [t, H], dyn [t, 2, taps, groups]
        base = state[f"{which}.base_kernel"][side]  # [taps, H]
        gs = dcfg["conv_group_size"]
        out = torch.zeros_like(x)
        for tt in range(t):
            for o in range(base.shape[0]):
                if tt - o >= 0:
                    w = base[o] + dyn[tt, side, o].repeat_interleave(gs)
                    out[tt] += w * x[tt - o]
        return out

    def taps_of(which, x):
        k = dcfg["conv_kernel_size"]
        return (x @ state[f"{which}.kernel_projection.weight"].T).view(t, 2, k, -1)

    for i in range(hf_cfg["num_hidden_layers"]):
        p = lambda name: state[f"layers.{i}.{name}"]
        x = rms(h, p("input_layernorm.weight"))
        if v2:
            dyn = taps_of(f"layers.{i}.attention_conv", x)
            x = conv(f"layers.{i}.attention_conv", x, dyn, 0)
        q = rms((x @ p("self_attn.q_proj.weight").T).view(t, n, d), p("self_attn.q_norm.weight"))
        kv_in = torch.cat([ctx, x], 0)
        k = rms(
            (kv_in @ p("self_attn.k_proj.weight").T).view(c + t, kh, d),
            p("self_attn.k_norm.weight"),
        )
        v = (kv_in @ p("self_attn.v_proj.weight").T).view(c + t, kh, d)
        q, k = rope(q, blk_pos), rope(k, torch.cat([ctx_pos, blk_pos]))
        k, v = k.repeat_interleave(n // kh, 1), v.repeat_interleave(n // kh, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5  # non-causal
        if hf_cfg.get("layer_types", [None] * (i + 1))[i] == "sliding_attention":
            key_pos = torch.cat([ctx_pos, blk_pos])
            far = (blk_pos[:, None] - key_pos[None, :]).abs() >= hf_cfg["sliding_window"]
            scores = scores.masked_fill(far[None], float("-inf"))
        att = torch.softmax(scores, -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(t, n * d) @ p("self_attn.o_proj.weight").T
        if v2:
            o = conv(f"layers.{i}.attention_conv", o, dyn, 1)
        h = h + o
        x = rms(h, p("post_attention_layernorm.weight"))
        if v2:
            dyn = taps_of(f"layers.{i}.mlp_conv", x)
            x = conv(f"layers.{i}.mlp_conv", x, dyn, 0)
        gate = torch.nn.functional.silu(x @ p("mlp.gate_proj.weight").T)
        m = (gate * (x @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        if v2:
            m = conv(f"layers.{i}.mlp_conv", m, dyn, 1)
        h = h + m
    return rms(h, state["norm.weight"])


def test_drafter_forward_matches_independent_torch_implementation(pair, tmp_path):
    target, drafter = pair
    dj.save_drafter(drafter, tmp_path / "d")
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    hf_cfg = json.load(open(tmp_path / "d" / "config.json"))
    assert "embed_tokens.weight" not in state and "lm_head.weight" not in state

    rs = np.random.RandomState(0)
    c, t = 13, drafter.config.block_size
    taps = rs.randn(1, c, drafter.config.num_taps * 64).astype(np.float32)
    block_ids = np.array([[17] + [drafter.config.mask_token_id] * (t - 1)])
    emb = target.module.apply(
        {"params": target.params}, jnp.asarray(block_ids), method=dj.Transformer.embed
    )

    # Our decode path: context K/V cached at slots 0..c-1 of a larger cache, block at c..c+t-1.
    dmod = DFlashDrafter(drafter.config)
    ctx = ContextCache.create(drafter.config, 1, 32)
    decoder = Decoder(None, drafter.params, None, dmod, Plan(block_size=drafter.config.block_size))
    ctx = decoder.kind.write_context(
        decoder, ctx, jnp.asarray(taps), None, jnp.arange(c)[None], jnp.array([c])
    )
    ours = dmod.apply(
        {"params": drafter.params},
        emb,
        c + jnp.arange(t)[None],
        ctx.k,
        ctx.v,
        decode_attend(ctx.lengths),
    )
    with torch.no_grad():  # the reference in float64: no float32 rounding on its side
        ref = _torch_drafter(
            {k: v.double() for k, v in state.items()},
            hf_cfg,
            torch.tensor(taps[0]).double(),
            torch.tensor(np.asarray(emb)[0]).double(),
            torch.arange(c),
            c + torch.arange(t),
        )
    np.testing.assert_allclose(np.asarray(ours)[0], ref.numpy(), atol=2e-4)


@pytest.mark.parametrize(
    "layer_types, window",
    [(("sliding_attention",) * 2, 6), (("sliding_attention", "full_attention"), 4)],
)
def test_sliding_drafter_forward_matches_independent_torch_implementation(
    pair, tmp_path, layer_types, window
):
    """Sliding layers against the reference: every layer sliding (the context in a ring of
    `window` slots, written in two parts as prefill and a commit write it) and one of two."""
    target, drafter = pair
    drafter = dj.Drafter(
        drafter.config.replace(layer_types=layer_types, sliding_window=window, is_causal=False),
        drafter.params,
    )
    dj.save_drafter(drafter, tmp_path / "d")
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    hf_cfg = json.load(open(tmp_path / "d" / "config.json"))

    rs = np.random.RandomState(1)
    c, t = 13, drafter.config.block_size
    taps = rs.randn(1, c, drafter.config.num_taps * 64).astype(np.float32)
    block_ids = np.array([[17] + [drafter.config.mask_token_id] * (t - 1)])
    emb = target.module.apply(
        {"params": target.params}, jnp.asarray(block_ids), method=dj.Transformer.embed
    )
    dmod = DFlashDrafter(drafter.config)
    ctx = ContextCache.create(drafter.config, 1, drafter.config.context_capacity(32))
    assert ctx.capacity == (window if drafter.config.context_window else 32)
    decoder = Decoder(None, drafter.params, None, dmod, Plan(block_size=drafter.config.block_size))
    for lo, hi in ((0, 9), (9, c)):
        ctx = decoder.kind.write_context(
            decoder,
            ctx,
            jnp.asarray(taps[:, lo:hi]),
            None,
            jnp.arange(lo, hi)[None],
            jnp.array([hi]),
        )
    ours = dmod.apply(
        {"params": drafter.params},
        emb,
        c + jnp.arange(t)[None],
        ctx.k,
        ctx.v,
        decode_attend(ctx.lengths),
    )
    with torch.no_grad():
        ref = _torch_drafter(
            {k: v.double() for k, v in state.items()},
            hf_cfg,
            torch.tensor(taps[0]).double(),
            torch.tensor(np.asarray(emb)[0]).double(),
            torch.arange(c),
            c + torch.arange(t),
        )
    np.testing.assert_allclose(np.asarray(ours)[0], ref.numpy(), atol=2e-4)


def test_dflash2_drafter_forward_matches_independent_torch_implementation(pair, tmp_path):
    """DFlash 2's layers (convolutions with random kernels and dynamic taps, an embedding
    scale, one sliding layer) against the reference, through the written file."""
    target, drafter = pair
    cfg = drafter.config.replace(
        conv_kernel_size=3,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=4,
        input_embedding_scale=1.5,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=9,
        is_causal=False,
    )
    params = dj.init_drafter_params(cfg, seed=7)
    rs = np.random.RandomState(2)
    for i in range(cfg.body.num_layers):
        for c in ("attention_conv", "mlp_conv"):
            layer = params[f"layers_{i}"][c]
            layer["base_kernel"] = jnp.asarray(rs.randn(*layer["base_kernel"].shape) * 0.5)
            k = layer["kernel_projection"]["kernel"]
            layer["kernel_projection"]["kernel"] = jnp.asarray(rs.randn(*k.shape) * 0.1)
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
    d2 = dj.Drafter(cfg, params)
    dj.save_drafter(d2, tmp_path / "d", dtype="float32")
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    hf_cfg = json.load(open(tmp_path / "d" / "config.json"))

    c, t = 13, cfg.block_size
    taps = rs.randn(1, c, cfg.num_taps * 64).astype(np.float32)
    block_ids = np.array([[17] + [cfg.mask_token_id] * (t - 1)])
    emb = target.module.apply(
        {"params": target.params}, jnp.asarray(block_ids), method=dj.Transformer.embed
    )
    dmod = DFlashDrafter(cfg)
    ctx = ContextCache.create(cfg, 1, 32)
    decoder = Decoder(None, params, None, dmod, Plan(block_size=t))
    ctx = decoder.kind.write_context(
        decoder, ctx, jnp.asarray(taps), None, jnp.arange(c)[None], jnp.array([c])
    )
    ours = dmod.apply(
        {"params": params}, emb, c + jnp.arange(t)[None], ctx.k, ctx.v, decode_attend(ctx.lengths)
    )
    with torch.no_grad():
        ref = _torch_drafter(
            {k: torch.tensor(np.asarray(v)).double() for k, v in state.items()},
            hf_cfg,
            torch.tensor(taps[0]).double(),
            torch.tensor(np.asarray(emb)[0]).double(),
            torch.arange(c),
            c + torch.arange(t),
        )
    np.testing.assert_allclose(np.asarray(ours)[0], ref.numpy(), atol=5e-4)


def test_zlab_round_trip_and_config_variants(pair, tmp_path):
    target, drafter = pair
    out = tmp_path / "zlab"
    dj.save_drafter(drafter, out)
    cfg = json.load(open(out / "config.json"))
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 8 and cfg["dflash_config"]["mask_token_id"] == 120
    assert cfg["dflash_config"]["target_layer_ids"] == list(drafter.config.target_layer_ids)
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    back = dj.load_drafter(out, target=target)
    assert back.config == drafter.config
    for a, b in zip(
        jax.tree_util.tree_leaves(drafter.params), jax.tree_util.tree_leaves(back.params)
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Older files: block_size at top level only, no target_layer_ids (derived from counts).
    del cfg["dflash_config"]["target_layer_ids"], cfg["dflash_config"]["block_size"]
    cfg["num_target_layers"] = 4
    cfg["num_hidden_layers"] = 2
    json.dump(cfg, open(out / "config.json", "w"))
    old = dj.load_drafter(out, target=target)
    assert old.config.target_layer_ids == default_target_layer_ids(4, 2)
    assert old.config.block_size == 8
    # Newer files: block_size only inside dflash_config.
    cfg["dflash_config"]["block_size"] = 8
    del cfg["block_size"]
    json.dump(cfg, open(out / "config.json", "w"))
    assert dj.load_drafter(out, target=target).config.block_size == 8


def test_load_drafter_rejects_mismatched_pairs(pair, tmp_path, hf_checkpoints):
    target, drafter = pair
    out = tmp_path / "bad"
    dj.save_drafter(drafter, out)
    cfg = json.load(open(out / "config.json"))
    cfg["dflash_config"]["target_layer_ids"] = [1, 7]
    json.dump(cfg, open(out / "config.json", "w"))
    with pytest.raises(ValueError, match="target has 4 layers"):
        dj.load_drafter(out, target=target)
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    json.dump(cfg, open(out / "config.json", "w"))
    with pytest.raises(dj.CheckpointError, match="not a DFlash drafter"):
        dj.load_drafter(out)


def _bundled_setup():
    """tests/_multiprocess_worker.py's `setup`: the bundled trained pair (float32), its code
    prompts (mixed lengths) and stop ids; the same generate calls as test_multiprocess.py's
    single-process reference, so the session's compile cache holds their programs once."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_multiprocess_worker.py")
    spec = importlib.util.spec_from_file_location("_multiprocess_worker", path)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return (*worker.setup(), worker.MAX_NEW)


def test_saved_drafter_generates_losslessly(tmp_path):
    """The bundled (trained, accepted) drafter saved by save_drafter in bfloat16 and loaded
    back drafts exactly what the original drafts (every token of every block, accepted or
    not), and decoding with it equals autoregressive decoding."""
    target, drafter, prompts, kw, max_new = _bundled_setup()
    dj.save_drafter(drafter, tmp_path / "g", dtype="bfloat16")
    d2 = dj.load_drafter(tmp_path / "g", target=target)
    assert d2.config == drafter.config
    orig = dj.generate(target, drafter, prompts, max_new, return_drafts=True, **kw)
    back = dj.generate(target, d2, prompts, max_new, return_drafts=True, **kw)
    ar = dj.generate(target, None, prompts, max_new, **kw)
    assert back.tokens == ar.tokens == orig.tokens
    assert back.acceptance_lengths == orig.acceptance_lengths
    assert back.drafts == orig.drafts
    # Accepted: over 1.5 tokens per target pass, some step commits 3 or more.
    acc = [a for seq in back.acceptance_lengths for a in seq]
    assert back.stats["tau"] > 1.5 and sum(acc) / len(acc) > 1.5, back.stats["tau"]
    assert max(acc) >= 3, back.acceptance_lengths
