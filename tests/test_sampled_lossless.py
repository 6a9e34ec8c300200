"""Sampled speculative decoding is lossless: the joint distribution of the first tokens that
`generate` samples, with drafts that are really accepted, equals the exact one, computed by
enumeration with the independent NumPy reference of the sampling rules
(`_sampling_reference.reference`: no dflash_jax sampling code), for temperature, top-k, top-p
and top-k with top-p; for chain and for tree decoding (a 3-node tree of the oracle's top tokens).

- a 6-token target; its logits for every continuation come from `Target.forward` (the model,
  not the sampler); the greedy oracle drafter is accepted (tau > 1.3 asserted);
- no sample lies outside the reference's support, and the total variation (TV) between the
  empirical and the exact joint is below a bound derived from the sample size (`tv_bound`);
- controls: the same bound rejects a wrong rule in the implementation (every draft accepted; a
  tree walk that ignores the target's sample;
  the temperature ignored; top-k one wider; the nucleus one token wider), each one a
  monkeypatch of the sampling or acceptance code that `generate` compiles: the test can fail;
- and the bound separates each case's exact joint from its neighbours' (another temperature,
  k one wider, top-k or top-p left out, the nucleus one wider): a sampler that followed a
  neighbouring rule would fail.
"""

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pair import as_kind_method, use_oracle
from _sampling_reference import reference

import dflash_jax as dj
from dflash_jax.models.target import init_params
from dflash_jax.models import sampling
from dflash_jax.decoding import step as step_lib
from dflash_jax.decoding.programs import _Compiled
from dflash_jax.decoding.step import Decoder, Plan

V = 6  # vocabulary
PROMPT = [1, 4, 2]
N_TOKENS = 3  # tokens generated per sample: V ** 3 = 216 sequences enumerated
BLOCK = 2  # one draft: with the first token from prefill, a step commits at most the other 2
N = 8_000  # samples per case: one batch of generate (one compile per rule setting)
DELTA = 1e-6  # the probability that an exact sampler exceeds the bound


def _sharp_target(num_layers):
    """A 6-token target of `num_layers` layers with a sharp-ish distribution."""
    cfg = dj.ModelConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=64,
    )
    # Initialized under jit: one compile, not a dispatch per op (seconds less).
    params = jax.jit(
        lambda: jax.tree_util.tree_map(
            lambda x: x * 6.0 if x.ndim == 2 else x, init_params(cfg, seed=3)
        )
    )()
    return dj.Target(cfg, params)


@pytest.fixture(scope="module")
def tiny():
    """A 6-token target with a sharp-ish distribution, and a drafter (replaced by the oracle)."""
    t = _sharp_target(2)
    dcfg = dj.make_drafter_config(
        t.config, num_layers=1, num_taps=1, block_size=BLOCK, mask_token_id=0
    )
    return t, dj.Drafter(dcfg, jax.jit(lambda: dj.init_drafter_params(dcfg, 0))())


def _enumerate(t, prompt):
    """Every continuation of N_TOKENS tokens [M, N_TOKENS] (M = V ** N_TOKENS, in the order of
    np.ravel_multi_index) and the target's logits before each of its tokens [M, N_TOKENS, V]."""
    seqs = np.indices((V,) * N_TOKENS).reshape(N_TOKENS, -1).T
    ids = np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1)
    logits = np.asarray(t.forward(ids).logits, np.float64)[:, len(prompt) - 1 : -1]
    return seqs, logits


@pytest.fixture(scope="module")
def enumerated(tiny):
    return _enumerate(tiny[0], PROMPT)


def exact_joint(enumerated, temperature, top_k=None, top_p=None, widen=0):
    """[M] probability of each continuation: the product of the reference's probabilities of
    its tokens given the prompt and the tokens before."""
    seqs, logits = enumerated
    probs = np.ones(len(seqs))
    for m, seq in enumerate(seqs):
        for i, tok in enumerate(seq):
            probs[m] *= reference(logits[m, i], temperature, top_k, top_p, widen)[tok]
    return probs


def expected_tv(probs, n):
    """E TV(empirical of n exact samples, probs), exactly: TV = 1/2 sum_i |X_i / n - p_i| with
    each count X_i ~ Binomial(n, p_i) alone, so E TV = 1/(2n) sum_i E|X_i - n p_i|, and de
    Moivre's mean absolute deviation E|X - n p| = 2 (j + 1) C(n, j + 1) p^(j + 1) (1 - p)^(n - j),
    j = floor(n p) (in logs: lgamma)."""
    total = 0.0
    for p in probs:
        if 0.0 < p < 1.0:
            j = math.floor(n * p)
            log_term = (
                math.lgamma(n + 1)
                - math.lgamma(j + 2)
                - math.lgamma(n - j)
                + (j + 1) * math.log(p)
                + (n - j) * math.log1p(-p)
            )
            total += 2 * (j + 1) * math.exp(log_term)
    return total / (2 * n)


