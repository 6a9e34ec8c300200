"""The drafter registry (`dflash_jax.drafters.registry`): each kind found from a --drafter spec,
a config, a user object and a decode module; and a kind from outside the library, added by one
line, drafting in the compiled loop through `generate` (tokens equal to autoregressive decoding,
its drafts accepted and rejected), its request limits applied by `Request.build`, and run by
the batch runner and the dry run."""

import os

import numpy as np
import pytest
from _pair import PAIR, assert_accepted

import dflash_jax as dj
from dflash_jax.drafters import base, registry
from dflash_jax.drafters import dflash as dflash_lib
from dflash_jax.drafters import prompt_lookup


def test_every_kind_is_found_from_what_names_it(bundled_pair):
    target, drafter, _ = bundled_pair
    assert registry.names() == ("prompt_lookup", "eagle3", "dflash")
    dflash = registry.named("dflash")
    assert registry.for_spec(os.path.join(PAIR, "drafter")) is dflash
    assert registry.for_spec("prompt_lookup:2-4") is prompt_lookup.KIND
    assert registry.for_spec(None) is registry.for_spec("") is base.AUTOREGRESSIVE
    for x in (drafter, drafter.config, drafter.module):
        assert registry.of(x) is dflash
    assert registry.loop_of(drafter.module) is dflash
    fields = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    v2 = dflash_lib.DFlashDrafter(drafter.config.replace(**fields))
    assert v2.cfg.dflash2 and registry.loop_of(v2) is dflash_lib.DFLASH2
    assert registry.loop_of(None) is base.AUTOREGRESSIVE
    looked_up = dj.PromptLookup(block_size=5)
    assert registry.of(looked_up) is registry.of(looked_up.module) is prompt_lookup.KIND
    assert dflash.tap_layers(drafter.config, 99) == drafter.config.target_layer_ids
    with pytest.raises(ValueError, match="no drafter kind 'medusa' \\(one of 'prompt_lookup'"):
        registry.named("medusa")
    with pytest.raises(TypeError, match="not a drafter of any registered kind: str"):
        registry.of("drafter")


@pytest.fixture
def oracle_registered(monkeypatch):
    """The library's kinds and the oracle (tests/_oracle_kind.py): its one registry line."""
    monkeypatch.setattr(registry, "KIND_MODULES", ("_oracle_kind",) + registry.KIND_MODULES)
    import _oracle_kind

    return _oracle_kind


def test_a_kind_added_by_one_line_drafts_in_the_loop_losslessly(bundled_pair, oracle_registered):
    from dflash_jax.decoding.request import Request

    target, _, prompts = bundled_pair
    ok = oracle_registered
    assert registry.for_spec("oracle") is ok.KIND and not ok.KIND.reads_files
    prompts, n = prompts[:2], 24
    ar = dj.generate(target, None, prompts, max_new_tokens=n)
    table = np.zeros((len(prompts), n + 8), np.int32)
    for i, toks in enumerate(ar.tokens):
        table[i, : len(toks)] = toks
    res = dj.generate(target, ok.Oracle(ok.OracleConfig(), table), prompts, max_new_tokens=n)
    assert res.tokens == ar.tokens
    assert_accepted(res, 4)
    lengths = [a for seq in res.acceptance_lengths for a in seq]
    assert min(lengths) < 4, lengths  # the changed drafts were rejected, the output kept
    # A Generator over it (settings checked once, called per batch): the same accepted drafts.
    gen = dj.Generator(target, ok.Oracle(ok.OracleConfig(), table), dj.Settings())
    first, again = gen(prompts, n), gen(prompts, n)
    assert first.tokens == again.tokens == ar.tokens
    assert first.acceptance_lengths == res.acceptance_lengths
    # Its limits: the default block, what a chain-only kind refuses.
    request = Request.build(target.config, ok.OracleConfig(), prompts, n)
    assert request.settings.block_size == 4
    with pytest.raises(ValueError, match="^tree_budget is not implemented for the oracle$"):
        Request.build(target.config, ok.OracleConfig(), prompts, n, tree_budget=4)


