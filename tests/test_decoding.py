"""Generation: lossless greedy and sampled speculative decoding, oracle drafts, bad input."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _pair import as_kind_method, assert_accepted, use_oracle

import dflash_jax as dj
from dflash_jax.models import sampling
from dflash_jax.decoding.programs import _Compiled, buffer_sizes, generate_programs
from dflash_jax.decoding.step import Decoder, Plan, verify_width_index, verify_widths

MIXED = [[5, 9, 2, 77, 3], list(range(20, 43)), [100], [7, 7, 7, 1, 2, 3, 4, 5, 6, 60, 61]]


@pytest.fixture(scope="module")
def target(hf_checkpoints):
    return dj.load_target(hf_checkpoints["qwen3_untied"][0])


@pytest.fixture(scope="module")
def drafter(target):
    """A random drafter, never accepted: only for the oracle tests (which replace its drafts)
    and the bad-input checks, never as the evidence of losslessness."""
    cfg = dj.make_drafter_config(
        target.config, num_layers=2, num_taps=3, block_size=16, mask_token_id=127
    )
    return dj.Drafter(cfg, dj.init_drafter_params(cfg, seed=1))


@pytest.fixture(scope="module")
def ar_out(target):
    """Autoregressive greedy continuations of MIXED on the random target (the oracle tests')."""
    return dj.generate(target, None, MIXED, max_new_tokens=40).tokens


# Losslessness with a drafter that is accepted: the bundled trained pair (conftest.py) on code
# prompts. Every such test asserts acceptance (`assert_accepted`), so that the multi-token
# commits, their cache writes and the roll-backs are what is compared with autoregressive
# decoding; with a never-accepted drafter each step commits only the target's own token.
NEW = 40


@pytest.fixture(scope="module")
def pair(bundled_pair):
    return bundled_pair


@pytest.fixture(scope="module")
def pair_ar(pair):
    """Autoregressive greedy continuations of the code prompts (the losslessness reference)."""
    target, _, prompts = pair
    return dj.generate(target, None, prompts, max_new_tokens=NEW).tokens


@pytest.fixture(scope="module")
def pair_drafts(pair):
    """DFlash at block 8 over the whole batch with its drafts recorded (shared by tests)."""
    target, drafter, prompts = pair
    return dj.generate(target, drafter, prompts, NEW, block_size=8, return_drafts=True)


def test_ar_baseline_equals_transformers_generate(hf_models64, ar_out):
    model = hf_models64["qwen3_untied"]
    for prompt, ours in zip(MIXED, ar_out):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=40,
                do_sample=False,
                min_new_tokens=40,
                pad_token_id=0,
                eos_token_id=None,
            )
        assert ref[0, len(prompt) :].tolist() == ours


@pytest.mark.parametrize("block_size", (2, 8, 16))
@pytest.mark.parametrize("batch", (1, 4))
def test_greedy_dflash_equals_autoregressive(pair, pair_ar, block_size, batch):
    """Blocks 2 / 8 / 16, one prompt and a ragged batch: the tokens are the autoregressive
    ones, and several drafts per step were accepted (at block 2 a step commits at most 2)."""
    target, drafter, prompts = pair
    res = dj.generate(target, drafter, prompts[:batch], NEW, block_size=block_size)
    assert res.tokens == pair_ar[:batch]
    assert_accepted(res, block_size, min_tau=1.3 if block_size == 2 else 1.5)
    for acc in res.acceptance_lengths:
        assert sum(acc) == NEW - 1  # the first token comes from prefill
        assert all(1 <= a <= block_size for a in acc)


def _stop_inside_accepted_run(tokens, acceptance):
    """(sequence, stop token, step, tokens that step commits up to the stop): a token that a
    step commits in the middle of a run of >= 3 accepted tokens, at its first occurrence in
    its sequence, or None."""
    for b, (seq, acc) in enumerate(zip(tokens, acceptance)):
        pos = 1  # the first token comes from prefill
        for step, a in enumerate(acc):
            for j in range(pos + 1, pos + a - 1):  # not the run's first or last token
                if seq.index(seq[j]) == j:
                    return b, seq[j], step, j - pos + 1
            pos += a
    return None


