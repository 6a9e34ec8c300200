"""The scanned layer stack (`models/layer_stack.py`, `ModelConfig.scan_layers`): the same model
as the per-layer loop, one compiled layer body.

Each stacked result is compared with the looped model on the same numbers (the loop is the
independent statement here: it is checked against transformers in float64 by test_model.py)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pair import PAIR, assert_accepted, moe_from_dense, use_oracle

import dflash_jax as dj
from dflash_jax.decoding.programs import buffer_sizes, generate_programs
from dflash_jax.decoding.step import Plan
from dflash_jax.dry_run import hlo
from dflash_jax.models import layer_stack
from dflash_jax.models.transformer import KVCache
from dflash_jax.models.target import init_params, target_module
from dflash_jax.models.tiny import tiny_config
from dflash_jax.parallel import sharding
from jax.sharding import PartitionSpec as P


def _scanned(target):
    cfg = target.config.replace(scan_layers=True)
    return dj.Target(cfg, layer_stack.to_layout(target.params, cfg))


def _close(a, b):
    """rtol 1e-5 of the tensor's scale: the scan's fusions sum in another order (newest jax:
    2.7e-5 apart on logits of magnitude 40), elements near zero included."""
    a, b = np.asarray(a), np.asarray(b)
    scale = max(1.0, float(np.abs(b).max())) if b.size else 1.0
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale)


@pytest.fixture(scope="module")
def pair(bundled_pair):
    target, drafter, prompts = bundled_pair
    return target, _scanned(target), drafter, prompts


def _tiny(**kw):
    small = dict(hidden_size=32, intermediate_size=48, num_layers=5, head_dim=8)
    cfg = tiny_config(**{**small, **kw})
    return dj.Target(cfg, init_params(cfg, 3))


def _families(bundled):
    dense = bundled
    llama = _tiny(arch="llama", qk_norm=False, tie_word_embeddings=False,
                  rope_scaling=(("factor", 8.0), ("rope_type", "llama3")))  # fmt: skip
    moe = moe_from_dense(bundled, mlp_only_layers=())  # experts in every layer: one group
    return {"qwen3": dense, "llama3": llama, "moe": moe}


def _forward_everything(target, ids, taps):
    """Logits and taps of the forward without a cache, the training pass (`taps`), and a
    cache's prefill, one block and a tree verify (logits, taps and the cache's K/V)."""
    m, p = target_module(target.config), {"params": target.params}
    out = {}
    h, _, t = m.apply(p, ids, tap_layers=taps)
    out["logits"], out["taps"] = m.apply(p, h, method="logits"), t
    out["train_taps"] = m.apply(p, ids, taps[:2], method="taps")
    cache = target.init_cache(ids.shape[0], 32)
    h, cache, t = m.apply(p, ids[:, :7], cache=cache, tap_layers=taps)
    out["prefill"], out["prefill_taps"] = m.apply(p, h, method="logits"), t
    h, cache, _ = m.apply(p, ids[:, 7:11], cache=cache.rollback(cache.lengths - 1))
    out["block"] = m.apply(p, h, method="logits")
    tree = jnp.asarray(np.tril(np.ones((4, 4), bool))[None].repeat(ids.shape[0], 0))
    tree = tree.at[:, 2, 1].set(False)  # node 2 is node 0's other child
    pos = cache.lengths[:, None] + jnp.asarray([0, 1, 1, 2])[None]
    h, cache, t = m.apply(p, ids[:, 11:15], pos, cache, tree, taps, method="verify_tree")
    out["tree"], out["tree_taps"] = m.apply(p, h, method="logits"), t
    k = cache.k if cache.stacked else jnp.stack(cache.k)
    out["cache_k"], out["lengths"] = k, cache.lengths
    return out


@pytest.mark.parametrize("family", ("qwen3", "llama3", "moe"))
def test_stacked_equals_looped(family, pair):
    """Every entry point of the stacked target equals the looped one's (rtol 1e-5, float32):
    dense Qwen3, Llama-3 with llama3 RoPE scaling and an untied head, Qwen3-MoE."""
    looped = _families(pair[0])[family]
    stacked = _scanned(looped)
    assert stacked.config.scans_layers and not looped.config.scans_layers
    assert "layers" in stacked.params and "layers_0" not in stacked.params
    ids = jnp.asarray(np.random.RandomState(0).randint(0, looped.config.vocab_size, (2, 15)))
    taps = (1, 3, looped.config.num_layers - 2)
    want, got = _forward_everything(looped, ids, taps), _forward_everything(stacked, ids, taps)
    assert set(want) == set(got)
    for key in want:
        _close(got[key], want[key])
    assert float(jnp.abs(got["cache_k"]).max()) > 0


def test_irregular_layers_run_the_loop(pair):
    """A MoE target with a dense layer among expert layers cannot be one stacked group: it
    runs its loop (and its parameters stay per layer) even with scan_layers."""
    moe = moe_from_dense(pair[0], mlp_only_layers=(2,))
    cfg = moe.config.replace(scan_layers=True)
    assert not cfg.scans_layers
    assert "layers_0" in layer_stack.to_layout(moe.params, cfg)
    with pytest.raises(ValueError, match="layers_2 differs"):
        layer_stack.stack_layers(moe.params, cfg.num_layers)


def test_stack_round_trip_and_files_are_bit_identical(pair, tmp_path):
    """stack -> unstack gives every tensor back bit for bit; `load_target(scan_layers=True)`
    holds the stacked file tensors; a stacked target saves the same safetensors as the looped
    one (per-layer names), and quantizing it quantizes each layer as the loop does."""
    target, stacked = pair[0], pair[1]
    back = layer_stack.unstack_layers(stacked.params)
    flat = lambda t: dict(jax.tree_util.tree_flatten_with_path(t)[0])  # noqa: E731
    assert flat(back).keys() == flat(target.params).keys()
    for k, v in flat(target.params).items():
        assert np.array_equal(np.asarray(flat(back)[k]), np.asarray(v)), k
    loaded = dj.load_target(os.path.join(PAIR, "target"), scan_layers=True)
    assert loaded.config.scans_layers
    for k, v in flat(stacked.params).items():
        assert np.array_equal(np.asarray(flat(loaded.params)[k]), np.asarray(v)), k
    from dflash_jax.models.safetensors_io import SafetensorsDir

    dj.save_target(target, str(tmp_path / "looped"))
    dj.save_target(stacked, str(tmp_path / "stacked"))
    a, b = SafetensorsDir(str(tmp_path / "looped")), SafetensorsDir(str(tmp_path / "stacked"))
    assert sorted(a.names()) == sorted(b.names()) and "model.layers.5.mlp.up_proj.weight" in a
    for name in a.names():
        assert np.array_equal(a.get(name), b.get(name)), name
    q_loop, q_stack = dj.quantize_target(target), dj.quantize_target(stacked)
    for k, v in flat(layer_stack.stack_layers(q_loop.params, 6)).items():
        assert np.array_equal(np.asarray(flat(q_stack.params)[k]), np.asarray(v)), k


def test_sharding_rules_see_one_layer():
    """The partition rules speak of one layer; a stacked parameter gets the same spec behind
    an unsplit layer axis, and a stacked cache [L, B, S, K*D] the per-layer cache's spec."""

    class Mesh:  # what the rules read of a mesh: its axis sizes
        shape = {"data": 2, "fsdp": 1, "tensor": 4}

    target = _tiny(num_heads=8, num_kv_heads=4, head_dim=8, hidden_size=64)
    stacked = _scanned(target)
    rules = sharding.target_rules()
    looped = sharding.param_specs(target.params, Mesh, rules, 8)
    specs = sharding.param_specs(stacked.params, Mesh, rules, 8)
    one, many = looped["layers_0"], specs["layers"]
    assert jax.tree_util.tree_structure(one) == jax.tree_util.tree_structure(many)
    pairs = zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(many))
    for a, b in pairs:
        assert tuple(b) == ((None, *a) if tuple(a) else ()), (a, b)
    assert tuple(many["self_attn"]["q_proj"]["kernel"]) == (None, None, "tensor")
    cache = KVCache.create(stacked.config, 4, 16, stacked=True)
    spec = sharding.cache_specs(cache, Mesh)
    flat = sharding.cache_specs(KVCache.create(target.config, 4, 16), Mesh)
    assert tuple(spec.k) == (None, *flat.k[0]) == (None, "data", None, "tensor")
    # A rule with more dimensions than the (per-layer) parameter is an error, not replication.
    bad = ((r"input_layernorm/scale$", P("tensor", None), ()),) + tuple(rules)
    for params in (target.params, stacked.params):
        with pytest.raises(ValueError, match=r"input_layernorm/scale has shape \(.*\)"):
            sharding.param_specs(params, Mesh, bad, 8)


