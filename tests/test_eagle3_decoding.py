"""EAGLE-3 drafting in the compiled decode loop (`drafters.eagle3.Eagle3Kind`): greedy decoding
equals autoregressive decoding token for token with an accepted drafter (an oracle step: the
target's own continuation of the block) and with the real (random-weight) drafter module;
sampled decoding reproducible with accepted drafts; the context rows against a direct
statement of the row pairing; what EAGLE-3 does not do refused in one line."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pair import assert_accepted

import dflash_jax as dj
from dflash_jax.decoding.programs import _Compiled
from dflash_jax.drafters import eagle3 as e3

TAPS = (1, 3, 4)  # the bundled target has 6 layers (the default taps would repeat one)
N_NEW = 40


def _drafter(target, draft_vocab=None, seed=0, permute=False):
    """A random-weight EAGLE-3 drafter for `target`: its draft vocabulary the first
    `draft_vocab` ids of a random order of the target's (None: all, in order unless
    `permute`), so d2t is not the identity."""
    v = target.config.vocab_size
    cfg = e3.make_eagle3_config(target.config, draft_vocab_size=draft_vocab, target_layer_ids=TAPS)
    vd = cfg.draft_vocab_size
    rs = np.random.RandomState(seed)
    if draft_vocab is None and not permute:
        ids = np.arange(v)
    else:
        ids = rs.permutation(v)[:vd]
        if draft_vocab is not None:
            ids = np.sort(ids)
    d2t = (ids - np.arange(vd)).astype(np.int32)
    return dj.Eagle3(config=cfg, params=e3.init_eagle3_params(cfg, seed=seed), d2t=d2t)


def _oracle_step(self, dec, state, cache, feature, token, position, chain, i):
    """`Eagle3.draft_step` replaced by the target's own next-token logits after the committed
    context and the block so far (x_last and the drafts before step i), except after a token
    divisible by 3, where its top choice is struck out: right most of the time, not always
    (ragged acceptance). Its logits are the target's at the draft vocabulary's target ids."""
    hidden, _, _ = dec.tmod.apply({"params": dec.tparams}, chain, cache=state.cache)
    logits = jnp.take(dec.lm_logits(hidden), i - 1, axis=1)  # [B, V]: after chain[:, :i]
    top = jnp.argmax(logits, axis=-1)
    struck = logits.at[jnp.arange(logits.shape[0]), top].set(-1e9)
    logits = jnp.where((token % 3 == 0)[:, None], struck, logits)
    d2t = dec.dparams["vocab"]["d2t"]
    targets = jnp.arange(d2t.shape[0], dtype=jnp.int32) + d2t
    return feature, logits[:, targets], cache


@pytest.fixture
def oracle(monkeypatch):
    monkeypatch.setattr(e3.Eagle3Kind, "draft_step", _oracle_step)
    monkeypatch.setattr(_Compiled, "cache", collections.OrderedDict())
    jax.clear_caches()


@pytest.fixture(scope="module")
def ar(bundled_pair):
    target, _, prompts = bundled_pair
    return dj.generate(target, None, prompts, N_NEW).tokens


def test_context_rows_follow_the_pairing(bundled_pair):
    """Prefill in chunks then a commit of ragged lengths write, at each position p < L - 1,
    the K/V of (fc(taps at p), embedding of the token at p + 1), and keep fc(taps at L - 1)
    pending: against the rows computed directly from the whole sequence."""
    target, _, _ = bundled_pair
    drafter = _drafter(target, draft_vocab=512)
    mod, variables = drafter.module, drafter.variables
    rs = np.random.RandomState(1)
    b, p, cap = 2, 12, 24
    ids = jnp.asarray(rs.randint(0, target.config.vocab_size, size=(b, p)), jnp.int32)
    tmod = dj.Transformer(target.config)
    _, _, taps = jax.jit(lambda t, x: tmod.apply({"params": t}, x, tap_layers=TAPS))(
        target.params, ids
    )
    dec = drafting_decoder(target, drafter)
    kind = e3.KIND
    write = jax.jit(kind.write_context)
    ctx = kind.init_context(dec, b, cap)
    plens = jnp.asarray([4, 6], jnp.int32)
    for s in (0, 4):  # a prompt prefilled in two chunks of 4 (the second past prompt 0's end)
        ctx = write(
            dec,
            ctx,
            taps[:, s : s + 4],
            ids[:, s : s + 4],
            s + jnp.broadcast_to(jnp.arange(4), (b, 4)),
            plens,
            jnp.full((b,), s, jnp.int32),
        )
    # a commit of n = 3 and 5 positions from each prompt's end (width 5, ragged)
    n = jnp.asarray([3, 5], jnp.int32)
    start = plens
    idx = start[:, None] + jnp.arange(5)[None]
    ctx = write(
        dec,
        ctx,
        jnp.take_along_axis(taps, idx[..., None], axis=1),
        jnp.take_along_axis(ids, idx, axis=1),
        idx,
        start + n,
        start,
    )
    fused = mod.apply(variables, taps, method=e3.Eagle3Drafter.fuse)
    emb = tmod.apply({"params": target.params}, ids, method=dj.Transformer.embed)
    k, v = mod.apply(
        variables,
        emb[:, 1:],
        fused[:, :-1],
        jnp.broadcast_to(jnp.arange(p - 1), (b, p - 1)),
        method=e3.Eagle3Drafter.row_kv,
    )
    length = np.asarray(start + n)
    assert np.asarray(ctx.cache.lengths).tolist() == (length - 1).tolist()
    for i in range(b):
        rows = length[i] - 1
        got_k = np.asarray(ctx.cache.k[0][i, :rows])
        np.testing.assert_allclose(
            got_k, np.asarray(k[i, :rows]).reshape(rows, -1), rtol=1e-4, atol=1e-4
        )
        got_v = np.asarray(ctx.cache.v[0][i, :rows])
        np.testing.assert_allclose(
            got_v, np.asarray(v[i, :rows]).reshape(rows, -1), rtol=1e-4, atol=1e-4
        )
        np.testing.assert_allclose(
            np.asarray(ctx.pending[i]), np.asarray(fused[i, length[i] - 1]), rtol=1e-4, atol=1e-4
        )


def drafting_decoder(target, drafter, **plan):
    from dflash_jax.decoding.step import Decoder, Plan

    return Decoder(
        target.params,
        drafter.decode_params,
        dj.Transformer(target.config),
        drafter.module,
        Plan(block_size=plan.pop("block_size", 6), **plan),
    )


def test_greedy_eagle3_with_an_accepted_drafter_is_lossless(bundled_pair, ar, oracle):
    """Greedy EAGLE-3 decoding (the oracle step, a permuted draft vocabulary) equals
    autoregressive decoding: the batch (drafts accepted), one prompt with a stop token."""
    target, _, prompts = bundled_pair
    drafter = _drafter(target, permute=True)
    res = dj.generate(target, drafter, prompts, N_NEW, block_size=6)
    assert res.tokens == ar
    assert_accepted(res, 6)
    # One prompt, stopping at a token it emits: greedy decoding cut after its first stop.
    stop = ar[0][20]
    one = dj.generate(target, drafter, prompts[:1], N_NEW, block_size=6, stop_token_ids=[stop])
    assert one.tokens == [ar[0][: ar[0].index(stop) + 1]]


def test_sampled_eagle3_with_an_accepted_drafter(bundled_pair, oracle):
    """T > 0: drafts sampled from the drafter's distribution and verified against it
    (rejection sampling): the seeded run repeats itself and drafts are accepted."""
    target, _, prompts = bundled_pair
    drafter = _drafter(target, permute=True)
    kw = dict(block_size=6, temperature=0.5, seed=3)
    a = dj.generate(target, drafter, prompts, N_NEW, **kw)
    b = dj.generate(target, drafter, prompts, N_NEW, **kw)
    assert a.tokens == b.tokens
    assert a.tau > 1.3, a.tau
    assert max(max(x) for x in a.acceptance_lengths if x) >= 3


def test_real_eagle3_module_is_lossless(bundled_pair, ar):
    """The real drafter module (random weights, a reduced draft vocabulary) through the
    compiled loop: greedy equals autoregressive decoding; a sampled run completes."""
    target, _, prompts = bundled_pair
    drafter = _drafter(target, draft_vocab=1024)
    res = dj.generate(target, drafter, prompts, N_NEW, block_size=4, prefill_chunk=8)
    assert res.tokens == ar
    s = dj.generate(target, drafter, prompts, 16, block_size=4, temperature=0.7, seed=1)
    assert [len(t) for t in s.tokens] == [16] * len(prompts)


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(tree_budget=8), "tree_budget"),
        (dict(denoise_steps=2), "denoise_steps"),
        (dict(remask=True, denoise_steps=3), "denoise_steps"),
    ],
)
def test_what_eagle3_does_not_do_is_one_line(bundled_pair, kw, name):
    target, _, prompts = bundled_pair
    with pytest.raises(ValueError) as e:
        dj.generate(target, _drafter(target, draft_vocab=64), prompts, 8, **kw)
    msg = str(e.value)
    assert f"{name} is not implemented for EAGLE-3" in msg and "\n" not in msg


def test_eagle3_block_size_range(bundled_pair):
    target, _, prompts = bundled_pair
    with pytest.raises(ValueError, match=r"block_size must be in \[2, 64\]"):
        dj.generate(target, _drafter(target, draft_vocab=64), prompts, 8, block_size=1)


def test_saved_eagle3_with_its_own_embedding_drafts_the_same(bundled_pair, ar, tmp_path):
    """`dj.save_eagle3` / `dj.load_eagle3` round trip with the file's own embed_tokens (here a
    copy of the target's): the decode loop reads that table, so the drafts equal those of the
    drafter that shares the target's, the tokens autoregressive decoding's."""
    target, _, prompts = bundled_pair
    shared = _drafter(target, draft_vocab=1024)
    own = dj.Eagle3(
        config=shared.config,
        params=shared.params,
        d2t=shared.d2t,
        embedding=target.params["embed_tokens"]["embedding"],
    )
    dj.save_eagle3(own, str(tmp_path / "eagle3"), dtype="float32")
    loaded = dj.load_eagle3(str(tmp_path / "eagle3"), target=target)
    assert loaded.embedding is not None and "embedding" in loaded.decode_params
    kw = dict(block_size=4, return_drafts=True)
    a = dj.generate(target, shared, prompts[:2], 16, **kw)
    b = dj.generate(target, loaded, prompts[:2], 16, **kw)
    assert a.tokens == b.tokens == [t[:16] for t in ar[:2]]
    assert a.drafts == b.drafts
    # (A random drafter's drafts hardly depend on the embedding: its rows read, directly.)
    rolled = dataclasses.replace(loaded, embedding=jnp.roll(loaded.embedding, 1, axis=0))
    ids = jnp.asarray([[5, 17]], jnp.int32)
    got = e3.KIND.embed(drafting_decoder(target, rolled), ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rolled.embedding)[[[5, 17]]])


def test_proposal_equals_the_rows_computed_at_once(bundled_pair):
    """After a (chunked) prefill of ragged prompts, `Eagle3.propose`'s drafts and their
    probabilities (its cache, the
    pending row, the steps' slots and lengths) equal the drafter run from scratch over all
    rows at once, causally: rows p < P-1 (fc(taps at p), embedding of prompt[p+1]), row P-1
    (fc(taps at P-1), embedding of x_last), then each draft's row (the row before's output,
    embedding of the draft)."""
    from dflash_jax.decoding.step import Decoder, Plan

    target, _, prompts = bundled_pair
    drafter = _drafter(target, draft_vocab=1024, seed=2)
    # larger weights than a new drafter's: drafts that depend on the rows' embeddings
    params = jax.tree_util.tree_map(lambda x: x * 8.0 if x.ndim == 2 else x, drafter.params)
    drafter = dataclasses.replace(drafter, params=params)
    bs, cap = 5, 64
    tmod = dj.Transformer(target.config)
    dec = Decoder(
        target.params, drafter.decode_params, tmod, drafter.module, Plan(bs, prefill_chunk=8)
    )
    ps = [prompts[0], prompts[3]]
    lens = np.array([len(p) for p in ps], np.int32)
    ids = np.zeros((2, 16 * -(-lens.max() // 16)), np.int32)
    for i, p in enumerate(ps):
        ids[i, : len(p)] = p

    def run(dec, ids, lens):
        state = dec.prefill(cap, 8, ids, lens, jnp.int32(8), jax.random.PRNGKey(0))
        x_last = state.tokens[:, 0]
        return x_last, dec.propose(state, x_last, state.cache.lengths)

    x_last, prop = jax.jit(run)(dec, jnp.asarray(ids), jnp.asarray(lens))
    mod, variables = drafter.module, drafter.variables
    kd = drafter.config.body.num_kv_heads * drafter.config.body.head_dim
    empty = jnp.zeros((1, 1, kd), jnp.float32)
    for i, p in enumerate(ps):
        seq = jnp.asarray([p], jnp.int32)
        _, _, taps = tmod.apply({"params": target.params}, seq, tap_layers=TAPS)
        feats = mod.apply(variables, taps, method=e3.Eagle3Drafter.fuse)  # [1, P, H]
        toks = list(p[1:]) + [int(x_last[i])]
        drafts, confs = [], []
        for _ in range(bs - 1):
            emb = tmod.apply(
                {"params": target.params},
                jnp.asarray([toks], jnp.int32),
                method=dj.Transformer.embed,
            )
            positions = jnp.arange(len(toks), dtype=jnp.int32)[None]
            hidden, logits, _, _ = mod.apply(
                variables,
                emb,
                feats,
                positions,
                empty,
                empty,
                jnp.zeros((1,), jnp.int32),
                method=e3.Eagle3Drafter.step,
            )
            d = int(jnp.argmax(logits[0, -1]))
            confs.append(float(jax.nn.softmax(logits[0, -1])[d]))
            d = int(d + drafter.d2t[d])
            drafts.append(d)
            toks.append(d)
            feats = jnp.concatenate([feats, hidden[:, -1:]], axis=1)
        assert np.asarray(prop.drafts[i]).tolist() == drafts, i
        np.testing.assert_allclose(np.asarray(prop.conf[i]), confs, rtol=1e-4, atol=1e-6)


def test_infer_takes_an_eagle3_directory(bundled_pair, tmp_path):
    """The batch runner (infer.py) tells an EAGLE-3 directory by its config.json, checks it
    from the config alone (refusing what generate refuses) and runs it: greedy output equal
    to autoregressive decoding."""
    import os

    from _pair import PAIR

    from dflash_jax.drafters import registry
    from dflash_jax.frontend import infer_run

    target, _, prompts = bundled_pair
    out = tmp_path / "eagle3"
    dj.save_eagle3(_drafter(target, draft_vocab=64), str(out))
    target_dir = os.path.join(PAIR, "target")
    assert registry.for_spec(str(out)) is e3.KIND
    assert registry.for_spec(os.path.join(PAIR, "drafter")).name == "dflash"
    infer_run.check_before_loading(target_dir, str(out), prompts, dict(max_new_tokens=8))
    with pytest.raises(ValueError, match="tree_budget is not implemented for EAGLE-3"):
        infer_run.check_before_loading(
            target_dir, str(out), prompts, dict(max_new_tokens=8, tree_budget=4)
        )
    report = infer_run.run_and_report(
        target_dir, str(out), [{"prompt": "def f(x):"}], max_new_tokens=16, compare_ar=True,
        stream=False,
    )  # fmt: skip
    assert report.totals["identical_to_ar"] is True
