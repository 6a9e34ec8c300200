"""The EAGLE-3 drafter (`drafters.eagle3`) against an independent NumPy float64 statement of
the published layer, on a small checkpoint written here in the published layout; its format
round trip, the draft-to-target vocabulary map and the config checks."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from dflash_jax.drafters import eagle3 as e3
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.safetensors_io import CheckpointError

# Scaled-down shapes of a published checkpoint: width H, 4 query / 2 key-value heads, a draft
# vocabulary of 50 of a target vocabulary of 128, taps 48 wide (a target narrower than H).
H, NH, KVH, D, FF = 64, 4, 2, 16, 96
V, VD, TH = 128, 50, 48
EPS, THETA = 1e-5, 10000.0
B, P = 2, 5  # batch, context rows


def published_config(**overrides):
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": D,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": FF,
        "max_position_embeddings": 2048,
        "num_attention_heads": NH,
        "num_hidden_layers": 1,
        "num_key_value_heads": KVH,
        "rms_norm_eps": EPS,
        "rope_scaling": None,
        "rope_theta": THETA,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": V,
        "draft_vocab_size": VD,
        "target_hidden_size": TH,
    }
    cfg.update(overrides)
    return cfg


def published_tensors(seed=0):
    """Random weights under the published names ([out, in] linears), d2t int64, t2d bool."""
    rng = np.random.default_rng(seed)

    def lin(out, inp):
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    kept = np.sort(rng.choice(V, size=VD, replace=False))  # the draft vocabulary's target ids
    t2d = np.zeros(V, bool)
    t2d[kept] = True
    return {
        "fc.weight": lin(H, 3 * TH),
        "midlayer.input_layernorm.weight": norm(H),
        "midlayer.hidden_norm.weight": norm(H),
        "midlayer.self_attn.q_proj.weight": lin(NH * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": lin(KVH * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": lin(KVH * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": lin(H, NH * D),
        "midlayer.post_attention_layernorm.weight": norm(H),
        "midlayer.mlp.gate_proj.weight": lin(FF, H),
        "midlayer.mlp.up_proj.weight": lin(FF, H),
        "midlayer.mlp.down_proj.weight": lin(H, FF),
        "norm.weight": norm(H),
        "lm_head.weight": lin(VD, H),
        "d2t": (kept - np.arange(VD)).astype(np.int64),
        "t2d": t2d,
    }


def write_published(directory, config=None, tensors=None):
    os.makedirs(directory, exist_ok=True)
    tensors = published_tensors() if tensors is None else tensors
    safetensors.numpy.save_file(
        tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"}
    )
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(published_config() if config is None else config, f)
    return str(directory)


# ------------------------------------------------------------ the NumPy statement (float64)


def _rms(x, w):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS))


def _rope(x, pos):  # x [T, n, D], half-split rotation at absolute positions pos [T]
    inv = 1.0 / THETA ** (np.arange(0, D, 2) / D)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def np_rows(w, emb, feat, pos, past_k, past_v, norm_before_residual=False):
    """One sequence's T new rows: emb, feat [T, H], pos [T]; past K/V [S, KVH, D] (RoPE'd).
    Returns (out [T, H] pre-norm, logits [T, VD], K, V with the new rows appended)."""
    t = emb.shape[0]
    g = _rms(feat, w["midlayer.hidden_norm.weight"])
    x = np.concatenate([_rms(emb, w["midlayer.input_layernorm.weight"]), g], axis=-1)  # [T, 2H]
    q = _rope((x @ w["midlayer.self_attn.q_proj.weight"].T).reshape(t, NH, D), pos)
    k = _rope((x @ w["midlayer.self_attn.k_proj.weight"].T).reshape(t, KVH, D), pos)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).reshape(t, KVH, D)
    keys, vals = np.concatenate([past_k, k]), np.concatenate([past_v, v])
    s = past_k.shape[0]
    visible = np.arange(s + t)[None, :] <= s + np.arange(t)[:, None]  # past, then causal
    heads = []
    for h in range(NH):
        kv = h // (NH // KVH)
        scores = q[:, h] @ keys[:, kv].T / np.sqrt(D)
        scores = np.where(visible, scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        heads.append((p / p.sum(axis=-1, keepdims=True)) @ vals[:, kv])
    attn = np.stack(heads, axis=1).reshape(t, NH * D) @ w["midlayer.self_attn.o_proj.weight"].T
    h = (g if norm_before_residual else feat) + attn
    m = _rms(h, w["midlayer.post_attention_layernorm.weight"])
    gate = m @ w["midlayer.mlp.gate_proj.weight"].T
    up = m @ w["midlayer.mlp.up_proj.weight"].T
    out = h + (gate / (1.0 + np.exp(-gate)) * up) @ w["midlayer.mlp.down_proj.weight"].T
    logits = _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    return out, logits, keys, vals


# ------------------------------------------------------------ helpers on the implementation


def _apply(drafter, method, *args):
    fn = jax.jit(lambda variables, *a: drafter.module.apply(variables, *a, method=method))
    return fn(drafter.variables, *args)


def _inputs(seed=1):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((V, H)).astype(np.float32)  # the target's embedding
    taps = rng.standard_normal((B, P, 3 * TH)).astype(np.float32)
    tokens = rng.integers(0, V, size=(B, P))
    return table, taps, tokens


def _close(got, want, rtol=1e-4):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.max(np.abs(got - want)) / max(1e-30, np.max(np.abs(want)))
    assert err < rtol, f"relative error {err:.2e}"


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return write_published(tmp_path_factory.mktemp("eagle3") / "published")


@pytest.fixture(scope="module")
def drafter(checkpoint_dir):
    return e3.load_eagle3(checkpoint_dir)


# ------------------------------------------------------------ (a) the forward


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_prefill_rows_match_the_numpy_statement(tmp_path, norm_before_residual):
    """P context rows in one pass from an empty cache, each fed fc(taps): hidden and logits
    equal the float64 statement of the published layer to 1e-4 (relative)."""
    cfg = published_config(norm_before_residual=norm_before_residual)
    d = e3.load_eagle3(write_published(tmp_path / "ckpt", cfg))
    assert d.config.norm_before_residual is norm_before_residual
    w = {k: np.asarray(x, np.float64) for k, x in published_tensors().items()}
    table, taps, tokens = _inputs()
    emb = table[tokens]
    pos = np.broadcast_to(np.arange(3, 3 + P), (B, P)).astype(np.int32)  # any start position
    cache = e3.create_cache(d.config, B, 8)
    feat = _apply(d, e3.Eagle3Drafter.fuse, taps)
    hidden, logits, k, v = _apply(
        d, e3.Eagle3Drafter.step, emb, feat, pos, cache.k[0], cache.v[0], cache.lengths
    )
    assert hidden.shape == (B, P, H) and logits.shape == (B, P, VD) and logits.dtype == jnp.float32
    assert k.shape == (B, P, KVH, D)
    empty = np.zeros((0, KVH, D))
    for b in range(B):
        f = taps[b].astype(np.float64) @ w["fc.weight"].T
        _close(feat[b], f)
        out, ref_logits, ref_k, ref_v = np_rows(
            w, emb[b].astype(np.float64), f, pos[b], empty, empty, norm_before_residual
        )
        _close(hidden[b], out)
        _close(logits[b], ref_logits)
        _close(k[b], ref_k)
        _close(v[b], ref_v)


def test_row_by_row_through_the_cache_equals_one_pass(drafter):
    """The same rows fed one at a time, each step's K/V written to the cache, give the
    one-pass hidden states and logits."""
    table, taps, tokens = _inputs()
    emb = table[tokens]
    pos = np.broadcast_to(np.arange(P), (B, P)).astype(np.int32)
    cache = e3.create_cache(drafter.config, B, 8)
    feat = _apply(drafter, e3.Eagle3Drafter.fuse, taps)
    step = e3.Eagle3Drafter.step
    hidden, logits, _, _ = _apply(
        drafter, step, emb, feat, pos, cache.k[0], cache.v[0], cache.lengths
    )
    for t in range(P):
        h1, l1, k1, v1 = _apply(
            drafter,
            step,
            emb[:, t : t + 1],
            feat[:, t : t + 1],
            pos[:, t : t + 1],
            cache.k[0],
            cache.v[0],
            cache.lengths,
        )
        cache = e3.write_step_kv(cache, k1, v1, pos[:, t : t + 1], cache.lengths + 1)
        _close(h1[:, 0], hidden[:, t], 1e-5)
        _close(l1[:, 0], logits[:, t], 1e-5)
    assert np.array_equal(np.asarray(cache.lengths), [P, P])


def test_draft_chain_matches_the_numpy_statement(drafter):
    """The prefill of P rows (fc features), then 3 greedy draft steps, each one row at the
    next position fed the step before's pre-norm hidden state and the embedding of its drafted
    token (mapped to the target vocabulary by d2t): the logits of every step equal the
    statement's, and so do the drafted tokens."""
    w = {k: np.asarray(x, np.float64) for k, x in published_tensors().items()}
    table, taps, tokens = _inputs(seed=2)
    emb = table[tokens]
    pos = np.broadcast_to(np.arange(P), (B, P)).astype(np.int32)
    cache = e3.create_cache(drafter.config, B, P + 4)
    feat = _apply(drafter, e3.Eagle3Drafter.fuse, taps)
    hidden, logits, k, v = _apply(
        drafter, e3.Eagle3Drafter.step, emb, feat, pos, cache.k[0], cache.v[0], cache.lengths
    )
    cache = e3.write_step_kv(cache, k, v, pos, cache.lengths + P)
    last_h, last_l = hidden[:, -1:], logits[:, -1:]
    chain = []  # per step: (the target id drafted, the logits of the row it fed)
    for step in range(3):
        ids = _apply(drafter, e3.Eagle3Drafter.to_target_ids, jnp.argmax(last_l, axis=-1))
        p = np.full((B, 1), P + step, np.int32)
        last_h, last_l, k, v = _apply(
            drafter,
            e3.Eagle3Drafter.step,
            table[np.asarray(ids)],
            last_h,
            p,
            cache.k[0],
            cache.v[0],
            cache.lengths,
        )
        cache = e3.write_step_kv(cache, k, v, p, cache.lengths + 1)
        chain.append((np.asarray(ids[:, 0]), np.asarray(last_l[:, 0])))
    for b in range(B):
        empty = np.zeros((0, KVH, D))
        f = taps[b].astype(np.float64) @ w["fc.weight"].T
        out, lg, ks, vs = np_rows(w, emb[b].astype(np.float64), f, np.arange(P), empty, empty)
        h, last = out[-1:], lg[-1]
        for step, (ids, got) in enumerate(chain):
            tok = int(np.argmax(last))
            tok = tok + int(w["d2t"][tok])
            assert ids[b] == tok
            row = table[tok][None].astype(np.float64)
            h, lg, ks, vs = np_rows(w, row, h, np.array([P + step]), ks, vs)
            last = lg[0]
            _close(got[b], last)