@pytest.mark.parametrize("block_size", (8, 16))
def test_stop_token_inside_an_accepted_run_truncates_like_autoregressive(pair, pair_ar, block_size):
    """A stop token committed in the middle of a multi-token accepted run ends its sequence
    there (the drafts after it are dropped) while the other sequences decode on: the tokens
    are autoregressive decoding's with the same stop token."""
    target, drafter, prompts = pair
    free = dj.generate(target, drafter, prompts, NEW, block_size=block_size)
    found = _stop_inside_accepted_run(free.tokens, free.acceptance_lengths)
    assert found is not None, free.acceptance_lengths
    b, stop, step, upto = found
    want = [seq[: seq.index(stop) + 1] if stop in seq else seq for seq in pair_ar]
    res = dj.generate(target, drafter, prompts, NEW, block_size=block_size, stop_token_ids=[stop])
    ar = dj.generate(target, None, prompts, NEW, stop_token_ids=[stop])
    assert res.tokens == want and ar.tokens == want
    # Sequence b ended at the step that accepted the run, cut at the stop token mid-run.
    assert len(res.acceptance_lengths[b]) == step + 1
    assert res.acceptance_lengths[b][-1] == upto < free.acceptance_lengths[b][step]
    assert any(len(w) == NEW for w in want)  # others ran to the end


def _forget_compiled(monkeypatch):
    """After patching a traced function, drop both our executables and JAX's trace cache."""
    monkeypatch.setattr(_Compiled, "cache", collections.OrderedDict())
    jax.clear_caches()


def test_compiled_program_cache_is_bounded_least_recently_used(monkeypatch):
    """The compiled-program cache keeps at most `max_entries` configurations and drops the
    least recently used one first (a hit refreshes an entry)."""
    monkeypatch.setattr(_Compiled, "cache", collections.OrderedDict())
    monkeypatch.setattr(_Compiled, "max_entries", 2)
    built = []

    def get(name):
        key = (None, None, Plan(block_size=4), name)
        return _Compiled.get(key, lambda: built.append(name) or name)

    assert get("a")[0] == "a" and get("b")[0] == "b"
    assert get("a")[1] == 0.0  # a hit: nothing built, "a" now the most recent
    get("c")  # evicts "b", the least recently used
    assert [k[3] for k in _Compiled.cache] == ["a", "c"]
    get("b")  # built again; evicts "a"
    assert built == ["a", "b", "c", "b"]
    assert [k[3] for k in _Compiled.cache] == ["c", "b"]


def test_plans_differing_in_decode_settings_share_one_prefill(target, drafter, monkeypatch):
    """The prefill's lowered program and the state it returns (its pytree, static fields
    included) are the same for every change of a `Plan.DECODE_ONLY` field (and differ for a
    field it reads: the control), so `generate` compiles one prefill for plans that differ only
    there: a sweep over denoise steps or confidence thresholds builds a decode loop per setting
    and shares the prefill executable. Trees share one among budgets, not the chain's: the
    target's cache is laid out for the chain's verify (`KVCache.seq_split`), and a decode loop
    compiled for one state cannot run on the other."""
    tmod, dmod = dj.Transformer(target.config), dj.DFlashDrafter(drafter.config)
    p_pad, n_buf, cap = buffer_sizes(23, 8, 8)
    args = (jnp.zeros((2, p_pad), jnp.int32), jnp.array([5, 23], jnp.int32), jnp.int32(8),
            jax.random.PRNGKey(0))  # fmt: skip

    def prefill_hlo(plan):
        prefill, _, _ = generate_programs(
            tmod, dmod, plan, cap, n_buf, None, target.params, drafter.params, 2, p_pad
        )
        lowered = prefill.lower(target.params, drafter.params, *args)
        return lowered.as_text(), jax.tree_util.tree_structure(lowered.out_info)

    base = Plan(block_size=8)
    changed = dict(
        denoise_steps=3, denoise_schedule="fixed", remask=True, confidence_threshold=0.5,
        tree_budget=6, stream=lambda commits: None, draft_sampling="argmax",
    )  # fmt: skip
    assert set(changed) == set(Plan.DECODE_ONLY)
    want = prefill_hlo(base)
    tree = Plan(block_size=8, tree_budget=12)
    for name, value in changed.items():
        plan = Plan(block_size=8, **{name: value})
        shared = tree if name == "tree_budget" else base
        assert plan != shared and plan.prefill_plan() == shared.prefill_plan(), name
        assert prefill_hlo(plan) == prefill_hlo(shared), name
    assert prefill_hlo(Plan(block_size=8, temperature=1.0))[0] != want[0]  # a field it reads
    # A tree's prefill: the same program on one device, another state (its cache not marked for
    # the chain's split), so another key.
    assert tree.prefill_plan() != base.prefill_plan()
    assert prefill_hlo(tree)[0] == want[0] and prefill_hlo(tree)[1] != want[1]

    monkeypatch.setattr(_Compiled, "cache", collections.OrderedDict())
    runs = [
        dj.generate(target, drafter, MIXED[:2], 8, block_size=8, **kw)
        for kw in ({}, {"denoise_steps": 2}, {"confidence_threshold": 0.5})
    ]
    is_prefill = lambda k: isinstance(k[-1], str)  # noqa: E731  (a whole key ends in a treedef)
    whole = [v for k, v in _Compiled.cache.items() if not is_prefill(k)]
    prefills = [v for k, v in _Compiled.cache.items() if is_prefill(k)]
    assert len(whole) == 3 and len(prefills) == 1
    assert all(built[0] is prefills[0] for built in whole)
    assert all(r.tokens == runs[0].tokens for r in runs)


