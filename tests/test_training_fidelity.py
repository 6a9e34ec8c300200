"""Training fidelity to the DFlash recipe as SpecForge implements it: Hugging Face Qwen3
initialisation of new drafter weights, float32 master weights, per-sequence anchor budgets, and
the cheaper frozen-target pass of drafter training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.models.config import ModelConfig


def _target_cfg(**kw):
    base = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        qk_norm=True,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return ModelConfig(**base)


# ------------------------------------------------------------------ initialisation


def test_new_drafter_weights_are_initialised_as_hf_qwen3():
    cfg = dj.make_drafter_config(_target_cfg(), num_layers=2, num_taps=2, block_size=8)
    params = dj.init_drafter_params(cfg, seed=0)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    kernels = [
        (jax.tree_util.keystr(p), np.asarray(x, np.float64))
        for p, x in flat
        if getattr(p[-1], "key", None) == "kernel"
    ]
    scales = [np.asarray(x) for p, x in flat if getattr(p[-1], "key", None) == "scale"]
    assert len(kernels) == 1 + 2 * 7  # fc + per layer q, k, v, o, gate, up, down
    assert scales and all(np.all(s == 1.0) for s in scales)  # every RMSNorm starts at 1
    for name, k in kernels:
        # >= 32k samples each: the sample std's relative error is ~1/sqrt(2n) = 0.4%, so 2%
        # is 5 sigma (and lecun_normal's 1/sqrt(256) = 0.0625 is far outside).
        assert k.size >= 32768, name
        assert abs(k.std() / 0.02 - 1.0) < 0.02, (name, k.std())
        assert abs(k.mean()) < 0.02 * 0.02, (name, k.mean())
    # The fc projection of the concatenated taps (fan-in 512) would have std 1/sqrt(512) = 0.044
    # under Flax's default lecun_normal: the HF init does not scale with fan-in.
    fc = dict(kernels)["['fc']['kernel']"]
    assert abs(fc.std() - 0.02) < 0.001
    # Independent draws per matrix, deterministic per seed, another seed differs.
    assert not np.allclose(kernels[1][1][:8, :8], kernels[2][1][:8, :8])
    again = dj.init_drafter_params(cfg, seed=0)
    other = dj.init_drafter_params(cfg, seed=1)
    np.testing.assert_array_equal(np.asarray(again["fc"]["kernel"]), kernels[0][1])
    assert not np.allclose(np.asarray(other["fc"]["kernel"]), kernels[0][1])
    # A custom initializer_range scales the draw.
    wide = dj.init_drafter_params(cfg, seed=0, initializer_range=0.1)
    np.testing.assert_allclose(np.asarray(wide["fc"]["kernel"]), 5 * kernels[0][1], rtol=1e-5)


# ------------------------------------------------------------------ float32 master weights


def _bf16_experiment(tmp_path, param_dtype):
    from configs import tiny_test
    from dflash_jax.training import experiment

    c = tiny_test.get_config()
    c.dtype = "bfloat16"  # compute dtype; the frozen target is stored in it too
    c.drafter.param_dtype = param_dtype
    c.data.update(kind="synthetic", num_docs=40, doc_len=40)
    c.target_model.vocab_size = 64
    c.eval_num_prompts = 1
    exp = experiment.build_experiment(c, str(tmp_path / param_dtype))
    return c, exp


@pytest.mark.parametrize("param_dtype", ("float32", "bfloat16"))
def test_float32_masters_keep_a_1e4_relative_update_that_bf16_loses(tmp_path, param_dtype):
    from dflash_jax.training.step import TrainState, make_optimizer, make_train_step

    c, exp = _bf16_experiment(tmp_path, param_dtype)
    want = jnp.dtype(param_dtype)
    # Trained weights (and so the AdamW moments) in param_dtype, compute in bfloat16.
    assert exp.drafter_cfg.body.dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree_util.tree_leaves(exp.init_params)} == {want}
    assert exp.target_cfg.dtype == jnp.bfloat16  # (a loaded target is also stored in it)
    c.learning_rate, c.warmup_ratio, c.end_lr_ratio = 1e-4, 0.0, 1.0  # constant lr 1e-4
    optimizer, _ = make_optimizer(c, 10)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=exp.init_params,
        opt_state=optimizer.init(exp.init_params),
        rng=jax.random.PRNGKey(0),
    )
    moments = [
        x for x in jax.tree_util.tree_leaves(state.opt_state) if hasattr(x, "ndim") and x.ndim >= 1
    ]
    assert moments and {x.dtype for x in moments} == {want}
    batch = {k: jnp.asarray(v) for k, v in next(exp.train_iter).items()}
    step = make_train_step(exp.loss_fn, optimizer)
    new, metrics = step(state, exp.frozen, batch)  # step 0: lr 0 (warmup), moments only
    new, metrics = step(new, exp.frozen, batch)  # step 1: lr 1e-4
    assert np.isfinite(float(metrics["loss"]))
    # RMSNorm scales start at 1.0; an AdamW step moves each by at most ~lr = 1e-4 (relative
    # 1e-4), below bfloat16's resolution at 1.0 (2^-8), far above float32's (2^-23).
    before = np.asarray(exp.init_params["norm"]["scale"], np.float64)
    after = np.asarray(new.params["norm"]["scale"], np.float64)
    moved = np.abs(after - before)
    if param_dtype == "float32":
        assert new.params["norm"]["scale"].dtype == jnp.float32
        assert np.mean(moved > 1e-6) > 0.9 and moved.max() < 2e-4, moved
    else:
        assert np.all(moved == 0.0)  # every update rounded away


# ------------------------------------------------------------------ anchors (SpecForge rules)


def _eligible(loss_mask, seg, s):
    """Brute force: p <= S-2, loss_mask[p] and loss_mask[p+1], p+1 in p's document."""
    return [
        p
        for p in range(s - 1)
        if loss_mask[p] and loss_mask[p + 1] and (seg is None or seg[p] == seg[p + 1])
    ]


