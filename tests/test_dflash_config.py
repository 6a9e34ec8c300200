"""DFlash (1) config.json fields read as the reference package (`dflash` 0.1.0) reads them
(docs/dflash_config.md): is_causal, DFlash 2's scalars applied to any drafter, fields at the
top level or defaulted. Each field on a hand-built config against a NumPy statement of the
reference's rule: its attention mask (written here from the rule, in float64, with the
drafter's forward) and its scaling of embeddings and logits; the drafter's logits come from
the decode path (`DFlashKind.write_context` then `DFlashKind.draft_logits`)."""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import dflash_jax as dj
from dflash_jax.decoding.step import Decoder, Plan
from dflash_jax.drafters.dflash import (
    ContextCache,
    DFlashDrafter,
    DrafterConfig,
    read_drafter_config,
)
from dflash_jax.models.target import init_params

V, H, BS, CTX = 40, 32, 6, 5  # vocabulary, width, block, committed context
MASK = 0


@pytest.fixture(scope="module")
def target():
    cfg = dj.ModelConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return dj.Target(cfg, jax.jit(lambda: init_params(cfg, seed=1))())


@pytest.fixture(scope="module")
def base(target):
    """A 1-layer, 1-tap drafter with weights large enough that masks and scales show."""
    cfg = dj.make_drafter_config(
        target.config,
        num_layers=1,
        num_taps=1,
        block_size=BS,
        mask_token_id=MASK,
        target_layer_ids=(0,),
    )
    params = jax.tree_util.tree_map(
        lambda x: x * 4.0 if x.ndim == 2 else x + 0.1, dj.init_drafter_params(cfg, seed=3)
    )
    return dj.Drafter(cfg, params)


def hand_config(base, **edit):
    """base's config.json with `edit` applied: key None deletes it, "dflash_config.key" edits
    inside dflash_config."""
    hf = copy.deepcopy(base.config.to_hf(torch_dtype="float32"))
    for key, value in edit.items():
        where, name = (hf["dflash_config"], key.split(".")[1]) if "." in key else (hf, key)
        if value is None:
            where.pop(name, None)
        else:
            where[name] = value
    return hf


def load(hf):
    return DrafterConfig.from_hf(hf, target_hidden_size=H)


# ------------------------------------------------------------------ the reference's rules


def reference_mask(ctx_len, block, layer_type, window, is_causal):
    """[block, ctx_len + block] bool: which keys a block query sees, as the reference states
    it. Keys are [context 0 .. ctx_len-1 ; block], query t at index ctx_len + t. is_causal
    None: causal iff the layer slides; causal: key index <= query index; a sliding layer:
    query - key < window, and, when not causal, key - query < window too."""
    causal = (layer_type == "sliding_attention") if is_causal is None else bool(is_causal)
    q = ctx_len + np.arange(block)[:, None]
    k = np.arange(ctx_len + block)[None, :]
    see = np.ones((block, ctx_len + block), bool)
    if causal:
        see &= k <= q
    if layer_type == "sliding_attention":
        see &= q - k < window
        if not causal:
            see &= k - q < window
    return see


def reference_scale(hf):
    """(input_embedding_scale, output_multiplier, final_logit_softcapping) as the reference
    reads them: dflash_config first, then the top level, then 1, 1, None."""
    d = hf.get("dflash_config", {})
    get = lambda k, default: d[k] if k in d else hf.get(k, default)
    return (
        get("input_embedding_scale", 1.0),
        get("output_multiplier", 1.0),
        get("final_logit_softcapping", None),
    )