def _oracle_draft(full_seqs, wrong_every):
    """A draft_block replacement reading the true greedy continuation from a table, with the
    draft at absolute positions p where p % wrong_every == 0 corrupted."""
    table = jnp.asarray(full_seqs)

    def draft(tmod, tparams, dmod, dparams, ctx, x_last, start, plan):
        bs = plan.block_size
        pos = start[:, None] + 1 + jnp.arange(bs - 1)[None]
        d = jnp.take_along_axis(table, jnp.minimum(pos, table.shape[1] - 1), axis=1)
        d = jnp.where(pos % wrong_every == 0, (d + 1) % 128, d)
        return d, jnp.ones(d.shape, jnp.float32)

    return draft


def test_oracle_drafts_commit_many_tokens_and_stay_exact(target, drafter, ar_out, monkeypatch):
    full = np.zeros((4, 128), np.int32)
    for i, (p, c) in enumerate(zip(MIXED, ar_out)):
        full[i, : len(p) + len(c)] = p + c
    use_oracle(monkeypatch, draft_block=as_kind_method(_oracle_draft(full, wrong_every=11)))
    _forget_compiled(monkeypatch)
    res = dj.generate(target, drafter, MIXED, max_new_tokens=40, block_size=8)
    assert res.tokens == ar_out
    assert res.tau > 4.0  # mostly right drafts -> many tokens per target pass
    # Different sequences accept different lengths in the same step.
    firsts = {acc[0] for acc in res.acceptance_lengths}
    assert len(firsts) > 1


def test_buffers_are_tile_multiples_and_not_doubled():
    """Cache capacity is a multiple of the decode kernels' KV tile (no per-step pad copy of a
    cache), and max_new_tokens that is a power of two gets exactly that many output slots."""
    for prompt, new, bs in ((32768, 1024, 16), (32768, 1024, 1), (4000, 256, 8), (5, 40, 16)):
        p_pad, n_buf, cap = buffer_sizes(prompt, new, bs)
        assert p_pad >= prompt and n_buf >= new and cap >= p_pad + n_buf + bs
        assert cap % (512 if cap > 512 else 128) == 0, cap
    assert buffer_sizes(32768, 1024, 16) == (32768, 1024, 34304)
    assert buffer_sizes(5, 32, 16)[1] == 32


def test_full_output_buffer_with_many_token_commits_is_exact(target, drafter, ar_out, monkeypatch):
    """max_new_tokens equal to the output buffer (32 slots), blocks of 8 committing several
    tokens up to the last slot: the tokens are the autoregressive ones."""
    full = np.zeros((4, 128), np.int32)
    for i, (p, c) in enumerate(zip(MIXED, ar_out)):
        full[i, : len(p) + len(c)] = p + c
    use_oracle(monkeypatch, draft_block=as_kind_method(_oracle_draft(full, wrong_every=13)))
    _forget_compiled(monkeypatch)
    res = dj.generate(target, drafter, MIXED, max_new_tokens=32, block_size=8)
    assert res.tokens == [c[:32] for c in ar_out]
    assert res.tau > 3.0 and max(max(a) for a in res.acceptance_lengths) >= 5