def test_generate_is_lossless_with_the_stacked_target(pair):
    """AR over the stacked target gives the looped target's tokens, and DFlash (a chain at
    block 8, a draft tree) over it gives those tokens with its drafter accepted."""
    target, stacked, drafter, prompts = pair
    ar = dj.generate(target, None, prompts, 40).tokens
    assert dj.generate(stacked, None, prompts, 40).tokens == ar
    for kw in ({"block_size": 8}, {"block_size": 8, "tree_budget": 12}):
        res = dj.generate(stacked, drafter, prompts, 40, **kw)
        assert res.tokens == ar, kw
        assert_accepted(res, kw["block_size"])


def test_decode_loop_copies_no_stack(pair):
    """The compiled DFlash decode loop over the stacked cache [L, B, S, K*D] writes each
    layer's new K/V into the stack where it lies (one scatter): no instruction of a loop body
    copies, pads, concatenates or transposes a buffer the size of the whole stack. (Per-layer slices are what the looped cache reads too: on CPU, XLA's attention
    transposes each layer's cache in both layouts; the TPU / GPU kernels' no-copy checks are
    the dry runs'.) Control: the same scan finds the copy of a loop that rotates the layers."""
    _, stacked, drafter, prompts = pair
    cfg = stacked.config
    tmod, dmod = target_module(cfg), dj.DFlashDrafter(drafter.config)
    p_pad, n_buf, cap = buffer_sizes(26, 16, 8)
    ids = np.zeros((2, p_pad), np.int32)
    for b, p in enumerate(prompts[:2]):
        ids[b, : len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts[:2]], jnp.int32)
    prefill, decode, _ = generate_programs(
        tmod, dmod, Plan(block_size=8), cap, n_buf, None, stacked.params, drafter.params, 2, p_pad
    )
    state = prefill(stacked.params, drafter.params, jnp.asarray(ids), lens, jnp.int32(16),
                    jax.random.PRNGKey(0))  # fmt: skip
    assert state.cache.stacked and state.cache.k.shape[:2] == (cfg.num_layers, 2)
    text = decode.lower(stacked.params, drafter.params, state).compile().as_text()
    whole = cfg.num_layers * 2 * cap * cfg.num_kv_heads * cfg.head_dim
    ops = ("copy", "pad", "concatenate", "transpose")  # an in-place update is no copy
    assert hlo.loop_body_computations(text)
    assert "scatter" in text
    assert hlo.cache_sized_copies(text, cap, whole, ops) == []

    def rotates(k):  # the control: every step copies the whole stack
        return jax.lax.fori_loop(0, 3, lambda i, k: jnp.concatenate([k[1:], k[:1]]) + 1.0, k)

    control = jax.jit(rotates).lower(state.cache.k).compile().as_text()
    assert hlo.cache_sized_copies(control, cap, whole, ops) != []


