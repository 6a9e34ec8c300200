"""DFlash 2 drafters: the candidate selector, the convolution and the logit rule against NumPy
statements written here; the z-lab DFlash 2 file layout (written here tensor by tensor, read,
written back bit-exact); decoding lossless with accepted drafts (the bundled DFlash drafter
made a DFlash 2 one: identity convolutions and a silent selector draft exactly as it does,
then a live selector); bad configs one line. The layer forward against the PyTorch reference
is in test_drafter.py."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pair import assert_accepted
from safetensors.numpy import load_file, save_file

import dflash_jax as dj
from dflash_jax.drafters import dflash2
from dflash_jax.drafters.dflash import upgrade_to_dflash2


def _select_numpy(logits, proj, pred, succ, x_last, k, temperature=0.0, u=None):
    """The selector's walk, stated slot by slot: candidates = the K largest logits; candidate c
    after p scores logits[c] + sum_r pred[p, r] * proj[r] * succ[c, r]; greedy: the best one
    (the first on a tie, in descending-logit order); sampled: the candidate whose cumulative
    softmax(scores / T) first exceeds u. Returns (tokens, q per slot over its candidates)."""
    b, t, _ = logits.shape
    toks = np.zeros((b, t), np.int64)
    qs = np.zeros((b, t, k))
    for i in range(b):
        prev = x_last[i]
        for s in range(t):
            cand = np.argsort(-logits[i, s], kind="stable")[:k]
            scores = logits[i, s, cand] + (pred[prev] * proj[i, s]) @ succ[cand].T
            if temperature > 0:
                z = np.exp((scores - scores.max()) / temperature)
                qs[i, s] = z / z.sum()
                j = int(np.searchsorted(np.cumsum(qs[i, s]), u[i, s]))
            else:
                j = int(np.argmax(scores))
                qs[i, s, j] = 1.0
            prev = cand[min(j, k - 1)]
            toks[i, s] = prev
    return toks, qs


def test_selector_walk_follows_the_rule():
    rs = np.random.RandomState(0)
    b, t, v, r, k = 3, 7, 50, 6, 5
    logits = rs.randn(b, t, v).astype(np.float32) * 2
    proj = rs.randn(b, t, r).astype(np.float32)
    pred, succ = rs.randn(2, v, r).astype(np.float32)
    x_last = np.array([3, 17, 44])
    unary, cand = jax.lax.top_k(jnp.asarray(logits), k)
    got, _, q = dflash2.walk(
        unary,
        cand,
        jnp.asarray(proj),
        jnp.asarray(pred),
        jnp.asarray(succ),
        jnp.asarray(x_last),
        0.0,
        None,
    )
    want, want_q = _select_numpy(logits, proj, pred, succ, x_last, k)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(q), want_q)
    # the pairwise term decides: without it the walk is each slot's argmax
    assert not np.array_equal(want, logits.argmax(-1))

    # sampled: q is softmax(scores / T) given the chosen predecessor
    key = jax.random.PRNGKey(3)
    got, _, q = dflash2.walk(
        unary,
        cand,
        jnp.asarray(proj),
        jnp.asarray(pred),
        jnp.asarray(succ),
        jnp.asarray(x_last),
        0.7,
        key,
    )
    got = np.asarray(got)
    # replay the walk with its own choices: each slot's q must be the rule's
    for i in range(b):
        prev = x_last[i]
        for s in range(t):
            c = np.argsort(-logits[i, s], kind="stable")[:k]
            scores = logits[i, s, c] + (pred[prev] * proj[i, s]) @ succ[c].T
            z = np.exp((scores - scores.max()) / 0.7)
            np.testing.assert_allclose(np.asarray(q)[i, s], z / z.sum(), rtol=1e-5, atol=1e-6)
            assert got[i, s] in c
            prev = got[i, s]


def test_grouped_conv_follows_the_rule_and_stays_in_its_block():
    rs = np.random.RandomState(1)
    b, n, length, h, taps, gs = 2, 3, 5, 8, 3, 4
    x = rs.randn(b, n * length, h).astype(np.float32)
    dyn = rs.randn(b, n * length, taps, h // gs).astype(np.float32)
    base = rs.randn(taps, h).astype(np.float32)
    got = np.asarray(dflash2.grouped_causal_conv(jnp.asarray(x), jnp.asarray(dyn), base, length))
    want = np.zeros_like(x)
    for i in range(b):
        for pos in range(n * length):
            start = pos - pos % length  # the block's first position
            for o in range(taps):
                if pos - o >= start:
                    for c in range(h):
                        want[i, pos, c] += (base[o, c] + dyn[i, pos, o, c // gs]) * x[i, pos - o, c]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_logit_rule():
    x = np.array([-300.0, -2.0, 0.0, 1.0, 50.0], np.float32)
    got = np.asarray(dflash2.adjust_logits(jnp.asarray(x), 0.5, 30.0))
    np.testing.assert_allclose(got, 30.0 * np.tanh(x * 0.5 / 30.0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dflash2.adjust_logits(jnp.asarray(x), 2.0, None)), 2 * x)


def _as_dflash2(drafter, rank=8, top_k=4, silent=True, seed=1):
    """The bundled DFlash drafter as a DFlash 2 one: its layers kept, convolutions the identity
    (base taps 1 at offset 0, no dynamic taps); the selector silent (zero codebooks: it picks
    each slot's argmax, so the drafts are the DFlash drafter's) or live (random codebooks)."""
    cfg, params = upgrade_to_dflash2(
        drafter.config,
        drafter.params,
        seed=seed,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=rank,
        selector_top_k=top_k,
    )
    zero = lambda t: jax.tree_util.tree_map(jnp.zeros_like, t)
    sel = params["candidate_selector"]
    if silent:
        params["candidate_selector"] = zero(sel)
    else:
        rs = np.random.RandomState(seed)
        for name in ("predecessor_codebook", "successor_codebook"):
            sel[name] = jnp.asarray(rs.randn(*sel[name].shape), jnp.float32)
    return dj.Drafter(cfg, params)


@pytest.fixture(scope="module")
def dflash1_run(bundled_pair):
    target, drafter, prompts = bundled_pair
    return dj.generate(target, drafter, prompts, 40, return_drafts=True)


@pytest.fixture(scope="module")
def ar_run(bundled_pair):
    target, _, prompts = bundled_pair
    return dj.generate(target, None, prompts, 40)


def test_a_dflash_drafter_upgrades_to_dflash2_keeping_what_it_computes(bundled_pair):
    """The warm start of DFlash 2 from a DFlash drafter (train.py with drafter.init_path and
    drafter.dflash2.enabled): every old parameter kept bit-exact, the convolutions the identity
    (base taps [1, 0] per channel, zero dynamic-tap projections), the selector new; and refused
    on a DFlash 2 drafter or without convolution taps."""
    _, drafter, _ = bundled_pair
    fields = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    cfg, params = upgrade_to_dflash2(drafter.config, drafter.params, **fields)
    assert cfg.dflash2 and not drafter.config.dflash2
    old = dict(jax.tree_util.tree_flatten_with_path(drafter.params)[0])
    new = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, x in old.items():
        np.testing.assert_array_equal(np.asarray(new[path]), np.asarray(x))
    added = {jax.tree_util.keystr(p) for p in set(new) - set(old)}
    assert any("candidate_selector" in k for k in added)
    for i in range(cfg.body.num_layers):
        for c in ("attention_conv", "mlp_conv"):
            conv = params[f"layers_{i}"][c]
            base = np.asarray(conv["base_kernel"])  # [2 halves, taps, H]
            np.testing.assert_array_equal(base[:, 0], 1.0)
            np.testing.assert_array_equal(base[:, 1:], 0.0)
            for leaf in jax.tree_util.tree_leaves(conv["kernel_projection"]):
                assert not np.any(np.asarray(leaf))
    with pytest.raises(ValueError, match="already DFlash 2"):
        upgrade_to_dflash2(cfg, params, **fields)
    with pytest.raises(ValueError, match="conv_kernel_size must be > 0"):
        upgrade_to_dflash2(drafter.config, drafter.params, selector_rank=8)


def test_identity_convolutions_and_a_silent_selector_draft_as_dflash(bundled_pair, dflash1_run):
    target, drafter, prompts = bundled_pair
    res = dj.generate(target, _as_dflash2(drafter), prompts, 40, return_drafts=True)
    for a, b in zip(res.drafts, dflash1_run.drafts):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("batched", (True, False))
def test_dflash2_is_lossless_and_accepted(bundled_pair, dflash1_run, ar_run, batched):
    target, drafter, prompts = bundled_pair
    d2 = _as_dflash2(drafter, silent=False)
    if batched:
        res = dj.generate(target, d2, prompts, 40, return_drafts=True)
        assert [list(x) for x in res.tokens] == [list(x) for x in ar_run.tokens]
        assert_accepted(res, 16, min_tau=1.3)
        # the live selector changes drafts
        assert any(
            not np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(res.drafts, dflash1_run.drafts)
        )
    else:
        stop = int(ar_run.tokens[1][10])
        for i, p in enumerate(prompts[:2]):
            res = dj.generate(target, d2, [p], 40, block_size=8, stop_token_ids=(stop,))
            want = dj.generate(target, None, [p], 40, stop_token_ids=(stop,))
            assert list(res.tokens[0]) == list(want.tokens[0])
        assert len(res.tokens[0]) <= 11


def _published_layout(cfg, rs):
    """Tensors of a DFlash 2 drafter named and shaped as the published files are (written
    here from the layout, not by the library): the DFlash names plus, per layer,
    {attention,mlp}_conv.base_kernel [2, taps, H] and .kernel_projection.weight
    [2 * taps * H / group, H], and candidate_selector.hidden_projection.weight [rank, H],
    .predecessor_codebook / .successor_codebook [V, rank]."""
    b = cfg.body
    h, nq, nk, d, f = b.hidden_size, b.num_heads, b.num_kv_heads, b.head_dim, b.intermediate_size
    t = {
        "fc.weight": (h, cfg.num_taps * cfg.target_hidden_size),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "candidate_selector.hidden_projection.weight": (cfg.selector_rank, h),
        "candidate_selector.predecessor_codebook": (b.vocab_size, cfg.selector_rank),
        "candidate_selector.successor_codebook": (b.vocab_size, cfg.selector_rank),
    }
    k, g = cfg.conv_kernel_size, h // cfg.conv_group_size
    for i in range(b.num_layers):
        p = f"layers.{i}."
        t.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (nq * d, h),
                p + "self_attn.k_proj.weight": (nk * d, h),
                p + "self_attn.v_proj.weight": (nk * d, h),
                p + "self_attn.o_proj.weight": (h, nq * d),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        )
        for c in ("attention_conv", "mlp_conv"):
            t[p + c + ".base_kernel"] = (2, k, h)
            t[p + c + ".kernel_projection.weight"] = (2 * k * g, h)
    return {n: rs.randn(*s).astype(np.float32) for n, s in t.items()}


def test_the_published_layout_loads_and_round_trips_bit_exact(bundled_pair, tmp_path):
    target, drafter, _ = bundled_pair
    cfg = _as_dflash2(drafter).config.replace(
        final_logit_softcapping=30.0,
        output_multiplier=0.5,
        layer_types=("sliding_attention",) * drafter.config.body.num_layers,
        sliding_window=2048,
        is_causal=False,
    )
    rs = np.random.RandomState(4)
    tensors = _published_layout(cfg, rs)
    src = tmp_path / "published"
    os.makedirs(src)
    save_file(tensors, str(src / "model.safetensors"))
    hf = cfg.to_hf(torch_dtype="float32")
    hf["dflash_config"]["final_logit_softcapping"] = 30.0
    with open(src / "config.json", "w") as f:
        json.dump(hf, f)
    d = dj.load_drafter(str(src), target=target)
    assert d.config == cfg and d.config.layer_causal == (False,) * cfg.body.num_layers
    sel = d.params["candidate_selector"]
    np.testing.assert_array_equal(
        np.asarray(sel["predecessor_codebook"]),
        tensors["candidate_selector.predecessor_codebook"],
    )
    np.testing.assert_array_equal(
        np.asarray(sel["hidden_projection"]["kernel"]),
        tensors["candidate_selector.hidden_projection.weight"].T,
    )
    np.testing.assert_array_equal(
        np.asarray(d.params["layers_1"]["mlp_conv"]["base_kernel"]),
        tensors["layers.1.mlp_conv.base_kernel"],
    )
    dj.save_drafter(d, tmp_path / "back", dtype="float32")
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(tensors)
    for name, x in tensors.items():
        np.testing.assert_array_equal(back[name], x, err_msg=name)
    written = json.load(open(tmp_path / "back" / "config.json"))
    assert written["architectures"] == ["DFlash2DraftModel"]
    assert written["dflash_config"]["selector_top_k"] == cfg.selector_top_k
    assert written["is_causal"] is False


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(selector_top_k=5000), r"selector_top_k must be an integer in \[1, 4096\]"),
        (dict(conv_group_size=24), "conv_group_size 24 does not divide the hidden size 256"),
        (dict(selector_rank=0), "selector_rank must be an integer >= 1"),
        (dict(output_multiplier=0), "output_multiplier must be a positive number"),
    ],
)
def test_bad_dflash2_configs_are_one_line(bundled_pair, tmp_path, edit, message):
    target, drafter, _ = bundled_pair
    cfg = _as_dflash2(drafter).config
    with pytest.raises(ValueError, match=message):
        cfg.replace(**edit)
    hf = cfg.to_hf()
    hf["dflash_config"].update(edit)
    os.makedirs(tmp_path / "bad")
    with open(tmp_path / "bad" / "config.json", "w") as f:
        json.dump(hf, f)
    with pytest.raises(dj.CheckpointError, match=message) as e:
        dj.load_drafter(str(tmp_path / "bad"), target=target)
    assert "\n" not in str(e.value)


def test_what_dflash2_does_not_do_yet_is_one_line(bundled_pair):
    target, drafter, prompts = bundled_pair
    d2 = _as_dflash2(drafter)
    for kw in (dict(denoise_steps=2), dict(tree_budget=16)):
        with pytest.raises(ValueError, match="not implemented for DFlash 2 drafters yet"):
            dj.generate(target, d2, prompts, 8, **kw)


def test_sampled_dflash2_runs_the_selector_and_is_accepted(bundled_pair):
    """At T > 0 the live selector samples its drafts and the verify rejection-samples against
    its q (the distribution is checked in test_sampled_lossless.py with a selector oracle):
    here the compiled path runs on the real drafter, drafts are accepted, and a seed repeats."""
    target, drafter, prompts = bundled_pair
    d2 = _as_dflash2(drafter, silent=False)
    a = dj.generate(target, d2, prompts, 24, temperature=0.7, seed=3)
    b = dj.generate(target, d2, prompts, 24, temperature=0.7, seed=3)
    assert [list(x) for x in a.tokens] == [list(x) for x in b.tokens]
    assert all(0 <= t < target.config.vocab_size for x in a.tokens for t in x)
    assert a.tau > 1.2, a.tau


def test_selector_training_terms_follow_the_rule(bundled_pair):
    """The selector's objective at a block position, stated here: candidates = the K largest
    logits; with the true previous token p, scores = logits[c] + <pred[p] * proj(h),
    succ[c]>; where the label is a candidate, the cross-entropy of softmax(scores) at it,
    else 0 (not covered); its gradient reaches the selector's parameters only."""
    _, drafter, _ = bundled_pair
    d2 = _as_dflash2(drafter, silent=False, top_k=4)
    cfg, params = d2.config, d2.params
    rs = np.random.RandomState(5)
    b, t, h, v = 2, 6, cfg.body.hidden_size, cfg.body.vocab_size
    hidden = rs.randn(b, t, h).astype(np.float32)
    logits = rs.randn(b, t, v).astype(np.float32) * 3
    top = np.argsort(-logits, axis=-1, kind="stable")[..., :4]
    labels = np.where(rs.rand(b, t) < 0.7, top[..., 2], rs.randint(0, v, (b, t)))
    prev = rs.randint(0, v, (b, t))
    dmod = dj.DFlashDrafter(cfg)

    def terms(p):
        return dmod.apply(
            {"params": p},
            jnp.asarray(hidden),
            jnp.asarray(logits),
            jnp.asarray(labels),
            jnp.asarray(prev),
            method=dj.DFlashDrafter.selector_terms,
        )

    ce, correct, covered = (np.asarray(x) for x in terms(params))
    sel = params["candidate_selector"]
    pred, succ = np.asarray(sel["predecessor_codebook"]), np.asarray(sel["successor_codebook"])
    proj = hidden @ np.asarray(sel["hidden_projection"]["kernel"])
    for i in range(b):
        for s in range(t):
            c = top[i, s]
            scores = logits[i, s, c] + (pred[prev[i, s]] * proj[i, s]) @ succ[c].T
            hit = c == labels[i, s]
            assert covered[i, s] == hit.any()
            if hit.any():
                logq = scores - scores.max() - np.log(np.exp(scores - scores.max()).sum())
                np.testing.assert_allclose(ce[i, s], -logq[hit][0], rtol=1e-4, atol=1e-5)
                assert correct[i, s] == (np.argmax(scores) == np.argmax(hit))
            else:
                assert ce[i, s] == 0 and not correct[i, s]
    g = jax.grad(lambda p: jnp.sum(terms(p)[0]))(params)
    nonzero = {
        k
        for k, x in g.items()
        if any(np.any(np.asarray(y) != 0) for y in jax.tree_util.tree_leaves(x))
    }
    assert nonzero == {"candidate_selector"}, nonzero