def _matching_prefix(draft, seq, pos):
    """How many of a step's drafts equal the tokens committed after position pos."""
    n = 0
    while n < len(draft) and pos + n < len(seq) and draft[n] == seq[pos + n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def pair_k4_drafts(pair):
    """Four denoising passes by confidence over the whole batch, drafts recorded."""
    target, drafter, prompts = pair
    return dj.generate(
        target, drafter, prompts, NEW, block_size=8, denoise_steps=4, return_drafts=True
    )


@pytest.mark.parametrize(
    "steps,schedule,batch",
    [(2, "confidence", 1), (4, "confidence", 4), (4, "fixed", 1), (2, "fixed", 4)],
)
def test_denoise_schedules_equal_autoregressive(
    pair, pair_ar, pair_drafts, pair_k4_drafts, steps, schedule, batch
):
    """K = 2 and 4 passes (K = 1: test_greedy_dflash_equals_autoregressive), by confidence or
    left to right, one prompt and the ragged batch: the autoregressive tokens, with the drafter
    accepted; at K = 4 the drafts differ from one pass's at the same first-step context (the
    passes do something)."""
    target, drafter, prompts = pair
    if (steps, schedule, batch) == (4, "confidence", 4):
        res = pair_k4_drafts
    else:
        res = dj.generate(
            target, drafter, prompts[:batch], NEW, block_size=8, denoise_steps=steps,
            denoise_schedule=schedule,
        )  # fmt: skip
    assert res.tokens == pair_ar[:batch]
    assert_accepted(res, 8)
    for acc in res.acceptance_lengths:
        assert sum(acc) == NEW - 1
    if res is pair_k4_drafts:
        assert all(
            len(d) == len(a) and all(len(b) == 7 for b in d)
            for d, a in zip(res.drafts, res.acceptance_lengths)
        )
        assert any(d4[0] != d1[0] for d4, d1 in zip(res.drafts, pair_drafts.drafts))


def test_remasking_changes_drafts_never_the_output(pair, pair_ar, pair_k4_drafts):
    """Remasking (K = 4): the same committed tokens as without it and as autoregressive
    decoding, the drafter accepted, and the drafts differ from the non-remasking run's at some
    step with the same context (the first step of each row), so the remasking did act."""
    target, drafter, prompts = pair
    res = dj.generate(
        target, drafter, prompts, NEW, block_size=8, denoise_steps=4, remask=True,
        return_drafts=True,
    )  # fmt: skip
    assert res.tokens == pair_ar == pair_k4_drafts.tokens
    assert_accepted(res, 8)
    assert any(r[0] != k[0] for r, k in zip(res.drafts, pair_k4_drafts.drafts))
    with pytest.raises(ValueError, match="remask needs denoise_steps >= 3"):
        dj.generate(target, drafter, prompts, NEW, block_size=8, denoise_steps=2, remask=True)
    with pytest.raises(ValueError, match="remask needs denoise_schedule='confidence'"):
        dj.generate(
            target, drafter, prompts, NEW, denoise_steps=4, remask=True, denoise_schedule="fixed"
        )
    with pytest.raises(ValueError, match="denoise_schedule must be one of"):
        dj.generate(target, drafter, prompts, NEW, denoise_steps=2, denoise_schedule="random")


def test_confidence_threshold_trims_acceptance_and_stays_lossless(pair, pair_ar, pair_drafts):
    """confidence_threshold=0.5: the tokens are the autoregressive ones; no step accepts more
    drafts than matched, and some step accepts fewer than matched (a right but low-confidence
    draft is not accepted), so tau falls below the untrimmed run's."""
    target, drafter, prompts = pair
    res = dj.generate(
        target, drafter, prompts, NEW, block_size=8, confidence_threshold=0.5, return_drafts=True
    )
    assert res.tokens == pair_ar
    trimmed = 0
    for seq, acc, drafts in zip(res.tokens, res.acceptance_lengths, res.drafts):
        pos = 1
        for a, d in zip(acc, drafts):
            matched = _matching_prefix(d, seq, pos)
            assert a - 1 <= matched
            trimmed += a - 1 < matched and pos + a < NEW
            pos += a
    assert trimmed > 0
    assert 1.0 < res.tau < pair_drafts.tau


def test_confidence_picks_a_narrower_verify_that_gives_the_same_tokens(pair):
    """Under a confidence threshold a chain step verifies the narrowest of `verify_widths`
    (4 / 8 / 16 at block 16) holding every row's trusted drafts: the drafter's confidence
    saves target compute. Each width's y equals the full verify's on its first w tokens (and
    is -1 after them, never a draft); the width follows the confidence of the most trusted
    row."""
    target, drafter, prompts = pair
    tmod, dmod = dj.Transformer(target.config), dj.DFlashDrafter(drafter.config)
    assert verify_widths(16) == (4, 8, 16)
    lens = np.array([len(p) for p in prompts], np.int32)
    p_pad, n_buf, cap = buffer_sizes(int(lens.max()), 8, 16)
    ids = np.zeros((len(prompts), p_pad), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    plan = Plan(block_size=16, confidence_threshold=0.5)
    prefill, _, _ = generate_programs(
        tmod, dmod, plan, cap, n_buf, None, target.params, drafter.params, len(prompts), p_pad
    )
    state = prefill(
        target.params, drafter.params, jnp.asarray(ids), jnp.asarray(lens), jnp.int32(8),
        jax.random.PRNGKey(0),
    )  # fmt: skip
    start = state.cache.lengths
    x_last = state.tokens[:, 0]
    decoder = Decoder(target.params, drafter.params, tmod, dmod, plan)
    prop = decoder.propose(state, x_last, start)
    key = jax.random.PRNGKey(1)
    full = decoder.replace(plan=Plan(16)).verify(state, prop, start, key)
    b = len(prompts)
    for trusted, width in ((0, 4), (3, 4), (4, 8), (7, 8), (9, 16), (15, 16)):
        conf = np.zeros((b, 15), np.float32)
        conf[1, :trusted] = 0.9  # row 1 the most trusted
        conf[0, : max(trusted - 2, 0)] = 0.9
        p = prop.replace(conf=jnp.asarray(conf))
        idx = int(verify_width_index(p.conf, 0.5, 16))
        assert verify_widths(16)[idx] == width, (trusted, idx)
        v = decoder.verify(state, p, start, key)
        y, taps = v.y, v.taps
        np.testing.assert_array_equal(np.asarray(y[:, :width]), np.asarray(full.y[:, :width]))
        assert bool(jnp.all(y[:, width:] == -1))
        np.testing.assert_allclose(taps[:, :width], full.taps[:, :width], rtol=1e-5, atol=1e-4)


def test_recorded_drafts_explain_acceptance(pair_ar, pair_drafts):
    """Each step's a-1 accepted drafts are the tokens it committed, the next draft was wrong,
    and some steps accepted several drafts (the check is not of empty prefixes)."""
    res = pair_drafts
    assert_accepted(res, 8)
    assert res.tokens == pair_ar
    for seq, acc, drafts in zip(res.tokens, res.acceptance_lengths, res.drafts):
        pos = 1  # tokens committed before this step (first one from prefill)
        for a, d in zip(acc, drafts):
            assert d[: a - 1] == seq[pos : pos + a - 1]
            if pos + a - 1 < len(seq) and a - 1 < len(d) and pos + a < NEW:
                assert d[a - 1] != seq[pos + a - 1]
            pos += a


def test_bad_input_is_rejected_before_compute(target, drafter):
    g = lambda **kw: dj.generate(
        **{"target": target, "drafter": drafter, "prompts": [[1, 2]], "max_new_tokens": 8, **kw}
    )
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        g(prompts=[[]])
    with pytest.raises(ValueError, match="outside"):
        g(prompts=[[1, 128]])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        g(max_new_tokens=600)
    with pytest.raises(ValueError, match="non-empty list"):
        g(prompts=[])
    bad = dj.Drafter(drafter.config.replace(target_layer_ids=(0, 9)), drafter.params)
    with pytest.raises(ValueError, match="target has 4 layers"):
        g(drafter=bad)
    bad = dj.Drafter(drafter.config.replace(mask_token_id=500), drafter.params)
    with pytest.raises(ValueError, match="mask_token_id 500"):
        g(drafter=bad)
    bad = dj.Drafter(
        drafter.config.replace(body=drafter.config.body.replace(vocab_size=99)), drafter.params
    )
    with pytest.raises(ValueError, match="vocabulary"):
        g(drafter=bad)
    bad = dj.Drafter(drafter.config.replace(target_hidden_size=32), drafter.params)
    with pytest.raises(ValueError, match="hidden size"):
        g(drafter=bad)


def test_greedy_argmax_equals_jnp_argmax_with_ties():
    """The vectorizable argmax picks the first maximal index, exactly like jnp.argmax, also
    among ties (small integer logits tie often) and for -inf entries."""
    rng = np.random.RandomState(0)
    x = rng.randint(-3, 4, (5, 7, 300)).astype(np.float32)
    x[0, 0] = -np.inf
    x[1, :, 17] = 50.0
    got = np.asarray(sampling.greedy_argmax(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def _sampler_z(draws, logits):
    """Largest |z| of the 40 likeliest tokens' frequencies and of the rest's total mass, and
    whether any masked (-inf) token was drawn; draws [n, rows]."""
    n, vocab = draws.shape[0], logits.shape[-1]
    worst, masked_drawn = 0.0, False
    for row in range(logits.shape[0]):
        p = np.asarray(jax.nn.softmax(jnp.asarray(logits[row])), np.float64)
        freq = np.bincount(draws[:, row], minlength=vocab) / n
        masked_drawn |= bool(np.any(freq[np.isneginf(logits[row])]))
        head = np.argsort(p)[::-1][:40]
        z = np.abs(freq[head] - p[head]) / np.sqrt(p[head] * (1 - p[head]) / n + 1e-12)
        tail = np.setdiff1d(np.arange(vocab), head)
        pt = p[tail].sum()
        z_tail = abs(freq[tail].sum() - pt) / np.sqrt(pt * (1 - pt) / n + 1e-12)
        worst = max(worst, float(z.max()), float(z_tail))
    return worst, masked_drawn


def test_inverse_transform_sampler_draws_the_distribution():
    """sample_categorical over a 4096-token vocabulary with masked (-inf) tokens, a dominant
    token and a long tail: frequencies match the softmax and masked tokens never appear; a
    slightly wrong sampler (temperature 1.1 instead of 1) fails the same check."""
    rng = np.random.RandomState(0)
    vocab = 4096
    logits = rng.randn(2, vocab).astype(np.float32)
    logits[0, :64] += 4.0  # a head of 64 likely tokens in row 0
    logits[1, 100] = 9.0  # one dominant token in row 1
    logits[:, rng.rand(vocab) < 0.3] = -np.inf
    keys = jax.random.split(jax.random.PRNGKey(1), 50_000)

    def draw(scale):
        f = jax.jit(jax.vmap(lambda k: sampling.sample_categorical(k, jnp.asarray(logits) * scale)))
        return np.asarray(f(keys))

    z, masked_drawn = _sampler_z(draw(1.0), logits)
    assert not masked_drawn
    assert z < 5.0, z
    z_bad, _ = _sampler_z(draw(1 / 1.1), logits)
    assert z_bad > 10.0, z_bad


def test_pallas_attention_path_gives_the_same_tokens(pair, pair_ar):
    """The models with the Pallas kernels (interpret mode on CPU) decode the same tokens, with
    the trained drafter accepted."""
    target, drafter, prompts = pair
    res = dj.generate(
        target, drafter, prompts[:2], 12, block_size=4, attention_impl="pallas_interpret"
    )
    assert res.tokens == [seq[:12] for seq in pair_ar[:2]]
    assert_accepted(res, 4, min_tau=1.3)


def test_pallas_cache_write_kernel_path_is_exact(target, drafter, ar_out, monkeypatch):
    """With the Pallas DMA cache-write kernel in the decode path (the TPU default,
    interpret mode on CPU) and drafts that are accepted (the oracle, wrong every 7th position),
    the tokens are the autoregressive ones and several tokens are committed per step."""
    from dflash_jax.models import attention

    full = np.zeros((4, 128), np.int32)
    for i, (p, c) in enumerate(zip(MIXED, ar_out)):
        full[i, : len(p) + len(c)] = p + c
    monkeypatch.setattr(attention, "KV_UPDATE", "pallas")
    use_oracle(monkeypatch, draft_block=as_kind_method(_oracle_draft(full[:2], wrong_every=7)))
    _forget_compiled(monkeypatch)
    res = dj.generate(
        target,
        drafter,
        MIXED[:2],
        max_new_tokens=12,
        block_size=4,
        attention_impl="pallas_interpret",
    )
    assert res.tokens == [seq[:12] for seq in ar_out[:2]]
    assert res.tau > 2.0, res.acceptance_lengths


def test_streaming_callback_delivers_the_same_tokens(pair, pair_ar):
    """The callback receives each step's commits (several tokens in accepted steps): in
    order, they are the result's tokens, the autoregressive ones."""
    target, drafter, prompts = pair
    got = [[] for _ in prompts]
    widest = [0]

    def sink(chunks):
        for b, c in enumerate(chunks):
            got[b].extend(c)
            widest[0] = max(widest[0], len(c))

    res = dj.generate(target, drafter, prompts, NEW, block_size=8, stream_callback=sink)
    assert got == res.tokens == pair_ar
    assert_accepted(res, 8)
    assert widest[0] >= 3


def test_compare_streams_warms_up_and_matches_autoregressive(pair, pair_ar):
    """`textgen.compare` (infer.py's, the notebook's): an extra streamed run, an untimed
    warm-up, then DFlash and autoregressive timed on the same prompts. The streamed tokens are
    the result's, and only the latest callback's streaming programs stay compiled."""
    from dflash_jax.frontend import textgen

    target, drafter, prompts = pair
    got = [[] for _ in prompts]

    def sink(chunks):
        for b, c in enumerate(chunks):
            got[b].extend(c)

    c = textgen.compare(
        target,
        drafter,
        prompts,
        max_new_tokens=NEW,
        block_size=8,
        stop_token_ids=(),
        stream_callback=sink,
    )
    assert got == c.spec.tokens == c.ar.tokens == pair_ar and c.identical is True
    assert_accepted(c.spec, 8)
    assert c.spec.stats["compile_s"] == c.ar.stats["compile_s"] == 0  # warmed up
    assert c.speedup > 0 and c.spec.stats["block_size"] == 8 and c.ar.stats["block_size"] == 1
    streaming = {k[2].stream for k in _Compiled.cache if k[2].stream is not None}
    assert streaming == {sink}


def test_chunked_prefill_equals_one_pass(pair, pair_ar):
    """Prefill in chunks of 8 tokens (a scan appending to the caches: linear attention
    temporaries) fills the same target and drafter caches as one pass, and decodes the same
    tokens as autoregressive greedy decoding, for DFlash and for the autoregressive loop."""
    from dflash_jax.drafters.dflash import DFlashDrafter
    from dflash_jax.models.transformer import Transformer

    target, drafter, prompts = pair
    b, p_pad, n_buf = len(prompts), 32, 64
    ids = np.zeros((b, p_pad), np.int32)
    for i, pr in enumerate(prompts):
        ids[i, : len(pr)] = pr
    lens = jnp.asarray([len(pr) for pr in prompts], jnp.int32)
    tmod, dmod = Transformer(target.config), DFlashDrafter(drafter.config)

    def prefill(chunk):
        plan = Plan(block_size=16, prefill_chunk=chunk)
        prefill_jit, _, _ = generate_programs(
            tmod,
            dmod,
            plan,
            p_pad + n_buf + 16,
            n_buf,
            None,
            target.params,
            drafter.params,
            b,
            p_pad,
        )
        return prefill_jit(
            target.params,
            drafter.params,
            jnp.asarray(ids),
            lens,
            jnp.asarray(40, jnp.int32),
            jax.random.PRNGKey(0),
        )

    states = [prefill(c) for c in (0, 8)]
    one, chunked = states
    assert one.tokens[:, 0].tolist() == chunked.tokens[:, 0].tolist()
    for x, y in zip(
        jax.tree_util.tree_leaves((one.cache, one.ctx)),
        jax.tree_util.tree_leaves((chunked.cache, chunked.ctx)),
    ):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(one.cache.k[0]).max()) > 0  # the comparison is not of empty caches
    res = dj.generate(target, drafter, prompts, NEW, prefill_chunk=8)
    assert res.tokens == pair_ar
    assert_accepted(res, 16)
    assert dj.generate(target, None, prompts, NEW, prefill_chunk=8).tokens == pair_ar