def test_kernel_paths_are_lossless_with_the_stacked_cache(pair):
    """Through the Pallas kernels (interpret mode on CPU: the TPU cache-write kernel writing
    one layer of the stack where it lies, the attention kernels), a chain and a tree over the
    stacked target give the looped target's AR tokens, the drafter accepted."""
    target, stacked, drafter, prompts = pair
    ar = dj.generate(target, None, prompts[:2], 12).tokens
    kw = dict(attention_impl="pallas_interpret")
    res = dj.generate(stacked, drafter, prompts[:2], 12, block_size=4, **kw)
    assert res.tokens == ar
    assert_accepted(res, 4, min_tau=1.3)
    tree = dj.generate(stacked, drafter, prompts[:2], 12, tree_budget=8, **kw)
    assert tree.tokens == ar


# ---------------------------------------------------------------------------- hybrid groups


def _hybrid_config(moe=False, types=None, num_layers=8):
    """A small Qwen3.5-style config: 3 Gated DeltaNet layers and 1 gated attention layer
    repeated (Qwen3.5 / 3.6's pattern), or `types`; with `moe`, experts and a shared expert in
    every layer."""
    from dflash_jax.models.config import HybridSpec, hybrid_layers

    kw = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
              norm_topk_prob=True) if moe else {}  # fmt: skip
    cfg = dj.ModelConfig(
        arch="qwen3_5_moe" if moe else "qwen3_5",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
        max_position_embeddings=128,
        hybrid=HybridSpec(
            layer_types=types or hybrid_layers(num_layers),
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            shared_expert_intermediate_size=24 if moe else 0,
        ),
        **kw,
    )
    return cfg