# ------------------------------------------------------------ (b) the format round trip


def test_save_load_round_trip_is_bit_exact(drafter, checkpoint_dir, tmp_path):
    out = tmp_path / "saved"
    e3.save_eagle3(drafter, out)
    back = e3.load_eagle3(out)
    assert back.config == drafter.config
    flat = lambda p: jax.tree_util.tree_flatten_with_path(p)[0]
    for (pa, a), (pb, b) in zip(flat(drafter.params), flat(back.params)):
        assert pa == pb and a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert np.array_equal(back.d2t, drafter.d2t) and back.embedding is None
    # The published names and dtypes, every tensor equal to the file it was read from.
    mine = safetensors.numpy.load_file(os.path.join(out, "model.safetensors"))
    theirs = published_tensors()
    assert set(mine) == set(theirs)
    assert mine["d2t"].dtype == np.int64 and mine["t2d"].dtype == np.bool_
    for name, x in theirs.items():
        assert np.array_equal(mine[name], x), name
    # config.json keeps every field the published one sets (values as written).
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    for key, value in published_config().items():
        if key not in ("bos_token_id", "eos_token_id"):
            assert written[key] == value, key
    assert e3.Eagle3Config.from_hf(written) == drafter.config


def test_new_drafter_with_its_own_embedding_round_trips(tmp_path):
    target = ModelConfig(
        vocab_size=V, hidden_size=TH, intermediate_size=FF, num_layers=8, num_heads=4,
        num_kv_heads=2, head_dim=12, arch="llama", qk_norm=False,
    )  # fmt: skip
    cfg = e3.make_eagle3_config(
        target, draft_vocab_size=VD, target_layer_ids=(1, 3, 4), hidden_size=H, head_dim=D,
        intermediate_size=FF,
    )  # fmt: skip
    params = e3.init_eagle3_params(cfg, seed=3)
    d2t = published_tensors()["d2t"]
    emb = jnp.asarray(np.random.default_rng(4).standard_normal((V, H)), jnp.float32)
    e3.save_eagle3(e3.Eagle3(cfg, params, d2t, emb), tmp_path)
    back = e3.load_eagle3(tmp_path)
    assert back.config == cfg and back.config.tap_layers(8) == (1, 3, 4)
    assert np.array_equal(np.asarray(back.embedding), np.asarray(emb))
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda a, b: np.array_equal(a, b), params, back.params)
    )
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    # Its own embedding lets it serve a target of another width.
    e3.validate_eagle3_pair(cfg, target, own_embedding=True)
    with pytest.raises(ValueError, match="no embed_tokens of its own"):
        e3.validate_eagle3_pair(cfg, target, own_embedding=False)