def test_a_kind_added_by_one_line_runs_through_the_batch_runner_and_the_dry_run(
    bundled_pair, oracle_registered
):
    """The oracle kind through infer.py's batch runner (records equal to autoregressive
    decoding, its drafts accepted) and the dry run (its loop compiled in DFlash's place for a
    TPU topology), neither of which names it."""
    from dflash_jax.dry_run import programs
    from dflash_jax.dry_run.topology import topology_devices
    from dflash_jax.frontend.batch_runner import run_prompts

    target, _, prompts = bundled_pair
    ok = oracle_registered
    prompts, n = sorted(prompts[:2], key=len), 16  # one batch, in the runner's order
    ar = dj.generate(target, None, prompts, max_new_tokens=n)
    table = np.zeros((len(prompts), n + 8), np.int32)
    for i, toks in enumerate(ar.tokens):
        table[i, : len(toks)] = toks
    oracle = ok.Oracle(ok.OracleConfig(), table)
    rep = run_prompts(target, oracle, prompts, batch_size=2, max_new_tokens=n, compare_ar=True)
    assert [r["tokens"] for r in rep.records] == ar.tokens
    assert all(r["identical_to_ar"] for r in rep.records) and rep.totals["tau"] > 1.5

    assert "oracle" in programs.other_drafters()
    devices, chip = topology_devices("v5e:1x1")
    kw = dict(batch=1, context=64, max_new_tokens=16, devices=devices, chip=chip)
    kw.update(attention=("xla",), only=("dflash_decode", "ar_decode"))
    run = programs.dry_run_infer("tiny", "tensor=1", drafter="oracle", block_size=4, **kw)
    assert run["settings"]["drafter"] == "oracle"
    sizes = run["sizes"]
    assert sizes["dflash_param_bytes"] - sizes["ar_param_bytes"] == 64 * 4  # its table
    with pytest.raises(ValueError, match="draft_vocab_size is not a setting of drafter='oracle'"):
        programs.other_drafter(target.config, "oracle", 4, draft_vocab_size=8)


def test_each_kinds_dry_run_shapes_are_what_its_loaded_drafter_gives_the_programs(bundled_pair):
    """`for_target` / `module` / `abstract_params` (what the dry run compiles) against the
    decode parameters of a real drafter of that config (what `generate` passes)."""
    import jax

    from dflash_jax.drafters import eagle3 as e3

    target = bundled_pair[0]
    real = {
        "dflash": lambda c: dflash_lib.Drafter(c, dflash_lib.init_drafter_params(c)),
        "eagle3": lambda c: e3.Eagle3(c, e3.init_eagle3_params(c), np.arange(c.draft_vocab_size)),
        "prompt_lookup": lambda c: dj.PromptLookup(block_size=c.block_size),
    }
    shapes = lambda tree: jax.tree_util.tree_map(lambda x: (np.shape(x), np.dtype(x.dtype)), tree)
    for kind in registry.kinds():
        cfg = kind.for_target(target.config, 8)
        assert registry.of(cfg) is kind and isinstance(kind.module(cfg), kind.module_type)
        drafter = real[kind.name](cfg)
        assert shapes(kind.abstract_params(cfg)) == shapes(kind.decode_params(drafter)), kind.name


def test_using_puts_a_kind_first_for_the_block_only(bundled_pair):
    """`registry.using`: an oracle subclass answers for its drafters inside the block (and its
    DFlash 2 sibling for DFlash 2 configs), the registered kind before and after."""
    from _pair import oracle_kinds

    drafter = bundled_pair[1]
    oracle, oracle2 = oracle_kinds(draft_block=lambda kind, dec, *a: None)
    fields = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    v2 = dflash_lib.DFlashDrafter(drafter.config.replace(**fields))
    with registry.using(oracle, oracle2):
        assert registry.of(drafter) is oracle and registry.loop_of(drafter.module) is oracle
        assert registry.loop_of(v2) is oracle2
        assert registry.of(dj.PromptLookup()) is prompt_lookup.KIND
    assert registry.of(drafter) is registry.named("dflash") and registry.OVERRIDES == ()
    assert registry.loop_of(v2) is dflash_lib.DFLASH2