def _hybrid(moe=False, types=None, num_layers=8, scale=1.0):
    """A random target of `_hybrid_config`, its matrices times `scale` (3: peaked logits, the
    recurrent state decisive)."""
    cfg = _hybrid_config(moe, types, num_layers)
    params = jax.jit(  # one program for every scale (an argument, not a constant)
        lambda s: jax.tree_util.tree_map(lambda x: x * s if x.ndim >= 2 else x, init_params(cfg, 3))
    )(np.float32(scale))  # fmt: skip
    return dj.Target(cfg, params)


def _hybrid_everything(target, ids, taps):
    """Logits and taps without a cache and of the training pass; a prefill rolled back to
    ragged lengths, a verified block settled at ragged accepted lengths (the recurrent state
    and the convolution window at each row's accepted prefix) and the next block: its logits,
    and the cache's recurrent states, windows and K/V."""
    m, p = target_module(target.config), {"params": target.params}
    out = {}
    h, _, t = m.apply(p, ids, tap_layers=taps)
    out["logits"], out["taps"] = m.apply(p, h, method="logits"), t
    out["train_taps"] = m.apply(p, ids, taps[:2], method="taps")
    cache = target.init_cache(ids.shape[0], 32)
    h, cache, t = m.apply(p, ids[:, :7], cache=cache, tap_layers=taps)
    out["prefill"], out["prefill_taps"] = m.apply(p, h, method="logits"), t
    cache = cache.rollback(jnp.asarray([7, 5]))
    h, cache, _ = m.apply(p, ids[:, 7:11], cache=cache.pad_pending(4))
    out["block"] = m.apply(p, h, method="logits")
    cache = cache.pad_pending(6).rollback(cache.base + jnp.asarray([2, 4]))
    h, cache, _ = m.apply(p, ids[:, 11:13], cache=cache)
    out["next"] = m.apply(p, h, method="logits")
    cache = cache.rollback(cache.lengths)
    stack = lambda x: x if cache.stacked else jnp.stack(x)  # noqa: E731
    out["state"], out["conv"] = stack(cache.state), stack(cache.conv)
    out["k"], out["lengths"] = stack(cache.kv.k), cache.lengths
    return out