def numpy_logits(state, hf, taps, emb, embed_table, mask):
    """The drafter's logits [block-1, V] in float64 (positions after x_last): its forward from
    ../shared/docs/dflash.md with `mask` [block, ctx+block] and the reference's scaling;
    the LM head is the (tied) embedding table."""
    eps, theta = hf["rms_norm_eps"], hf["rope_theta"]
    n, kh, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    scale, mult, cap = reference_scale(hf)
    rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x, pos):
        inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
        ang = pos[:, None] * inv[None]
        cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None]
        sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None]
        rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rot * sin

    ctx = rms(taps @ state["fc.weight"].T, state["hidden_norm.weight"])
    h = emb * scale
    c, t = ctx.shape[0], h.shape[0]
    pos = np.arange(c + t, dtype=np.float64)
    for i in range(hf["num_hidden_layers"]):
        p = lambda name: state[f"layers.{i}.{name}"]
        x = rms(h, p("input_layernorm.weight"))
        q = rms((x @ p("self_attn.q_proj.weight").T).reshape(t, n, d), p("self_attn.q_norm.weight"))
        kv_in = np.concatenate([ctx, x], 0)
        k = rms(
            (kv_in @ p("self_attn.k_proj.weight").T).reshape(c + t, kh, d),
            p("self_attn.k_norm.weight"),
        )
        v = (kv_in @ p("self_attn.v_proj.weight").T).reshape(c + t, kh, d)
        q, k = rope(q, pos[c:]), rope(k, pos)
        k, v = np.repeat(k, n // kh, 1), np.repeat(v, n // kh, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        s = np.where(mask[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", a, v).reshape(t, n * d) @ p("self_attn.o_proj.weight").T
        h = h + o
        x = rms(h, p("post_attention_layernorm.weight"))
        g = x @ p("mlp.gate_proj.weight").T
        h = (
            h
            + ((g / (1 + np.exp(-g))) * (x @ p("mlp.up_proj.weight").T))
            @ p("mlp.down_proj.weight").T
        )
    h = rms(h, state["norm.weight"])
    logits = (h @ embed_table.T)[1:] * mult
    if cap is not None and cap > 0:
        logits = cap * np.tanh(logits / cap)
    return logits


def inputs(target, seed=0):
    rs = np.random.RandomState(seed)
    taps = rs.randn(1, CTX, H).astype(np.float32)
    return taps, np.int32(7)


def drafter_logits(target, drafter, taps, x_last):
    """The drafter's logits [bs-1, V] from the decode path: the context written as the
    prefill writes it, then one pass over [x_last, MASK * (bs-1)]."""
    cfg = drafter.config
    dmod = DFlashDrafter(cfg)
    dec = Decoder(target.params, drafter.params, target.module, dmod, Plan(block_size=BS))
    ctx = ContextCache.create(cfg, 1, cfg.context_capacity(32))
    ctx = dec.kind.write_context(
        dec, ctx, jnp.asarray(taps), None, jnp.arange(CTX)[None], jnp.array([CTX])
    )
    masks = jnp.full((1, BS - 1), cfg.mask_token_id, jnp.int32)
    out = dec.kind.draft_logits(dec, ctx, jnp.array([x_last]), masks, jnp.array([CTX]))
    return np.asarray(out, np.float64)[0]


def expected_logits(target, drafter, hf, taps, x_last, tmp_path):
    """The NumPy reference's logits of `drafter` under config `hf` (its weights read back
    from the written file, in the z-lab names)."""
    dj.save_drafter(dj.Drafter(drafter.config, drafter.params), tmp_path, dtype="float32")
    state = {
        k: v.astype(np.float64) for k, v in load_file(str(tmp_path / "model.safetensors")).items()
    }
    table = np.asarray(target.params["embed_tokens"]["embedding"], np.float64)
    block = np.array([x_last] + [hf["dflash_config"]["mask_token_id"]] * (BS - 1))
    mask = reference_mask(
        CTX,
        BS,
        hf.get("layer_types", ["full_attention"])[0],
        hf.get("sliding_window"),
        hf.get("is_causal"),
    )
    return numpy_logits(state, hf, taps[0].astype(np.float64), table[block], table, mask)


# -------------------------------------------------------------------------- is_causal

SLIDING = dict(layer_types=["sliding_attention"], sliding_window=3, use_sliding_window=True)


@pytest.mark.parametrize(
    "edit, causal",
    [
        (dict(SLIDING, is_causal=None), (True,)),  # absent: a sliding layer is causal
        (dict(SLIDING, is_causal=True), (True,)),
        (dict(SLIDING, is_causal=False), (False,)),
        (dict(is_causal=True), (True,)),  # a full-attention layer too, when asked
        (dict(is_causal=None), (False,)),
    ],
    ids=("sliding_absent", "sliding_true", "sliding_false", "full_true", "full_absent"),
)
def test_is_causal_masks_the_block_as_the_reference_does(target, base, tmp_path, edit, causal):
    hf = hand_config(base, **edit)
    cfg = load(hf)
    assert cfg.layer_causal == causal
    drafter = dj.Drafter(cfg, base.params)
    taps, x_last = inputs(target)
    ours = drafter_logits(target, drafter, taps, x_last)
    want = expected_logits(target, drafter, hf, taps, x_last, tmp_path)
    np.testing.assert_allclose(ours, want, atol=2e-4, rtol=2e-4)


def test_the_masks_differ_and_so_do_the_logits(target, base, tmp_path):
    """The cases above are not one case: the reference's masks differ (causal vs not, in the
    window and out of it) and the drafter's logits differ with them, by far more than the
    tolerance above."""
    masks = {c: reference_mask(CTX, BS, "sliding_attention", 3, c) for c in (None, True, False)}
    assert (masks[None] == masks[True]).all() and (masks[True] != masks[False]).any()
    assert (reference_mask(CTX, BS, "full_attention", None, True) != True).any()  # noqa: E712
    taps, x_last = inputs(target)
    out = {
        c: drafter_logits(
            target,
            dj.Drafter(load(hand_config(base, **SLIDING, is_causal=c)), base.params),
            taps,
            x_last,
        )
        for c in (True, False)
    }
    assert np.abs(out[True] - out[False]).max() > 0.05


def test_is_causal_is_read_at_the_top_level_only(base):
    """Inside dflash_config the reference does not read it: a value there that says otherwise
    than the top level is refused (one line), one that agrees is accepted; a non-boolean is
    refused."""
    with pytest.raises(dj.CheckpointError, match="dflash_config.is_causal False is not read"):
        load(hand_config(base, **SLIDING, **{"dflash_config.is_causal": False}))
    assert load(
        hand_config(base, **SLIDING, is_causal=False, **{"dflash_config.is_causal": False})
    ).layer_causal == (False,)
    with pytest.raises(dj.CheckpointError, match="is_causal must be true or false"):
        load(hand_config(base, **SLIDING, is_causal="false"))


def test_the_project_writes_what_it_trained_with(target, base, tmp_path):
    """A sliding drafter made here drafts bidirectionally and says so in its config.json
    (is_causal false at the top level), so the reference reads it as it was trained; a
    full-attention one writes no is_causal (absent and false read alike there)."""
    cfg = dj.make_drafter_config(
        target.config, num_layers=1, num_taps=1, block_size=BS, sliding_window=3
    )
    assert cfg.layer_causal == (False,)
    hf = cfg.to_hf()
    assert hf["is_causal"] is False and hf["layer_types"] == ["sliding_attention"]
    assert load(hf) == cfg
    assert "is_causal" not in base.config.to_hf()
    assert load(hand_config(base, is_causal=False)) == base.config  # one spelling


@pytest.mark.parametrize(
    "path", ["assets/tiny-code/drafter", "assets/smollm2-135m-instruct/drafter"]
)
def test_shipped_drafters_are_read_as_they_were_trained(path):
    """The shipped drafters: full attention, no is_causal, no scalars: bidirectional blocks and
    the LM head's logits as they are (what they were trained and measured with), and written
    back the same way."""
    cfg = read_drafter_config(path)
    with open(f"{path}/config.json") as f:
        hf = json.load(f)
    assert "is_causal" not in hf and set(hf["layer_types"]) == {"full_attention"}
    assert cfg.layer_causal == (False,) * cfg.body.num_layers
    assert not cfg.scales_logits and cfg.input_embedding_scale == 1.0
    assert "is_causal" not in cfg.to_hf()
    assert DrafterConfig.from_hf(cfg.to_hf()) == cfg


# ---------------------------------------------------------------------------- scalars


@pytest.mark.parametrize(
    "edit",
    [
        {"dflash_config.input_embedding_scale": 1.7},
        {"input_embedding_scale": 0.4},  # the top level
        {"dflash_config.output_multiplier": 0.6},
        {"output_multiplier": 2.5},
        {"dflash_config.final_logit_softcapping": 1.5},
        {"final_logit_softcapping": 3.0},
        {"final_logit_softcapping": 0.0},  # <= 0: no cap
        {"dflash_config.output_multiplier": 0.6, "output_multiplier": 9.0},  # inner first
    ],
    ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()),
)
def test_dflash2_scalars_apply_to_dflash(target, base, tmp_path, edit):
    hf = hand_config(base, **edit)
    cfg = load(hf)
    assert not cfg.dflash2
    drafter = dj.Drafter(cfg, base.params)
    taps, x_last = inputs(target)
    ours = drafter_logits(target, drafter, taps, x_last)
    want = expected_logits(target, drafter, hf, taps, x_last, tmp_path)
    np.testing.assert_allclose(ours, want, atol=2e-4, rtol=2e-4)
    # ... and exactly as stated, against the unscaled drafter's own logits.
    plain = drafter_logits(target, base, taps, x_last)
    scale, mult, cap = reference_scale(hf)
    if scale == 1.0:
        stated = plain * mult
        if cap:
            stated = cap * np.tanh(stated / cap)
        np.testing.assert_allclose(ours, stated, atol=1e-5, rtol=1e-5)
    else:
        assert np.abs(ours - plain).max() > 0.05  # the embedding scale reaches the logits
    assert load(cfg.to_hf()) == cfg  # written back


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"output_multiplier": 0}, "output_multiplier must be a positive number"),
        ({"dflash_config.input_embedding_scale": None}, None),  # deleted: the default
        ({"dflash_config.input_embedding_scale": "2"}, "input_embedding_scale must be"),
        ({"final_logit_softcapping": "big"}, "final_logit_softcapping must be a number"),
    ],
)
def test_bad_scalars_are_one_line(base, edit, message):
    if message is None:
        assert load(hand_config(base, **edit)).input_embedding_scale == 1.0
        return
    with pytest.raises(dj.CheckpointError, match=message) as e:
        load(hand_config(base, **edit))
    assert "\n" not in str(e.value)