@pytest.fixture(scope="module")
def packed():
    rng = np.random.RandomState(7)
    b, s = 4, 48
    loss_mask = (rng.rand(b, s) < 0.8).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    seg[0, 20:] = 2
    seg[1, 8:] = 2
    seg[1, 30:] = 3
    seg[3, 40:] = 0  # padding
    loss_mask[3, 40:] = 0
    loss_mask[2, :5] = 0  # a prompt
    return loss_mask, seg


@pytest.mark.parametrize("use_seg", (False, True))
def test_anchor_budget_is_per_document_against_brute_force(packed, use_seg):
    from dflash_jax.training import masks

    loss_mask, seg = packed
    b, s = loss_mask.shape
    segn = seg if use_seg else None
    per_doc = 5
    # Row budget large enough for every document's budget: each document gets exactly
    # min(num_anchors, its eligible count), all eligible, distinct.
    a, v = masks.sample_anchors(
        jax.random.PRNGKey(0),
        jnp.asarray(loss_mask),
        per_doc,
        16,
        jnp.asarray(seg) if use_seg else None,
        anchors_per_row=40,
    )
    a, v = np.asarray(a), np.asarray(v)
    assert a.shape == (b, 40)
    for bi in range(b):
        got = a[bi][v[bi]].tolist()
        assert got == sorted(got) and len(set(got)) == len(got)
        assert not v[bi][len(got) :].any()  # valid blocks first
        elig = _eligible(loss_mask[bi], segn[bi] if use_seg else None, s)
        assert set(got) <= set(elig)
        docs = sorted(set(seg[bi][elig])) if use_seg else [None]
        for d in docs:
            e_d = [p for p in elig if d is None or seg[bi, p] == d]
            g_d = [p for p in got if d is None or seg[bi, p] == d]
            assert len(g_d) == min(per_doc, len(e_d)), (bi, d, g_d, e_d)
    if use_seg:  # row 1 has 3 documents: 3 budgets, more than one document's
        assert v[1].sum() == 3 * per_doc
    # A binding row budget: the row keeps exactly that many, each document at most its own.
    a, v = masks.sample_anchors(
        jax.random.PRNGKey(1),
        jnp.asarray(loss_mask),
        per_doc,
        16,
        jnp.asarray(seg),
        anchors_per_row=7,
    )
    a, v = np.asarray(a), np.asarray(v)
    assert a.shape == (b, 7) and v[:2].all()
    for bi in range(2):
        counts = np.bincount(seg[bi][a[bi]])
        assert counts.max() <= per_doc