@pytest.mark.parametrize("moe", (False, True), ids=("qwen3_5", "qwen3_5_moe"))
def test_hybrid_groups_stacked_equal_looped(moe):
    """A hybrid target scans groups of its pattern (3 DeltaNets + 1 attention, twice): each
    slot's parameters stacked over the groups, the cache's K/V, windows and states stacked per
    kind. Every entry point equals the loop's (rtol 1e-5, float32), the ragged settles too; the
    parameters unstack bit for bit. A pattern that does not repeat runs the loop."""
    looped = _hybrid(moe)
    stacked = _scanned(looped)
    assert stacked.config.layer_period == 4 and stacked.config.scans_layers
    assert sorted(stacked.params["layers"]) == ["slot_0", "slot_1", "slot_2", "slot_3"]
    assert "linear_attn" in stacked.params["layers"]["slot_0"]
    assert "self_attn" in stacked.params["layers"]["slot_3"]
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 15)))
    run = lambda t: jax.jit(  # noqa: E731 - compiled both: the same fusions around the layers
        lambda p: _hybrid_everything(dj.Target(t.config, p), ids, (1, 3, 6))
    )(t.params)
    want, got = run(looped), run(stacked)
    assert set(want) == set(got)
    for key in want:
        _close(got[key], want[key])
    assert float(jnp.abs(got["state"]).max()) > 0 and float(jnp.abs(got["k"]).max()) > 0
    back = layer_stack.unstack_layers(stacked.params)
    flat = lambda t: dict(jax.tree_util.tree_flatten_with_path(t)[0])  # noqa: E731
    assert flat(back).keys() == flat(looped.params).keys()
    for k, v in flat(looped.params).items():
        assert np.array_equal(np.asarray(flat(back)[k]), np.asarray(v)), k

    L, F = "linear_attention", "full_attention"
    irregular = _hybrid_config(types=(L, F, L, L, L, F), num_layers=6).replace(scan_layers=True)
    assert irregular.layer_period == 6 and not irregular.scans_layers
    odd = _hybrid_config(num_layers=6).replace(scan_layers=True)  # 3:1 does not divide 6
    assert odd.layer_period == 6 and not odd.scans_layers


def test_hybrid_stacked_decoding_is_lossless_and_accepted(monkeypatch):
    """AR over the stacked hybrid target gives the looped target's tokens; DFlash over it (an
    oracle drafter reading that continuation, wrong at every fifth position: ragged acceptance,
    so the stacked states settle at different lengths per row) gives them too, accepted."""

    looped = _hybrid(scale=3.0)
    stacked = _scanned(looped)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    ar = dj.generate(looped, None, prompts, 24, prefill_chunk=4).tokens
    assert dj.generate(stacked, None, prompts, 24, prefill_chunk=4).tokens == ar
    full = np.zeros((len(prompts), 64), np.int32)
    for i, (p, c) in enumerate(zip(prompts, ar)):
        full[i, : len(p) + len(c)] = p + c
    table = jnp.asarray(full)

    def draft(kind, dec, ctx, x_last, start):
        pos = start[:, None] + 1 + jnp.arange(dec.plan.block_size - 1)[None]
        d = jnp.take_along_axis(table, jnp.minimum(pos, table.shape[1] - 1), axis=1)
        return jnp.where(pos % 5 == 0, (d + 1) % 64, d), jnp.ones(d.shape, jnp.float32)

    use_oracle(monkeypatch, draft_block=draft)
    cfg = dj.make_drafter_config(stacked.config, num_layers=1, num_taps=2, block_size=8,
                                 mask_token_id=63)  # fmt: skip
    drafter = dj.Drafter(cfg, dj.init_drafter_params(cfg, seed=1))
    res = dj.generate(stacked, drafter, prompts, 24, block_size=8)
    assert res.tokens == ar
    assert res.tau > 2.5 and len({a[0] for a in res.acceptance_lengths}) > 1