def test_blocked_top_k_is_the_top_k():
    rs = np.random.RandomState(9)
    x = rs.randn(3, 5, 4096).astype(np.float32)
    x[0, 0, 100:140] = 10 + rs.rand(40)  # many of the largest in one block
    for k in (1, 4, 16):
        vals, ids = dflash2.blocked_top_k(jnp.asarray(x), k)
        want = -np.sort(-x, axis=-1)[..., :k]
        np.testing.assert_array_equal(np.asarray(vals), want)
        np.testing.assert_array_equal(np.take_along_axis(x, np.asarray(ids), -1), want)
    vals, _ = dflash2.blocked_top_k(jnp.asarray(x[..., :100]), 8)  # 16 does not divide 100
    np.testing.assert_array_equal(np.asarray(vals), -np.sort(-x[..., :100], axis=-1)[..., :8])


def test_silence_selector_zeroes_the_codebooks_only(bundled_pair):
    """silence_selector (benchmarks/experiments/dflash2/silence_selector.py's rule): a live
    selector's codebooks zeroed (its walk then takes each slot's argmax), everything else kept;
    a DFlash drafter refused."""
    from dflash_jax.drafters.dflash import silence_selector

    _, drafter, _ = bundled_pair
    live = _as_dflash2(drafter, silent=False)
    quiet = dj.Drafter(live.config, silence_selector(live.params))
    sel = quiet.params["candidate_selector"]
    assert not np.any(np.asarray(sel["predecessor_codebook"]))
    assert not np.any(np.asarray(sel["successor_codebook"]))
    assert np.any(np.asarray(live.params["candidate_selector"]["successor_codebook"]))
    np.testing.assert_array_equal(
        np.asarray(sel["hidden_projection"]["kernel"]),
        np.asarray(live.params["candidate_selector"]["hidden_projection"]["kernel"]),
    )
    with pytest.raises(ValueError, match="not a DFlash 2 drafter"):
        silence_selector(drafter.params)