def test_anchors_are_uniform_within_each_document(packed):
    from dflash_jax.training import masks

    loss_mask, seg = packed
    per_doc, trials = 3, 3000
    keys = jax.random.split(jax.random.PRNGKey(2), trials)
    sample = jax.vmap(
        lambda k: masks.sample_anchors(
            k, jnp.asarray(loss_mask[1:2]), per_doc, 16, jnp.asarray(seg[1:2]), 20
        )
    )
    a, v = (np.asarray(x)[:, 0] for x in sample(keys))
    freq = np.zeros(loss_mask.shape[1])
    for t in range(trials):
        freq[a[t][v[t]]] += 1
    freq /= trials
    elig = _eligible(loss_mask[1], seg[1], loss_mask.shape[1])
    for d in sorted(set(seg[1][elig])):
        e_d = [p for p in elig if seg[1, p] == d]
        expect = min(1.0, per_doc / len(e_d))
        # binomial std <= sqrt(0.25 / 3000) = 0.009: 0.05 is > 5 sigma
        np.testing.assert_allclose(freq[e_d], expect, atol=0.05)
    assert freq[[p for p in range(loss_mask.shape[1]) if p not in elig]].sum() == 0


def test_blocks_run_past_the_end_with_out_of_range_labels_masked():
    from dflash_jax.training import masks

    s, bs, gamma = 12, 6, 4.0
    lm = np.zeros((1, s), np.int32)
    lm[0, 8:] = 1  # eligible 8, 9, 10 (11 = S-1 has no next token)
    ids = np.arange(100, 100 + s, dtype=np.int32)[None]
    a, v = masks.sample_anchors(jax.random.PRNGKey(0), jnp.asarray(lm), 8, bs)
    a, v = np.asarray(a), np.asarray(v)
    assert a[0][v[0]].tolist() == [8, 9, 10]  # the old p <= S - bs rule allowed none
    w = np.asarray(masks.loss_weights(jnp.asarray(a), jnp.asarray(v), jnp.asarray(lm), bs, gamma))
    labels = np.asarray(masks.block_labels(jnp.asarray(ids), jnp.asarray(a), bs))
    mask = np.asarray(masks.training_mask(jnp.asarray(a), jnp.asarray(v), bs, s))
    for n, p in enumerate(a[0][v[0]]):
        for k in range(bs):
            inside = p + k < s
            want = np.exp(-(k - 1) / gamma) if (k >= 1 and inside and lm[0, p + k]) else 0.0
            np.testing.assert_allclose(w[0, n, k], want, rtol=1e-6)
            if inside:
                assert labels[0, n, k] == ids[0, p + k]  # same position, no shift
        rows = mask[0, n * bs : (n + 1) * bs, :s]
        assert (rows == (np.arange(s) < p)[None]).all()  # strictly before the anchor
    assert w[0, 2, 2:].sum() == 0 and w[0, 2, 1] > 0  # anchor 10: only x_11 is in range


# ------------------------------------------------------------------ the frozen target pass


def _small_target(num_layers=4):
    from dflash_jax.models.target import init_params

    cfg = _target_cfg(
        num_layers=num_layers,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    return cfg, init_params(cfg, seed=3)


def test_taps_only_pass_equals_the_full_forward_taps():
    from dflash_jax.models.transformer import Transformer

    cfg, params = _small_target(num_layers=5)
    tmod = Transformer(cfg)
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(0, cfg.vocab_size, (2, 37)), jnp.int32)
    seg = np.ones((2, 37), np.int32)
    seg[0, 15:] = 2
    seg[1, 30:] = 0  # padding
    for taps_at, segj in (((0, 2), jnp.asarray(seg)), ((1, 3), None), ((2,), jnp.asarray(seg))):
        _, _, full = tmod.apply({"params": params}, ids, tap_layers=taps_at, segment_ids_BT=segj)
        for chunk in (8, 64):  # 8 does not divide 37
            taps = tmod.apply(
                {"params": params},
                ids,
                taps_at,
                segment_ids_BT=segj,
                attn_chunk=chunk,
                method="taps",
            )
            np.testing.assert_allclose(np.asarray(taps), np.asarray(full), rtol=2e-5, atol=2e-5)
    # Layers above the last tap are never computed: their parameters do not matter.
    broken = jax.tree_util.tree_map(lambda x: x, params)
    broken["layers_4"] = jax.tree_util.tree_map(lambda x: x * jnp.nan, params["layers_4"])
    t1 = tmod.apply({"params": broken}, ids, (1, 3), method="taps")
    t2 = tmod.apply({"params": params}, ids, (1, 3), method="taps")
    np.testing.assert_array_equal(np.asarray(t1), np.asarray(t2))