def test_hybrid_stacked_files_and_shardings(tmp_path):
    """A hybrid checkpoint loads into the grouped layout (`load_target(scan_layers=True)`: the
    file's tensors stacked slot by slot, bit for bit) and saves back to the same per-layer
    safetensors; the sharding rules give each stacked slot one layer's spec behind an unsplit
    group axis, and the stacked cache's K/V, windows and states their per-layer specs."""
    from dflash_jax.models.hybrid import HybridCache
    from dflash_jax.models.safetensors_io import SafetensorsDir

    looped = _hybrid()
    dj.save_target(looped, str(tmp_path / "looped"))
    loaded = dj.load_target(str(tmp_path / "looped"), scan_layers=True)
    assert loaded.config.scans_layers
    flat = lambda t: dict(jax.tree_util.tree_flatten_with_path(t)[0])  # noqa: E731
    want = flat(layer_stack.stack_layers(looped.params, 8, 4))
    assert flat(loaded.params).keys() == want.keys()
    for k, v in want.items():
        assert np.array_equal(np.asarray(flat(loaded.params)[k]), np.asarray(v)), k
    dj.save_target(loaded, str(tmp_path / "stacked"))
    a, b = SafetensorsDir(str(tmp_path / "looped")), SafetensorsDir(str(tmp_path / "stacked"))
    assert sorted(a.names()) == sorted(b.names()) and "model.layers.7.self_attn.q_proj.weight" in a
    for name in a.names():
        assert np.array_equal(a.get(name), b.get(name)), name

    class Mesh:
        shape = {"data": 2, "fsdp": 1, "tensor": 2}

    rules = sharding.target_rules()
    per_layer = sharding.param_specs(looped.params, Mesh, rules, 16)
    specs = sharding.param_specs(loaded.params, Mesh, rules, 16)
    for j in range(4):
        one, many = per_layer[f"layers_{j}"], specs["layers"][f"slot_{j}"]
        assert jax.tree_util.tree_structure(one) == jax.tree_util.tree_structure(many)
        for x, y in zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(many)):
            assert tuple(y) == ((None, *x) if tuple(x) else ()), (j, x, y)
    cfg = loaded.config
    stacked = sharding.cache_specs(HybridCache.create(cfg, 4, 16, stacked=True), Mesh)
    flat_c = sharding.cache_specs(HybridCache.create(cfg, 4, 16), Mesh)
    assert tuple(stacked.kv.k) == (None, *flat_c.kv.k[0])
    assert tuple(stacked.conv) == (None, *flat_c.conv[0]) == (None, "data")
    assert tuple(stacked.state) == (None, *flat_c.state[0]) == (None, "data", "tensor")


def test_hybrid_decode_loop_copies_no_kv_stack():
    """The compiled DFlash decode loop over a stacked hybrid cache writes each attention
    layer's new K/V into the stack [F, B, S, K*D] where it lies: no loop-body instruction
    copies, pads, concatenates or transposes a buffer of the whole K/V stack's size."""
    stacked = _scanned(_hybrid())
    cfg = stacked.config
    dcfg = dj.make_drafter_config(cfg, num_layers=1, num_taps=2, block_size=8, mask_token_id=63)
    drafter = dj.Drafter(dcfg, dj.init_drafter_params(dcfg, seed=1))
    tmod, dmod = target_module(cfg), dj.DFlashDrafter(dcfg)
    p_pad, n_buf, cap = buffer_sizes(26, 16, 8)
    ids = jnp.zeros((2, p_pad), jnp.int32).at[:, :5].set(3)
    prefill, decode, _ = generate_programs(
        tmod, dmod, Plan(block_size=8), cap, n_buf, None, stacked.params, drafter.params, 2, p_pad
    )
    state = prefill(stacked.params, drafter.params, ids, jnp.asarray([5, 4], jnp.int32),
                    jnp.int32(16), jax.random.PRNGKey(0))  # fmt: skip
    assert state.cache.stacked and state.cache.kv.k.shape[:2] == (2, 2)
    text = decode.lower(stacked.params, drafter.params, state).compile().as_text()
    whole = 2 * 2 * cap * cfg.num_kv_heads * cfg.head_dim
    assert hlo.loop_body_computations(text)
    ops = ("copy", "pad", "concatenate", "transpose")
    assert hlo.cache_sized_copies(text, cap, whole, ops) == []