def tv_bound(probs, n):
    """E TV + sqrt(ln(1 / DELTA) / (2 n)). Moving one of n samples to another cell changes the
    TV by at most 1 / n, so by McDiarmid's inequality P(TV >= E TV + eps) <= exp(-2 n eps^2):
    an exact sampler exceeds this bound with probability at most DELTA (whatever the cells)."""
    return expected_tv(probs, n) + math.sqrt(math.log(1 / DELTA) / (2 * n))


def _forget_compiled(monkeypatch):
    """After patching a traced function, drop both our executables and JAX's trace cache."""
    monkeypatch.setattr(_Compiled, "cache", collections.OrderedDict())
    jax.clear_caches()


def _greedy_oracle(tmod, tparams, dmod, dparams, ctx, x_last, start, plan):
    """Drafts the target's greedy continuation of x_last alone (right often, not always)."""
    toks = [x_last]
    for _ in range(plan.block_size - 1):
        h, _, _ = tmod.apply({"params": tparams}, jnp.stack(toks, 1))
        lg = tmod.apply({"params": tparams}, h[:, -1:], method=dj.Transformer.logits)
        toks.append(jnp.argmax(lg[:, 0], -1).astype(jnp.int32))
    d = jnp.stack(toks[1:], 1)
    return d, jnp.ones(d.shape, jnp.float32)


def _tree_oracle(tmod, tparams, dmod, dparams, ctx, x_last, start, plan):
    """A draft tree's log-probabilities: the target's distribution after x_last alone, at
    every block position (its top tokens are right often, not always)."""
    h, _, _ = tmod.apply({"params": tparams}, x_last[:, None])
    lg = tmod.apply({"params": tparams}, h, method=dj.Transformer.logits)
    shape = (x_last.shape[0], plan.block_size - 1, lg.shape[-1])
    return jnp.broadcast_to(jax.nn.log_softmax(lg, axis=-1), shape)


def _denoising_oracle(tmod, tparams, dmod, dparams, ctx, x_last, tokens, start, plan):
    """One drafter pass (`DFlashKind.draft_logits`) that denoising passes improve: position i's logits
    are the target's after x_last and the block's tokens before i, where each still-masked one
    is guessed as the target's second choice (wrong): a fixed token makes the later ones right."""
    seq, out = [x_last], []
    for i in range(plan.block_size - 1):
        h, _, _ = tmod.apply({"params": tparams}, jnp.stack(seq, 1))
        lg = tmod.apply({"params": tparams}, h[:, -1:], method=dj.Transformer.logits)[:, 0]
        out.append(lg)
        second = jnp.argsort(lg, axis=-1)[:, -2].astype(jnp.int32)
        seq.append(jnp.where(tokens[:, i] == dmod.cfg.mask_token_id, second, tokens[:, i]))
    return jnp.stack(out, 1)


def sample(
    tiny,
    monkeypatch,
    temperature,
    top_k=None,
    top_p=None,
    tree_budget=None,
    oracle=_greedy_oracle,
    **denoise,
):
    """N speculative samples of N_TOKENS tokens after PROMPT with the oracle drafter (chain) or
    the oracle's tree of `tree_budget` nodes: (counts [M] of each continuation, tau). With
    `denoise` (generate's block_size, denoise_steps, denoise_schedule, remask) the chain is
    drafted by the real K-pass `DFlashKind.denoise` over `_denoising_oracle` passes."""
    t, drafter = tiny
    if denoise:
        use_oracle(monkeypatch, draft_logits=as_kind_method(_denoising_oracle))
        cfg = drafter.config.replace(block_size=denoise["block_size"])
        drafter = dj.Drafter(cfg, drafter.params)
    else:
        use_oracle(
            monkeypatch,
            draft_block=as_kind_method(oracle),
            draft_logprobs=as_kind_method(_tree_oracle),
        )
    _forget_compiled(monkeypatch)
    res = dj.generate(
        t,
        drafter,
        [PROMPT] * N,
        max_new_tokens=N_TOKENS,
        **({"block_size": BLOCK} | denoise),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=7,
        tree_budget=tree_budget,
        draft_sampling="argmax",  # the oracles draft deterministically: one-hot proposals
    )
    tokens = np.asarray(res.tokens)
    assert tokens.shape == (N, N_TOKENS)
    cells = np.ravel_multi_index(tokens.T, (V,) * N_TOKENS)
    return np.bincount(cells, minlength=V**N_TOKENS), res.tau


def tv(counts, probs):
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


