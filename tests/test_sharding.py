"""Sharding on a fake 8-device CPU mesh: exact sharded generate (the bundled trained pair, its
drafter accepted: tokens, acceptance and whole drafts), partition rules (with the
non-divisible fallback), sharded train steps (losses and parameters), train_and_evaluate on
data=2,fsdp=4 (equal to one device, resumed from its sharded checkpoint), and dry-run
memory/FLOP scaling.

Every check of tests/_multidevice_worker.py runs in one 8-device subprocess (conftest's
`eight_devices`): one JAX start-up, one load of the bundled pair, and the programs the checks
share compiled once; the tests assert on its findings.
"""

import numpy as np
import pytest

# Minutes of subprocess launches: left out of `make test-fast` (the edit loop), run by `make test`.
pytestmark = pytest.mark.slow

# Every check, one process (~107 s alone on this machine: moe 41, generate 27, fsdp_training 12,
# hybrid 11, dry_run 6, train 5, rules 0.2: its findings' "seconds"). hybrid patches the
# drafter and restores it.
CHECKS = ("generate", "moe", "rules", "dry_run", "train", "fsdp_training", "hybrid")


@pytest.fixture(scope="module")
def run(eight_devices, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sharding")
    return eight_devices.checks(workdir, CHECKS), workdir


@pytest.fixture(scope="module")
def findings(run):
    return run[0]


def _leaves(path):
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def _assert_accepted(run):
    """The drafter really is accepted: over 1.5 tokens per target pass, and some step commits
    3 or more (a drafter never accepted would make "DFlash == autoregressive" hold anyway)."""
    acc = [a for seq in run["acceptance"] for a in seq]
    assert run["tau"] > 1.5 and sum(acc) / len(acc) > 1.5, run["tau"]
    assert max(acc) >= 3, run["acceptance"]


def test_sharded_greedy_generate_equals_single_device(findings):
    """The bundled trained pair (accepted: tau ~1.97) on a ragged batch of 4 code prompts:
    sharded DFlash gives the single-device tokens, acceptance lengths and whole drafts (every
    drafted token, accepted or not), and both equal greedy autoregressive decoding."""
    g = findings["generate"]
    assert len(set(g["prompt_lens"])) == 4  # ragged batch
    ref, ref_ar = g["ref"], g["ref_ar"]
    assert ref["tokens"] == ref_ar["tokens"]  # the single-device reference is lossless
    assert all(len(t) == 40 for t in ref["tokens"])
    _assert_accepted(ref)
    # Every step's draft is recorded whole: the block's 15 drafted ids, rejected ones too.
    assert [len(s) for s in ref["drafts"]] == [len(s) for s in ref["acceptance"]]
    assert all(len(d) == 15 for s in ref["drafts"] for d in s)
    for mesh in ("data=2,tensor=4", "data=4,tensor=2", "untied_data=2,tensor=4"):
        got = g[mesh]
        # Sharded, the target's logits are summed in another order (heads and vocabulary split
        # over tensor): float32 equality of the tokens holds except where the single-device
        # target itself nearly ties (issue 45 reported tokens differing on data=2,tensor=4 with
        # 8 host devices for the whole pytest run). A difference passes only as such a flip:
        # the tokens agree up to it, and there the one-device target's logits of the two tokens
        # differ by under 1e-3. Anything else is a real divergence and fails.
        div = got["divergences"]
        assert [d is None for d in div] == [a == b for a, b in zip(got["tokens"], ref["tokens"])]
        assert sum(d is not None for d in div) <= 1, (mesh, div)
        for d, a, b in zip(div, got["tokens"], ref["tokens"]):
            if d is not None:
                assert a[: d["pos"]] == b[: d["pos"]] and abs(d["gap"]) < 1e-3, (mesh, d)
        same = [i for i, d in enumerate(div) if d is None]
        pick = lambda r, key: [r[key][i] for i in same]  # noqa: E731
        assert pick(got, "tokens") == pick(ref, "tokens") == pick(ref_ar, "tokens"), mesh
        assert pick(got, "acceptance") == pick(ref, "acceptance"), mesh
        # The sharded drafter drafts the same blocks: every accepted draft, and all but a few
        # rejected ones. A rejected draft is a low-confidence argmax, where another reduction
        # order (heads split over tensor) may flip a near-tie (seen on jax 0.12, data=2,tensor=4).
        accepted = (
            lambda r: [  # noqa: E731
                [d[: a - 1] for d, a in zip(ds, acc)]
                for ds, acc in zip(pick(r, "drafts"), pick(r, "acceptance"))
            ]
        )
        assert accepted(got) == accepted(ref), mesh
        pairs = [
            (x, y)
            for dg, dr in zip(pick(got, "drafts"), pick(ref, "drafts"))
            for sg, sr in zip(dg, dr)
            for x, y in zip(sg, sr)
        ]
        assert sum(x == y for x, y in pairs) >= 0.9 * len(pairs), mesh
        _assert_accepted(got)
    assert g["ar_tensor=8"]["tokens"] == ref_ar["tokens"]
    # The caches really are split: batch over data; KV heads over tensor when they divide.
    assert g["data=4,tensor=2"]["cache_spec"] == "P('data', None, 'tensor')"
    assert g["data=4,tensor=2"]["k_proj"] == "P(None, 'tensor')"
    # 2 KV heads on tensor=4, which they do not divide: the target's cache is split by
    # sequence (each chip verifies over its slots, merged by log-sum-exp); the projection
    # replicates.
    assert g["data=2,tensor=4"]["cache_spec"] == "P('data', 'tensor')"
    assert g["untied_data=2,tensor=4"]["cache_spec"] == "P('data', 'tensor')"
    assert g["ar_tensor=8"]["cache_spec"] == "P(None, 'tensor')"  # the AR loop's too
    assert g["data=2,tensor=4"]["k_proj"] == "P()"
    # The drafter's context cache: its 2 KV heads split over tensor=2; over tensor=4, which
    # they do not divide, its slots instead (each chip attends over its share; the tokens,
    # acceptance and accepted drafts above are the one-device ones).
    assert g["data=4,tensor=2"]["ctx_spec"] == "P('data', None, 'tensor')"
    assert g["data=2,tensor=4"]["ctx_spec"] == "P('data', 'tensor')"
    for impl, r in g["context_split"].items():  # the XLA path and the kernels in shard_map
        assert r["attention_err"] < 1e-5 and r["write_equal"], (impl, r)
        assert r["verify_err"] < 1e-5 and r["verify_merged"], (impl, r)
    assert sorted(g["context_split"]) == ["pallas_interpret", "xla"]
    assert g["untied_data=2,tensor=4"]["lm_head"] == "P(None, 'tensor')"  # vocab-parallel head
    assert g["ar_tensor=8"]["q_proj"] == "P()"  # 4 query heads do not divide 8: replicated
    # Tree decoding (16 nodes) on data=4,tensor=2: the single-device tokens and acceptance,
    # equal to AR's, with more tokens per step than the chain.
    tree, sharded = g["tree"], g["tree_data=4,tensor=2"]
    assert tree["tokens"] == sharded["tokens"] == ref_ar["tokens"]
    assert tree["acceptance"] == sharded["acceptance"]
    assert tree["tau"] > ref["tau"], (tree["tau"], ref["tau"])
    _assert_replicated_trees(g["replicated_trees"], ("1", "3"))


def _assert_replicated_trees(runs, batches):
    """Trees on a mesh that cannot split the batch (data=2 at batch 1 and 3, expert=2 at 1 and
    2) compile and run (once a SIGABRT in XLA:CPU's TopkDecomposer) and equal AR, accepted."""
    assert sorted(runs) == sorted(batches)
    for b, r in runs.items():
        assert len(r["tokens"]) == int(b)
        assert r["tokens"] == r["ar"], b
        assert max(a for seq in r["acceptance"] for a in seq) >= 3, (b, r["acceptance"])


def test_expert_parallel_generate_equals_single_device(findings):
    """A Qwen3-MoE target (the bundled target turned MoE, its drafter accepted) decoded expert
    parallel (experts split over an `expert` axis, with data and tensor) gives the one-device
    tokens, acceptance lengths and drafts, and those equal autoregressive decoding."""
    m = findings["moe"]
    ref = m["ref"]
    assert ref["tokens"] == m["ref_ar"]["tokens"]
    _assert_accepted(ref)
    for spec, experts in (("expert=4,data=2", "'expert'"), ("expert=2,tensor=2,data=2", None)):
        got = m[spec]
        assert got["tokens"] == ref["tokens"], spec
        assert got["acceptance"] == ref["acceptance"] and got["drafts"] == ref["drafts"], spec
        assert got["mesh"]["expert"] == int(spec.split(",")[0].split("=")[1])
        specs = got["specs"]
        assert specs["router"] == "P()"  # replicated
        if experts:  # 4 experts, one per device of the expert axis
            assert specs["down_proj"] == "P('expert',)", specs
        else:  # experts over expert, each expert's width over tensor
            assert specs["down_proj"] == "P('expert', 'tensor')", specs
            assert specs["gate_proj"] == "P('expert', 'tensor')", specs  # [E, I, H]
            assert specs["dense_mlp"] == "P('tensor',)", specs
    _assert_replicated_trees(m["replicated_trees"], ("1", "2"))


def test_expert_parallel_dflash_through_the_routed_kernel_equals_ar(findings):
    """Issue 42: with the expert matmuls of the decode loop through the routed Pallas kernel
    (interpret mode) inside the expert-parallel shard_map (expert=2,tensor=2,data=2: each device
    its own 2 experts, their width halved), DFlash equals one-device AR decoding, accepted."""
    m = findings["moe"]
    got = m["routed"]
    routed = [c for c in got["calls"] if c[2] == "routed_interpret"]
    assert routed and all(experts == 2 for _, experts, _ in routed), got["calls"]
    assert got["tokens"] == [t[:16] for t in m["ref_ar"]["tokens"][:2]]
    assert max(a for seq in got["acceptance"] for a in seq) >= 3, got["acceptance"]


def test_expert_parallel_train_step_matches_single_device(findings, run):
    """The trainer's step for a drafter against a frozen random MoE target: data=2,expert=2,
    tensor=2 (the frozen experts split over expert and tensor) gives the one-device losses and
    parameters."""
    t = findings["moe"]["train"]
    single, sharded = t["tensor=1"], t["data=2,expert=2,tensor=2"]
    assert len(set(single["losses"])) == 3
    for a, b in zip(single["losses"], sharded["losses"]):
        assert abs(a - b) < 1e-5, (single, sharded)
    assert sharded["expert_spec"] == "P('expert', 'tensor')" and sharded["batch_devices"] == [8] * 3
    _, workdir = run
    p1, p8 = (
        _leaves(workdir / "moe_train_params_1.npz"),
        _leaves(workdir / "moe_train_params_8.npz"),
    )
    assert len(p1) == len(p8) > 0
    for a, b in zip(p1, p8):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_hybrid_target_sharded_equals_one_device_and_autoregressive(findings):
    """A hybrid (Gated DeltaNet) target: DFlash with accepted drafts on one device and on two
    meshes (the recurrent states' heads over tensor) gives the autoregressive tokens."""
    res = findings["hybrid"]
    ar = res["ref_ar"]["tokens"]
    for spec in ("one", "data=2,tensor=4", "data=4,tensor=2"):
        assert res[spec]["tokens"] == ar, spec
        _assert_accepted(res[spec])
        assert len({a[0] for a in res[spec]["acceptance"]}) > 1, spec  # ragged in one step
    # The full layer's cache: its 2 KV heads over tensor=2; over tensor=4 its slots.
    assert res["data=2,tensor=4"]["cache_spec"] == "P('data', 'tensor')"
    assert res["data=4,tensor=2"]["cache_spec"] == "P('data', None, 'tensor')"
    # The DeltaNet's weights split over tensor (4 divides its 4 value heads; 2 as well).
    for spec in ("data=2,tensor=4", "data=4,tensor=2"):
        specs = res[spec]["specs"]
        assert specs["in_proj_qkv"] == "P(None, 'tensor')", specs
        assert specs["out_proj"] == "P('tensor',)", specs
        assert specs["A_log"] == "P('tensor',)", specs


def test_partition_rules_tensor_parallel(findings):
    r = findings["rules"]["data=2,tensor=4"]
    assert r["q_proj"] == "P(None, 'tensor')"  # [H, N*D]: output (heads) axis
    assert r["o_proj"] == "P('tensor',)"  # [N*D, H]: input axis
    assert r["gate_proj"] == "P(None, 'tensor')"
    assert r["down_proj"] == "P('tensor',)"
    assert r["embedding"] == "P('tensor',)"  # [V, H]: vocab-parallel
    assert r["lm_head"] == "P(None, 'tensor')"  # [H, V]
    assert r["fc"] == "P(None, 'tensor')"  # drafter fc [n*H, H]: output over tensor
    assert r["drafter_q_proj"] == "P(None, 'tensor')"
    assert r["q_norm"] == r["input_layernorm"] == "P()"
    assert r["cache_lengths"] == r["ctx_lengths"] == r["batch"] == "P('data',)"
    assert r["odd_batch"] == "P()"  # batch 3 on data=2: replicated
    t2 = findings["rules"]["tensor=2"]
    assert t2["cache_k"] == t2["ctx_k"] == "P(None, None, 'tensor')"
    assert t2["k_proj"] == "P(None, 'tensor')"
    rules = findings["rules"]
    assert rules["placed_q_shard_shape"] == [64, 16] and rules["placed_q_num_devices"] == 4
    assert rules["mesh_shape_rest"] == {"data": 2, "fsdp": 1, "tensor": 4}


def test_non_divisible_dims_fall_back_to_replication(findings):
    r = findings["rules"]
    # 2 KV heads cannot split over tensor=4 (not even whole heads): k_proj and caches
    # replicate on that axis, while 4 query heads still split.
    assert r["tensor=4"]["k_proj"] == "P()"
    assert r["tensor=4"]["q_proj"] == "P(None, 'tensor')"
    assert r["data=2,tensor=4"]["cache_k"] == r["data=2,tensor=4"]["ctx_k"] == "P('data',)"
    assert r["odd_vocab_tensor=8"] == "P()"  # vocab 130 on tensor=8


def test_fsdp_rules_shard_the_other_axis(findings):
    r = findings["rules"]["fsdp=2,tensor=4"]
    assert r["q_proj"] == "P('fsdp', 'tensor')"
    assert r["o_proj"] == "P('tensor', 'fsdp')"
    assert r["embedding"] == "P('tensor', 'fsdp')"
    assert r["lm_head"] == "P('fsdp', 'tensor')"
    assert r["fc"] == "P('fsdp', 'tensor')"
    assert r["k_proj"] == "P('fsdp',)"  # tensor part replicated (2 KV heads)
    assert r["batch"] == "P('fsdp',)"  # fsdp is data-parallel for the batch


def test_sharded_train_step_matches_single_device(findings, run):
    t = findings["train"]
    single, sharded = t["tensor=1"]["losses"], t["data=2,fsdp=2,tensor=2"]["losses"]
    assert len(single) == 3
    for a, b in zip(single, sharded):
        assert abs(a - b) < 1e-5, (single, sharded)
    assert len(set(single)) == 3  # parameters really move between steps (different batches)
    sh = t["data=2,fsdp=2,tensor=2"]
    assert sh["fc_spec"] == "P('fsdp', 'tensor')"
    assert sh["q_spec"] == "P('fsdp', 'tensor')"
    # The batch really is split: rows over data x fsdp (4 of the 8 devices hold distinct rows).
    assert sh["batch_spec"] == "P(('data', 'fsdp'),)" and sh["batch_devices"] == [8, 8, 8]
    # Float32 sums are ordered differently per shard: parameters equal to ~1e-6, not bitwise.
    _, workdir = run
    p1, p8 = _leaves(workdir / "train_params_1.npz"), _leaves(workdir / "train_params_8.npz")
    assert len(p1) == len(p8) > 0
    for a, b in zip(p1, p8):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_dry_run_figures_scale_with_the_mesh(findings):
    d = findings["dry_run"]
    t2, t8 = d["infer tensor=2"], d["infer tensor=8"]
    for r in (t2, t8):
        for name in ("prefill", "dflash_decode", "ar_decode"):
            p = r["programs"][name]
            assert p["hbm_bytes"]["arguments"] > 0 and p["flops"] > 0
            assert p["hbm_bytes"]["total"] > 0 and p["fits"] is None  # no chip: no verdict
    # Params and caches split 4x more ways: per-device figures shrink accordingly.
    assert t8["sizes"]["dflash_param_bytes"] < t2["sizes"]["dflash_param_bytes"] / 3.5
    assert t8["sizes"]["dflash_cache_bytes"] < t2["sizes"]["dflash_cache_bytes"] / 3.5
    for name in ("prefill", "dflash_decode"):
        a2, a8 = t2["programs"][name], t8["programs"][name]
        assert a8["hbm_bytes"]["arguments"] < a2["hbm_bytes"]["arguments"] / 3
        assert a8["hbm_bytes"]["total"] < a2["hbm_bytes"]["total"]
        assert a8["flops"] < a2["flops"] / 3
    # Training (the trainer's own step): FSDP holds ~1/8 of the params and AdamW state.
    fs = d["train fsdp=8"]["sizes"]
    assert fs["param_bytes"] < fs["param_bytes_total"] / 7
    assert fs["opt_bytes"] < fs["opt_bytes_total"] / 7
    step = d["train fsdp=8"]["programs"]["train_step"]
    assert step["hbm_bytes"]["arguments"] < (fs["param_bytes_total"] + fs["opt_bytes_total"]) / 7
    assert step["flops"] > 0 and step["hbm_bytes"]["temporaries"] > 0
    assert "train_step" in d["report"]


def test_fsdp_training_equals_one_device_and_resumes_from_sharded_checkpoints(run):
    """train_and_evaluate on a data=2,fsdp=4 mesh (parameters, AdamW moments and frozen target
    sharded) gives the 1-device losses and drafter, evaluates tau with the sharded `generate`,
    and resumes exactly from its sharded checkpoint."""
    out, workdir = run
    r = out["fsdp_training"]
    one, fsdp, resumed = r["one"], r["fsdp"], r["resumed"]
    l1, l8 = [l for _, l in one["losses"]], [l for _, l in fsdp["losses"]]
    assert one["status"] == fsdp["status"] == resumed["status"] == "done"
    assert np.allclose(l1, l8, atol=0, rtol=1e-5), (l1, l8)
    assert [s for s, _ in resumed["losses"]] == [4, 5, 6]
    assert np.allclose([l for _, l in resumed["losses"]], l8[3:], atol=0, rtol=1e-6)
    assert "tau" in fsdp["eval"] and fsdp["eval"]["tau"] >= 1.0
    # The layout really is sharded: AdamW moments and drafter weights split over fsdp.
    assert any("fsdp" in s for s in r["param_specs"]), r["param_specs"]
    assert any("fsdp" in s for s in r["frozen_specs"]), r["frozen_specs"]
    # Same trained drafter either way.
    d1 = _leaves(workdir / "fsdp_drafter_one.npz")
    d8 = _leaves(workdir / "fsdp_drafter_fsdp.npz")
    assert len(d1) == len(d8) > 0
    for a, b in zip(d1, d8):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_a_cache_splits_by_sequence_only_where_heads_cannot_and_the_saving_pays():
    """`sharding.cache_specs` of caches marked `seq_split` (no devices: a mesh's axis sizes
    and abstract arrays): split over tensor by their slots only where tensor does not divide
    their KV heads, it divides their slots, and a layer's K and V on a chip reach
    `attention.SEQ_SPLIT_MIN_BYTES` (32 MiB: the log-sum-exp merge's two all-reduces a layer
    cost what reading about 13 MB does on v5e); never for a cache not marked."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.models import attention
    from dflash_jax.models.transformer import KVCache
    from dflash_jax.parallel import sharding

    class Mesh:
        shape = {"data": 2, "fsdp": 1, "tensor": 8}

    def spec(batch, slots, heads, head_dim, split=True):
        x = jax.ShapeDtypeStruct((batch, slots, heads * head_dim), jnp.bfloat16)
        n = jax.ShapeDtypeStruct((batch,), jnp.int32)
        cache = KVCache(k=(x,), v=(x,), lengths=n, head_dim=head_dim, seq_split=split)
        return tuple(sharding.cache_specs(cache, Mesh).k[0])

    assert attention.SEQ_SPLIT_MIN_BYTES == 32 * 2**20
    # Qwen3.5-9B's full layers at 32K, 2 sequences a chip: 2 x 2 x 33,280 x 1,024 x 2 B each.
    assert spec(4, 33280, 4, 256) == ("data", "tensor")
    assert spec(4, 33280, 4, 256, split=False) == ("data",)  # whole: 4 heads over 8 chips
    # Qwen3-30B-A3B's at 4K (4,352 slots of 4 x 128): 8.9 MB a layer on a chip, not worth it.
    assert spec(2, 4352, 4, 128) == ("data",)
    # 8 heads divide tensor=8: split by heads, whatever the size.
    assert spec(4, 33280, 8, 128) == ("data", None, "tensor")
    # At the threshold: one sequence a chip, 2 x 4,096 slots x 2,048 x 2 B = 32 MiB exactly.
    assert spec(2, 4096, 4, 512) == ("data", "tensor")
    assert spec(2, 4088, 4, 512) == ("data",)  # 8 slots fewer
    assert spec(2, 4100, 4, 512) == ("data",)  # 4,100 slots: 8 does not divide them