# ------------------------------------------------------------ (c) the vocabulary map


def test_d2t_maps_the_draft_vocabulary_into_the_target_vocabulary(drafter):
    theirs = published_tensors()
    ids = jnp.arange(VD)
    targets = np.asarray(_apply(drafter, e3.Eagle3Drafter.to_target_ids, ids))
    assert np.array_equal(targets, np.arange(VD) + theirs["d2t"])
    assert np.array_equal(np.asarray(e3.draft_to_target_ids(ids, drafter.d2t)), targets)
    # t2d marks exactly the target ids d2t reaches, as the file's own t2d does.
    assert np.array_equal(drafter.t2d, theirs["t2d"]) and drafter.t2d.sum() == VD
    assert np.all(theirs["t2d"][targets]) and len(set(targets.tolist())) == VD
    # Full-vocabulary logits: the draft logits at their target ids, -inf elsewhere; the
    # argmax there is the mapped argmax of the draft logits.
    logits = jnp.asarray(np.random.default_rng(5).standard_normal((3, VD)), jnp.float32)
    full = np.asarray(e3.full_vocab_logits(logits, drafter.d2t, V))
    assert np.array_equal(full[:, targets], np.asarray(logits))
    assert np.all(np.isneginf(full[:, ~theirs["t2d"]]))
    assert np.array_equal(full.argmax(-1), targets[np.asarray(logits).argmax(-1)])


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: t.update(d2t=t["d2t"] + 200), r"outside \[0, 128\)"),
        (lambda t: t.update(d2t=-np.arange(VD, dtype=np.int64)), "same target id"),
        (lambda t: t.update(d2t=t["d2t"][:-1]), r"shape \(49,\), expected \(50,\)"),
        (lambda t: t.update(t2d=~t["t2d"]), "'t2d' disagrees with 'd2t'"),
        (lambda t: t.pop("d2t"), "missing tensor 'd2t'"),
    ],
)
def test_bad_vocabulary_maps_are_one_line(tmp_path, change, match):
    tensors = published_tensors()
    change(tensors)
    with pytest.raises(CheckpointError, match=match) as e:
        e3.load_eagle3(write_published(tmp_path, tensors=tensors))
    assert "\n" not in str(e.value)