# (temperature, top_k, top_p). Every rule binds: each case's exact joint is far (in TV) from its
# neighbours' (NEIGHBOURS: top-k 3 with top-p 0.9 at temperature 1.2 differs both from its
# top-k alone and from its top-p alone), and no filter decision is near a tie
# (test_no_filter_decision_is_a_near_tie).
CASES = {
    "temperature_1": (1.0, None, None),
    "temperature_0.7_top_k_2": (0.7, 2, None),
    "top_p_0.85": (1.0, None, 0.85),
    "temperature_1.2_top_k_3_top_p_0.9": (1.2, 3, 0.9),
}

# Each case's neighbouring rules, (temperature, top_k, top_p, widen) for `reference`.
NEIGHBOURS = {
    "temperature_1": [(1.3, None, None, 0)],
    "temperature_0.7_top_k_2": [(1.0, 2, None, 0), (0.7, 3, None, 0)],
    "top_p_0.85": [(1.0, None, 0.85, 1)],
    "temperature_1.2_top_k_3_top_p_0.9": [(1.2, 3, None, 0), (1.2, None, 0.9, 0), (1.2, 3, 0.9, 1)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_samples_follow_the_exact_joint(case, tiny, enumerated, monkeypatch):
    temperature, top_k, top_p = CASES[case]
    counts, tau = sample(tiny, monkeypatch, temperature, top_k, top_p)
    assert tau > 1.3, tau  # the oracle's drafts are really being accepted
    exact = exact_joint(enumerated, temperature, top_k, top_p)
    outside = np.flatnonzero((counts > 0) & (exact == 0))
    assert outside.size == 0, enumerated[0][outside]
    bound = tv_bound(exact, N)
    assert tv(counts, exact) < bound, (tv(counts, exact), bound)
    for rule in NEIGHBOURS[case]:
        wrong = exact_joint(enumerated, *rule)
        assert tv(counts, wrong) > tv_bound(wrong, N), (rule, tv(counts, wrong))


@pytest.mark.parametrize("case", ["temperature_1.2_top_k_3_top_p_0.9"])
def test_tree_samples_follow_the_exact_joint(case, tiny, enumerated, monkeypatch):
    """The same for tree decoding (3 children of the root: the walk follows whichever child
    the target's fresh sample names, so steps commit a child and its bonus token)."""
    temperature, top_k, top_p = CASES[case]
    counts, tau = sample(tiny, monkeypatch, temperature, top_k, top_p, tree_budget=3)
    assert tau > 1.3, tau
    exact = exact_joint(enumerated, temperature, top_k, top_p)
    assert np.flatnonzero((counts > 0) & (exact == 0)).size == 0
    assert tv(counts, exact) < tv_bound(exact, N), (tv(counts, exact), tv_bound(exact, N))
    for rule in NEIGHBOURS[case]:
        wrong = exact_joint(enumerated, *rule)
        assert tv(counts, wrong) > tv_bound(wrong, N), (rule, tv(counts, wrong))


def test_denoised_drafts_samples_follow_the_exact_joint(tiny, enumerated, monkeypatch):
    """The same with drafts from three denoising passes with remasking (block 4: 3 drafts, one
    position fixed per pass): the passes change the drafts (checked on the drafter alone, every
    x_last), the drafts are accepted, and the samples follow the exact joint."""
    case = "temperature_1.2_top_k_3_top_p_0.9"
    t, drafter = tiny
    use_oracle(monkeypatch, draft_logits=as_kind_method(_denoising_oracle))
    dmod = dj.DFlashDrafter(drafter.config.replace(block_size=4))
    x_last = jnp.arange(V, dtype=jnp.int32)
    tmod, start = dj.Transformer(t.config), jnp.zeros((V,), jnp.int32)
    drafts = {}
    for k in (1, 3):
        dec = Decoder(
            t.params, None, tmod, dmod, Plan(block_size=4, denoise_steps=k, remask=k == 3)
        )
        drafts[k] = np.asarray(dec.kind.draft_block(dec, None, x_last, start)[0])
    assert (drafts[1] != drafts[3]).any()
    temperature, top_k, top_p = CASES[case]
    counts, tau = sample(
        tiny, monkeypatch, temperature, top_k, top_p, block_size=4, denoise_steps=3, remask=True
    )
    assert tau > 1.3, tau
    exact = exact_joint(enumerated, temperature, top_k, top_p)
    assert np.flatnonzero((counts > 0) & (exact == 0)).size == 0
    assert tv(counts, exact) < tv_bound(exact, N), (tv(counts, exact), tv_bound(exact, N))
    for rule in NEIGHBOURS[case]:
        wrong = exact_joint(enumerated, *rule)
        assert tv(counts, wrong) > tv_bound(wrong, N), (rule, tv(counts, wrong))


def test_the_bound_holds_for_simulated_exact_samplers(enumerated):
    """The derivation checked: 2000 simulated exact samplers (multinomial draws of N from the
    unfiltered exact joint, NumPy) have a mean TV within 4 standard errors of `expected_tv`,
    and none exceeds `tv_bound`."""
    exact = exact_joint(enumerated, 1.0)
    draws = np.random.default_rng(0).multinomial(N, exact, size=2000)
    tvs = 0.5 * np.abs(draws / N - exact).sum(axis=1)
    se = tvs.std() / np.sqrt(len(tvs))
    assert abs(tvs.mean() - expected_tv(exact, N)) < 4 * se, (tvs.mean(), expected_tv(exact, N))
    assert tvs.max() < tv_bound(exact, N)


def test_no_filter_decision_is_a_near_tie(enumerated):
    """In every row of `enumerated` (reached or not) the k-th and (k+1)-th largest logits / T
    differ by more than 1e-3, and the mass before each token (renormalized over the top-k) is
    more than 1e-3 away from top_p: far above float32 rounding, so the generate path's logits
    (not bitwise those of `Target.forward`) filter the same tokens as the reference's."""
    rows = enumerated[1].reshape(-1, V)
    for temperature, top_k, top_p in CASES.values():
        x = -np.sort(-rows / temperature, axis=-1)
        if top_k is not None:
            assert np.min(x[:, top_k - 1] - x[:, top_k]) > 1e-3, (temperature, top_k)
        if top_p is not None:
            x = x[:, :top_k] if top_k is not None else x
            p = np.exp(x - x[:, :1])
            p /= p.sum(-1, keepdims=True)
            before = np.cumsum(p, axis=-1) - p
            assert np.min(np.abs(before - top_p)) > 1e-3, (temperature, top_k, top_p)


def _accept_every_draft(monkeypatch):
    monkeypatch.setattr(
        step_lib, "accepted_prefix", lambda d, y, trusted=None: jnp.full(d.shape[:1], d.shape[1])
    )


def _pick_tokens_with(monkeypatch, change):
    """generate's sampler called with changed (temperature, top_k, top_p)."""

    def wrong(logits, key, temperature, top_k=None, top_p=None):
        return sampling.pick_tokens(logits, key, *change(temperature, top_k, top_p))

    monkeypatch.setattr(step_lib, "pick_tokens", wrong)


def _ignore_temperature(monkeypatch):
    _pick_tokens_with(monkeypatch, lambda t, k, p: (1.0, k, p))


def _top_k_one_wider(monkeypatch):
    _pick_tokens_with(monkeypatch, lambda t, k, p: (t, k + 1, p))


def _nucleus_one_wider(monkeypatch):
    def wider(vals, lse, top_p):
        # Keeps a token iff the mass before the token before it is below top_p.
        probs = jnp.exp(vals - lse)
        before = jnp.cumsum(probs, axis=-1) - probs
        before = jnp.concatenate([jnp.zeros_like(before[..., :1]), before[..., :-1]], axis=-1)
        return jnp.where(before < top_p, vals, -jnp.inf)

    monkeypatch.setattr(sampling, "_nucleus", wider)


# (the broken rule, the case it runs, whether it also samples outside the support)
def _walk_to_best_child(monkeypatch):
    """The tree walk takes the drafter's most probable child whatever the target sampled."""

    def walk(tree, y, max_depth):
        b = y.shape[0]
        return jnp.ones((b, max_depth), jnp.int32), jnp.ones((b,), jnp.int32)

    monkeypatch.setattr(step_lib, "accept_path", walk)


CONTROLS = {
    "every_draft_accepted": (_accept_every_draft, "temperature_1", False),
    "tree_walk_ignores_the_sample": (_walk_to_best_child, "temperature_1", False),
    "temperature_ignored": (_ignore_temperature, "temperature_0.7_top_k_2", False),
    "top_k_one_wider": (_top_k_one_wider, "temperature_0.7_top_k_2", True),
    "nucleus_one_wider": (_nucleus_one_wider, "top_p_0.85", True),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_a_wrong_rule_in_the_implementation_is_rejected(control, tiny, enumerated, monkeypatch):
    """The same check, with the implementation broken: TV above the same bound (and, for a
    filter one token wider, samples outside the reference's support)."""
    patch, case, leaves_support = CONTROLS[control]
    temperature, top_k, top_p = CASES[case]
    patch(monkeypatch)
    tree = 3 if control.startswith("tree") else None
    counts, _ = sample(tiny, monkeypatch, temperature, top_k, top_p, tree_budget=tree)
    exact = exact_joint(enumerated, temperature, top_k, top_p)
    bound = tv_bound(exact, N)
    assert tv(counts, exact) > bound, (tv(counts, exact), bound)
    assert bool(np.any((counts > 0) & (exact == 0))) == leaves_support


def _q_oracle(flat: bool):
    """A DFlash 2 selector stand-in for `DFlash2Kind.select_block`: at each slot the candidates are
    the 3 largest logits of the target after x_last and the drafts before (its greedy walk's
    view), q = softmax(their logits / 1.2) over them (the target's temperature without its
    top-p: q has mass where the target has none, so drafts are also rejected and resampled
    from the residual), a draft is sampled from q. `flat`: the same drafts, but q reported as
    uniform over the candidates (a selector that ignores the q it sampled from)."""

    def oracle(tmod, tparams, dmod, dparams, ctx, x_last, start, key, plan):
        seq, drafts, cands, qs = [x_last], [], [], []
        for k in jax.random.split(key, plan.block_size - 1):
            h, _, _ = tmod.apply({"params": tparams}, jnp.stack(seq, 1))
            lg = tmod.apply({"params": tparams}, h[:, -1:], method=dj.Transformer.logits)[:, 0]
            vals, cand = jax.lax.top_k(lg, 3)
            q = jax.nn.softmax(vals / 1.2, axis=-1)
            d = jnp.take_along_axis(cand, jax.random.categorical(k, jnp.log(q))[:, None], 1)[:, 0]
            seq.append(d.astype(jnp.int32))
            drafts.append(d.astype(jnp.int32))
            cands.append(cand.astype(jnp.int32))
            qs.append(jnp.full_like(q, 1 / 3) if flat else q)
        d = jnp.stack(drafts, 1)
        return d, jnp.ones(d.shape, jnp.float32), jnp.stack(cands, 1), jnp.stack(qs, 1)

    return oracle


@pytest.mark.parametrize("flat", (False, True), ids=("q", "control_q_ignored"))
def test_dflash2_sampled_drafts_follow_the_exact_joint(flat, tiny, enumerated, monkeypatch):
    """DFlash 2 at T > 0: drafts sampled from the selector's q (two a step) and verified by
    rejection sampling against q (the residual on the whole vocabulary) follow the exact
    joint; reporting another q than the one sampled from (control) does not."""
    case = "temperature_1.2_top_k_3_top_p_0.9"
    temperature, top_k, top_p = CASES[case]
    t, drafter = tiny
    cfg = drafter.config.replace(
        block_size=3, conv_kernel_size=2, conv_group_size=16, selector_rank=2, selector_top_k=3
    )
    d2 = dj.Drafter(cfg, jax.jit(lambda: dj.init_drafter_params(cfg, 0))())
    use_oracle(monkeypatch, select_block=as_kind_method(_q_oracle(flat)))
    _forget_compiled(monkeypatch)
    res = dj.generate(
        t,
        d2,
        [PROMPT] * N,
        max_new_tokens=N_TOKENS,
        block_size=3,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=11,
    )
    tokens = np.asarray(res.tokens)
    counts = np.bincount(np.ravel_multi_index(tokens.T, (V,) * N_TOKENS), minlength=V**N_TOKENS)
    exact = exact_joint(enumerated, temperature, top_k, top_p)
    bound = tv_bound(exact, N)
    if flat:
        assert tv(counts, exact) > bound, (tv(counts, exact), bound)
        return
    # Each sample's 2 tokens after prefill take 1 step (a draft accepted) or 2: tau = 2 / (1 +
    # the fraction of first drafts rejected); 1.2 means over a third of them accepted.
    assert res.tau > 1.2, res.tau
    assert np.flatnonzero((counts > 0) & (exact == 0)).size == 0
    assert tv(counts, exact) < bound, (tv(counts, exact), bound)
    for rule in NEIGHBOURS[case]:
        wrong = exact_joint(enumerated, *rule)
        assert tv(counts, wrong) > tv_bound(wrong, N), (rule, tv(counts, wrong))


@pytest.mark.parametrize("control", (False, True), ids=("lookup", "control_every_draft_accepted"))
def test_prompt_lookup_samples_follow_the_exact_joint(control, tiny, monkeypatch):
    """Prompt lookup at T > 0: its drafts (what followed the last n-gram where it occurred
    before) are a function of the committed tokens, verified by the one-hot rule. The prompt
    repeats itself (PROMPT, the target's greedy continuation of it, PROMPT again), so the
    lookup drafts that continuation and the target's samples often take it: the joint is
    exact with drafts accepted. Control: accepting every draft, on PROMPT alone (where the
    lookup's drafts are mostly not the target's samples), is rejected by the same bound (on the
    repeating prompt the drafts are so often right that accepting them all moves the joint
    less than the bound)."""
    t, _ = tiny
    prompt = list(PROMPT)
    if not control:
        for _ in range(N_TOKENS):
            logits = np.asarray(t.forward(np.asarray([prompt])).logits)
            prompt.append(int(np.argmax(logits[0, -1])))
        prompt += PROMPT
    temperature, top_k, top_p = CASES["temperature_1"]
    if control:
        _accept_every_draft(monkeypatch)
    _forget_compiled(monkeypatch)
    res = dj.generate(
        t,
        dj.PromptLookup(block_size=3, min_ngram=1, max_ngram=3),
        [prompt] * N,
        max_new_tokens=N_TOKENS,
        temperature=temperature,
        seed=5,
    )
    tokens = np.asarray(res.tokens)
    counts = np.bincount(np.ravel_multi_index(tokens.T, (V,) * N_TOKENS), minlength=V**N_TOKENS)
    exact = exact_joint(_enumerate(t, prompt), temperature, top_k, top_p)
    bound = tv_bound(exact, N)
    if control:
        assert tv(counts, exact) > bound, (tv(counts, exact), bound)
        return
    assert res.tau > 1.2, res.tau  # looked-up drafts accepted
    assert np.flatnonzero((counts > 0) & (exact == 0)).size == 0
    assert tv(counts, exact) < bound, (tv(counts, exact), bound)


@pytest.fixture(scope="module")
def tiny3():
    """`tiny`'s target with 3 layers (an EAGLE-3 drafter taps three), and its enumeration."""
    t = _sharp_target(3)
    return t, _enumerate(t, PROMPT)


def _eagle3_oracle_step(self, dec, state, cache, feature, token, position, chain, i):
    """An EAGLE-3 step (`Eagle3Kind.draft_step`) whose logits are the target's after the
    committed context and the block so far (at the draft vocabulary's target ids): q =
    softmax(them / T) lacks the target's top-k and top-p, so drafts are also rejected."""
    h, _, _ = dec.tmod.apply({"params": dec.tparams}, chain, cache=state.cache)
    logits = jnp.take(dec.lm_logits(h), i - 1, axis=1)
    d2t = dec.dparams["vocab"]["d2t"]
    return feature, logits[:, jnp.arange(d2t.shape[0]) + d2t], cache


@pytest.mark.parametrize(
    "mode",
    ("oracle", "real_module", "control_greedy_drafts"),
    ids=("oracle", "real", "control_drafts_not_from_q"),
)
def test_eagle3_sampled_drafts_follow_the_exact_joint(mode, tiny3, monkeypatch):
    """EAGLE-3 at T > 0: drafts sampled token by token from the drafter's softmax(logits / T)
    and verified by rejection sampling against it follow the exact joint, with an accepted
    oracle step and with the real (random-weight) module; drafts other than samples of the
    q reported (control: each draft the argmax of q, q reported as if sampled from) are
    rejected by the same bound."""
    from dflash_jax.drafters.eagle3 import Eagle3Kind
    from dflash_jax.drafters import eagle3 as e3

    case = "temperature_1.2_top_k_3_top_p_0.9"
    temperature, top_k, top_p = CASES[case]
    t, enumerated = tiny3
    cfg = e3.make_eagle3_config(t.config, target_layer_ids=(0, 1, 2))
    d2t = (np.arange(V)[::-1] - np.arange(V)).astype(np.int32)  # draft id i is target id V-1-i
    drafter = dj.Eagle3(config=cfg, params=e3.init_eagle3_params(cfg, seed=1), d2t=d2t)
    if mode != "real_module":
        monkeypatch.setattr(Eagle3Kind, "draft_step", _eagle3_oracle_step)
    if mode == "control_greedy_drafts":
        propose = Eagle3Kind.propose

        def greedy(self, *a, **kw):
            prop = propose(self, *a, **kw)
            best = jnp.argmax(prop.q_probs, axis=-1)[..., None]
            drafts = jnp.take_along_axis(prop.q_ids, best, axis=-1)[..., 0]
            tokens = prop.tokens.at[:, 1:].set(drafts)
            return prop.replace(drafts=drafts, tokens=tokens)

        monkeypatch.setattr(Eagle3Kind, "propose", greedy)
    _forget_compiled(monkeypatch)
    res = dj.generate(
        t,
        drafter,
        [PROMPT] * N,
        max_new_tokens=N_TOKENS,
        block_size=3,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=11,
    )
    tokens = np.asarray(res.tokens)
    counts = np.bincount(np.ravel_multi_index(tokens.T, (V,) * N_TOKENS), minlength=V**N_TOKENS)
    exact = exact_joint(enumerated, temperature, top_k, top_p)
    bound = tv_bound(exact, N)
    if mode == "control_greedy_drafts":
        assert tv(counts, exact) > bound, (tv(counts, exact), bound)
        return
    assert res.tau > (1.2 if mode == "oracle" else 1.05), res.tau  # drafts accepted
    assert np.flatnonzero((counts > 0) & (exact == 0)).size == 0
    assert tv(counts, exact) < bound, (tv(counts, exact), bound)


@pytest.fixture(scope="module")
def tiny_hybrid():
    """A 6-token hybrid target (Gated DeltaNet, gated attention, Gated DeltaNet) with a
    sharp-ish distribution, a drafter (replaced by the oracle) and its enumerated joint."""
    from dflash_jax.models.config import HybridSpec

    cfg = dj.ModelConfig(
        arch="qwen3_5",
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        hybrid=HybridSpec(
            layer_types=("linear_attention", "full_attention", "linear_attention"),
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        ),
    )
    params = jax.jit(
        lambda: jax.tree_util.tree_map(
            lambda x: x * 6.0 if x.ndim == 2 else x, init_params(cfg, seed=3)
        )
    )()
    t = dj.Target(cfg, params)
    dcfg = dj.make_drafter_config(cfg, num_layers=1, num_taps=1, block_size=BLOCK, mask_token_id=0)
    drafter = dj.Drafter(dcfg, jax.jit(lambda: dj.init_drafter_params(dcfg, 0))())
    return (t, drafter), _enumerate(t, PROMPT)


@pytest.mark.parametrize("control", [False, True], ids=["settled", "control_whole_block_state"])
def test_hybrid_target_samples_follow_the_exact_joint(control, tiny_hybrid, monkeypatch):
    """Sampled DFlash over a hybrid target (its recurrent state settled at each step's accepted
    prefix) follows the exact joint, within the bound, with accepted oracle drafts; a rollback
    that keeps the whole verified block in the state (control) is rejected by the bound."""
    from dflash_jax.models import hybrid

    pair, enumerated = tiny_hybrid
    if control:
        honest = hybrid.HybridCache.rollback

        def whole_block(self, lengths):
            if self.pending is None or self.pending[0][0].shape[1] != BLOCK:
                return honest(self, lengths)  # the prefill settles as it should
            kept = honest(self, self.kv.lengths)
            return kept.replace(kv=kept.kv.rollback(lengths.astype(jnp.int32)))

        monkeypatch.setattr(hybrid.HybridCache, "rollback", whole_block)

    def context_oracle(tmod, tparams, dmod, dparams, ctx, x_last, start, plan):
        """The target's greedy token after PROMPT + x_last: the first step's exact context
        (a state-dependent target is rarely predicted from x_last alone)."""
        ids = jnp.concatenate(
            [jnp.broadcast_to(jnp.asarray(PROMPT), (x_last.shape[0], 3)), x_last[:, None]], 1
        )
        h, _, _ = tmod.apply({"params": tparams}, ids)
        d = jnp.argmax(tmod.apply({"params": tparams}, h[:, -1:], method="logits"), -1)
        return d.astype(jnp.int32), jnp.ones(d.shape, jnp.float32)

    temperature, top_k, top_p = CASES["temperature_1.2_top_k_3_top_p_0.9"]
    counts, tau = sample(pair, monkeypatch, temperature, top_k, top_p, oracle=context_oracle)
    assert tau > 1.3, tau
    exact = exact_joint(enumerated, temperature, top_k, top_p)
    if control:
        assert tv(counts, exact) > tv_bound(exact, N), tv(counts, exact)
        return
    assert np.flatnonzero((counts > 0) & (exact == 0)).size == 0
    assert tv(counts, exact) < tv_bound(exact, N), tv(counts, exact)


def _first_step_logits(tmod, tparams, dmod, dparams, ctx, x_last, tokens, start, plan):
    """A DFlash pass (`DFlashKind.draft_logits`) for the first step: at every slot 0.8 x the
    target's logits after PROMPT and x_last (flatter than the target: its samples are also
    rejected and resampled from the residual)."""
    ids = jnp.concatenate(
        [jnp.broadcast_to(jnp.asarray(PROMPT), (x_last.shape[0], len(PROMPT))), x_last[:, None]],
        1,
    )
    h, _, _ = tmod.apply({"params": tparams}, ids)
    lg = tmod.apply({"params": tparams}, h[:, -1:], method="logits")
    return 0.8 * jnp.broadcast_to(lg, (x_last.shape[0], tokens.shape[1], lg.shape[-1]))


@pytest.mark.parametrize(
    "mode", ("sample", "argmax", "control_q_ignored"), ids=("sample", "argmax", "control")
)
def test_dflash_sampled_drafts_follow_the_exact_joint(mode, tiny, enumerated, monkeypatch):
    """DFlash at T > 0 with draft_sampling "sample": drafts sampled from the drafter's adjusted
    distribution q (two a step, `DFlashKind.sample_block` over an oracle pass) and verified by
    rejection sampling against q follow the exact joint, and are accepted; so does
    "argmax" (one-hot proposals). The drafts really are samples: rows with the same x_last
    draft different first blocks under "sample", one block under "argmax". Reporting another
    q than the one sampled from (control: uniform) is rejected by the bound."""
    case = "temperature_1.2_top_k_3_top_p_0.9"
    temperature, top_k, top_p = CASES[case]
    t, drafter = tiny
    d3 = dj.Drafter(drafter.config.replace(block_size=3), drafter.params)
    oracle = dict(draft_logits=as_kind_method(_first_step_logits))
    if mode == "control_q_ignored":
        from dflash_jax.drafters.dflash import DFlashKind

        def flat_q(kind, dec, *a):
            drafts, conf, q = DFlashKind.sample_block(kind, dec, *a)
            return drafts, conf, jnp.full_like(q, 1.0 / q.shape[-1])

        oracle["sample_block"] = flat_q
    use_oracle(monkeypatch, **oracle)
    _forget_compiled(monkeypatch)
    res = dj.generate(
        t,
        d3,
        [PROMPT] * N,
        max_new_tokens=N_TOKENS,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=13,
        draft_sampling="argmax" if mode == "argmax" else "sample",
        return_drafts=True,
    )
    tokens = np.asarray(res.tokens)
    counts = np.bincount(np.ravel_multi_index(tokens.T, (V,) * N_TOKENS), minlength=V**N_TOKENS)
    exact = exact_joint(enumerated, temperature, top_k, top_p)
    bound = tv_bound(exact, N)
    if mode == "control_q_ignored":
        assert tv(counts, exact) > bound, (tv(counts, exact), bound)
        return
    firsts = collections.defaultdict(set)
    for row, drafts in zip(tokens, res.drafts):
        firsts[int(row[0])].add(tuple(drafts[0]))
    distinct = max(len(s) for s in firsts.values())
    assert distinct > 1 if mode == "sample" else distinct == 1, (mode, distinct)
    assert res.tau > 1.2, res.tau  # drafts accepted
    assert np.flatnonzero((counts > 0) & (exact == 0)).size == 0
    assert tv(counts, exact) < bound, (tv(counts, exact), bound)
    for rule in NEIGHBOURS[case]:
        wrong = exact_joint(enumerated, *rule)
        assert tv(counts, wrong) > tv_bound(wrong, N), (rule, tv(counts, wrong))


def test_draft_sampling_is_checked_and_reaches_each_drafter(tiny):
    """generate's draft_sampling: one line for a bad value or one that cannot apply (no
    drafter, temperature 0, prompt lookup's "sample", "sample" with a tree); at T > 0 each
    model drafter samples or not as asked, by default samples (DFlash, DFlash 2, EAGLE-3);
    at T = 0 none samples, whatever the plan says."""
    from dflash_jax.decoding.request import Request
    from dflash_jax.drafters import eagle3 as e3

    t, drafter = tiny
    build = lambda d, **kw: Request.build(t.config, d, [PROMPT], 2, **kw)
    cases = [
        (drafter.config, dict(draft_sampling="greedy"), "draft_sampling must be one of"),
        (None, dict(draft_sampling="argmax"), "draft_sampling needs a drafter"),
        (drafter.config, dict(draft_sampling="sample"), "draft_sampling needs temperature > 0"),
        (
            dj.PromptLookup(block_size=3).config,
            dict(draft_sampling="sample", temperature=1.0),
            "needs a model drafter",
        ),
        (
            drafter.config,
            dict(draft_sampling="sample", tree_budget=1, temperature=1.0),
            "does not combine with tree_budget",
        ),
    ]
    for d, kw, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            build(d, **kw)
        assert "\n" not in str(e.value)
    assert build(drafter.config).settings.draft_sampling is None  # the drafter's default
    assert build(
        drafter.config, draft_sampling="sample", temperature=1.0
    ).settings.draft_sampling == ("sample")
    d2 = drafter.config.replace(
        conv_kernel_size=2, conv_group_size=16, selector_rank=2, selector_top_k=3
    )
    e3cfg = e3.make_eagle3_config(t.config, target_layer_ids=(0, 1, 2))
    tmod = dj.Transformer(t.config)
    for cfg, default in ((drafter.config, True), (d2, True), (e3cfg, True)):
        dmod = e3.Eagle3Drafter(cfg) if cfg is e3cfg else dj.DFlashDrafter(cfg)
        for rule, want in ((None, default), ("argmax", False), ("sample", True)):
            plan = Plan(block_size=2, temperature=1.0, draft_sampling=rule)
            assert Decoder(None, None, tmod, dmod, plan).samples_drafts is want, (cfg, rule)
            greedy = Plan(block_size=2, draft_sampling=rule)
            assert not Decoder(None, None, tmod, dmod, greedy).samples_drafts