# --------------------------------------------------------------- top level and defaults


def test_fields_at_the_top_level_or_defaulted(base):
    """block_size, mask_token_id and target_layer_ids: dflash_config first, then the top
    level, then the reference's default (block 16; taps spread over num_target_layers, one
    per drafter layer); a missing mask_token_id is refused."""
    c = lambda **e: load(hand_config(base, **e))
    assert c(block_size=None, **{"dflash_config.block_size": None}).block_size == 16
    assert c(block_size=9, **{"dflash_config.block_size": None}).block_size == 9
    assert c(block_size=9, **{"dflash_config.block_size": 5}).block_size == 5
    assert c(mask_token_id=3, **{"dflash_config.mask_token_id": None}).mask_token_id == 3
    assert c(mask_token_id=3, **{"dflash_config.mask_token_id": 4}).mask_token_id == 4
    top_taps = c(target_layer_ids=[1], **{"dflash_config.target_layer_ids": None})
    assert top_taps.target_layer_ids == (1,)
    default = c(num_target_layers=12, **{"dflash_config.target_layer_ids": None})
    assert default.target_layer_ids == (6,)  # one drafter layer: [L // 2]
    with pytest.raises(dj.CheckpointError, match="missing 'mask_token_id'"):
        c(**{"dflash_config.mask_token_id": None})
    with pytest.raises(dj.CheckpointError, match=r"block_size must be"):
        c(block_size=1, **{"dflash_config.block_size": None})