def test_taps_only_pass_memory_grows_linearly_not_quadratically():
    from dflash_jax.models.transformer import Transformer

    cfg, params = _small_target(num_layers=2)
    tmod = Transformer(cfg)

    def temp_bytes(t, taps_only):
        def run(p, ids):
            if taps_only:  # the taps entry point: chunked causal attention
                return tmod.apply({"params": p}, ids, (0, 1), attn_chunk=128, method="taps")
            return tmod.apply({"params": p}, ids, tap_layers=(0, 1))[2]  # the dense forward

        fn = jax.jit(run)
        ids = jax.ShapeDtypeStruct((1, t), jnp.int32)
        return fn.lower(params, ids).compile().memory_analysis().temp_size_in_bytes

    small, big = temp_bytes(1024, True), temp_bytes(2048, True)
    dense_small, dense_big = temp_bytes(1024, False), temp_bytes(2048, False)
    # The dense forward holds [B, N, T, T] float32 scores (4 x 2048^2 x 4 B = 64 MiB at 2048).
    assert dense_big > 3.0 * dense_small and dense_big >= 4 * 2048 * 2048 * 4
    assert big < 2.6 * small, (small, big)
    assert big < 4 * 2048 * 2048 * 4 / 4  # far below one dense score tensor


@pytest.mark.parametrize("chunk", (0, 3))
def test_blockwise_training_attention_equals_the_dense_mask(chunk):
    from dflash_jax.training import losses, masks

    rng = np.random.RandomState(5)
    b, s, bs, nh, kh, d, n = 2, 30, 4, 4, 2, 8, 7
    q = jnp.asarray(rng.randn(b, n * bs, nh, d), jnp.float32)
    kb, vb = (jnp.asarray(rng.randn(b, n * bs, kh, d), jnp.float32) for _ in range(2))
    ck, cv = (jnp.asarray(rng.randn(b, s, kh, d), jnp.float32) for _ in range(2))
    lm = (rng.rand(b, s) < 0.8).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    seg[0, 12:] = 2
    segj = jnp.asarray(seg)
    anchors, valid = masks.sample_anchors(jax.random.PRNGKey(0), jnp.asarray(lm), n, bs, segj)
    anchors = anchors.at[1, 0].set(0)  # an anchor with no context at all
    valid = valid.at[1, 0].set(True).at[0, 3].set(False)  # and an invalid block

    def run(impl, q, kb, vb, ck, cv):
        att = losses.training_attend(anchors, valid, bs, s, segj, impl, chunk_anchors=chunk)
        return att(q, kb, vb, ck, cv)

    dense = run("xla_dense", q, kb, vb, ck, cv)
    block = run("xla", q, kb, vb, ck, cv)
    np.testing.assert_allclose(np.asarray(block), np.asarray(dense), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(block)[0, 3 * bs : 4 * bs] == 0)
    cot = jnp.asarray(rng.randn(*dense.shape), jnp.float32)
    g = [
        jax.grad(lambda *a: jnp.sum(run(impl, *a) * cot), argnums=(0, 1, 2, 3, 4))(
            q, kb, vb, ck, cv
        )
        for impl in ("xla_dense", "xla")
    ]
    for a, bb in zip(*g):
        np.testing.assert_allclose(np.asarray(bb), np.asarray(a), rtol=1e-4, atol=1e-5)