def test_no_d2t_with_the_whole_vocabulary_is_the_identity(tmp_path):
    tensors = published_tensors()
    del tensors["d2t"], tensors["t2d"]
    tensors["lm_head.weight"] = np.zeros((V, H), np.float32)
    d = e3.load_eagle3(write_published(tmp_path, published_config(draft_vocab_size=None), tensors))
    assert d.config.draft_vocab_size == V and np.array_equal(d.d2t, np.zeros(V))


# ------------------------------------------------------------ (d) bad configs


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(draft_vocab_size=200), "draft_vocab_size=200 exceeds the target vocabulary"),
        (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads=3"),
        (dict(hidden_size=None), "missing required field 'hidden_size'"),
        (dict(architectures=["LlamaForCausalLM"]), "not an EAGLE-3 drafter"),
        (dict(num_hidden_layers=2), "one layer"),
        (dict(draft_vocab_size="50"), "draft_vocab_size must be an integer"),
        (dict(norm_before_fc=True), "norm_before_fc=true"),
        (dict(norm_before_residual="yes"), "norm_before_residual must be true or false"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2]}), "three distinct"),
        (dict(eagle_config={"use_aux_hidden_state": False}), "use_aux_hidden_state"),
    ],
)
def test_bad_configs_are_one_line(overrides, match):
    hf = {k: v for k, v in published_config(**overrides).items() if v is not None}
    with pytest.raises(ValueError, match=match) as e:
        e3.Eagle3Config.from_hf(hf, source="x/config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("x/config.json")


def test_pairing_with_a_target_is_checked(drafter):
    cfg = drafter.config
    target = ModelConfig(
        vocab_size=V, hidden_size=TH, intermediate_size=FF, num_layers=8, num_heads=4,
        num_kv_heads=2, head_dim=12, arch="llama", qk_norm=False,
    )  # fmt: skip
    assert cfg.tap_layers(8) == (1, 3, 4)  # (1, L//2 - 1, L - 4)
    with pytest.raises(ValueError, match="differs from the target's 48 and its file has no"):
        e3.validate_eagle3_pair(cfg, target, own_embedding=False)
    with pytest.raises(ValueError, match="expects target hidden size 48, target has 64"):
        e3.validate_eagle3_pair(cfg, target.replace(hidden_size=H), own_embedding=False)
    with pytest.raises(ValueError, match="vocabulary 128 differs from the target's 256"):
        e3.validate_eagle3_pair(cfg, target.replace(vocab_size=256), own_embedding=True)
    with pytest.raises(ValueError, match="do not fit a 4-layer target"):
        cfg.tap_layers(4)
    with pytest.raises(ValueError, match="taps target layers \\[1, 2, 9\\]"):
        cfg.replace(target_layer_ids=(1, 2, 9)).tap_layers(8)
