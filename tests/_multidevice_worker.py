"""The one entry point of the suite's 8-device checks (tests/test_sharding.py), run by
conftest's `eight_devices` fixture:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_multidevice_worker.py \
        WORKDIR CHECK [CHECK ...]

JAX fixes its device count at start-up, so the checks run in a subprocess whose JAX sees 8
fake CPU devices. Each `check_NAME(out, workdir)` adds its findings under out[NAME] (arrays too
large for JSON go to .npz files in WORKDIR); the tests assert on them. One JSON line is
printed, prefixed RESULT."""

import collections
import contextlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dflash_jax as dj  # noqa: E402
from dflash_jax import dry_run  # noqa: E402
from dflash_jax.drafters.dflash import DFlashDrafter  # noqa: E402
from dflash_jax.models.transformer import KVCache, Transformer  # noqa: E402
from dflash_jax.models.target import init_params  # noqa: E402
from dflash_jax.models.tiny import tiny_config  # noqa: E402
from dflash_jax.parallel import sharding
from dflash_jax.training import drafter_setup, experiment, trainer  # noqa: E402
from dflash_jax.training.step import (  # noqa: E402
    TrainState,
    make_optimizer,
    make_train_step,
    train_shardings,
)


def _scaled(params, factor=4.0):
    """Larger-than-default weights so logits are far from uniform (argmax is not a near-tie)."""
    return jax.tree_util.tree_map(lambda x: x * factor if x.ndim == 2 else x, params)


def small_pair():
    """Random weights: for the partition rules only (a random drafter is never accepted, so it
    proves nothing about lossless decoding)."""
    cfg = tiny_config(
        vocab_size=128, num_layers=4, tie_word_embeddings=False, max_position_embeddings=512
    )
    target = dj.Target(cfg, _scaled(init_params(cfg, 0)))
    dcfg = dj.make_drafter_config(cfg, num_layers=2, num_taps=3, block_size=8, mask_token_id=127)
    return target, dj.Drafter(dcfg, _scaled(dj.init_drafter_params(dcfg, 1)))


def bundled_pair():
    """The bundled trained pair (assets/tiny-code: 4 query heads, 2 KV heads, hidden 256, vocab
    4096, tied embeddings; drafter block 16), in float32, and the suite's code prompts (mixed
    lengths). Its drafter is accepted: 1.97 tokens per target pass at 40 new tokens."""
    from dflash_jax.data.tokenizer import load_tokenizer

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from _multiprocess_worker import ASSETS, CODE

    target = dj.load_target(os.path.join(ASSETS, "target"), dtype="float32")
    drafter = dj.load_drafter(os.path.join(ASSETS, "drafter"), target=target)
    tok = load_tokenizer(os.path.join(ASSETS, "target"))
    return target, drafter, [tok.encode(c) for c in CODE]


@contextlib.contextmanager
def _patched(owner, name, value):
    """`owner.name = value` for the block, with a compiled-program table of its own: the other
    checks share this process, and a program traced under the patch must not serve them (nor
    one of theirs the patched run)."""
    from dflash_jax.decoding import programs

    saved = getattr(owner, name), programs._Compiled.cache
    setattr(owner, name, value)
    programs._Compiled.cache = collections.OrderedDict()
    try:
        yield
    finally:
        setattr(owner, name, saved[0])
        programs._Compiled.cache = saved[1]


def _run(r, drafts=True):
    """A GenerationResult as JSON: tokens, acceptance lengths, drafts, tau, cache sharding."""
    out = {"tokens": r.tokens, "cache_spec": r.stats.get("cache_sharding")}
    if "context_sharding" in r.stats:
        out["ctx_spec"] = r.stats["context_sharding"]
    if drafts:
        out.update(acceptance=r.acceptance_lengths, drafts=r.drafts, tau=r.stats["tau"])
    return out


def _divergences(target, prompts, ref_tokens, got_tokens):
    """Per prompt, None where `got` equals `ref`, else where they first differ and how close
    the single-device target's choice was there: {"pos", "ref", "got", "gap"} with gap the
    float32 logit of ref's token minus that of got's (a near-tie when tiny: another reduction
    order may flip it, which is not a loss of exactness of the algorithm)."""
    out = []
    for p, ref, got in zip(prompts, ref_tokens, got_tokens):
        if ref == got:
            out.append(None)
            continue
        i = next(k for k, (a, b) in enumerate(zip(ref, got)) if a != b)
        ids = np.asarray([list(p) + list(ref[:i])], np.int32)
        logits = np.asarray(target.forward(ids).logits)[0, -1]
        gap = float(logits[ref[i]] - logits[got[i]])
        out.append({"pos": i, "ref": int(ref[i]), "got": int(got[i]), "gap": gap})
    return out


def check_generate(out, workdir):
    """The bundled pair decoded on one device (DFlash and autoregressive) and on three meshes
    of the 8 devices: data=2,tensor=4 (query heads, vocabulary and MLP split 4 ways; the 2 KV
    heads do not divide 4, so k/v projections and caches replicate on tensor), data=4,tensor=2
    (KV heads and caches split too), tensor=8 (autoregressive; 4 query heads do not divide 8).
    The target ties its embeddings (the LM head is the vocab-parallel embedding); an untied
    copy of it (lm_head = embedding.T, the same function) runs data=2,tensor=4 too, through a
    sharded lm_head."""
    import dataclasses

    target, drafter, prompts = bundled_pair()
    n = 40
    res = {"prompt_lens": [len(p) for p in prompts]}
    res["ref"] = _run(dj.generate(target, drafter, prompts, n, return_drafts=True))
    res["ref_ar"] = _run(dj.generate(target, None, prompts, n), drafts=False)
    mesh4x2 = dry_run.resolve_mesh("data=4,tensor=2")
    for spec in ("data=2,tensor=4", "data=4,tensor=2"):
        mesh = dry_run.resolve_mesh(spec)
        res[spec] = _run(dj.generate(target, drafter, prompts, n, return_drafts=True, mesh=mesh))
        res[spec]["divergences"] = _divergences(
            target, prompts, res["ref"]["tokens"], res[spec]["tokens"]
        )
        tp = sharding.param_specs(target.params, mesh, sharding.target_rules(), 64)
        res[spec]["k_proj"] = str(tp["layers_0"]["self_attn"]["k_proj"]["kernel"])
    mesh = dry_run.resolve_mesh("tensor=8")
    res["ar_tensor=8"] = _run(dj.generate(target, None, prompts, n, mesh=mesh), drafts=False)
    tp = sharding.param_specs(target.params, mesh, sharding.target_rules(), 64)
    res["ar_tensor=8"]["q_proj"] = str(tp["layers_0"]["self_attn"]["q_proj"]["kernel"])
    untied = dj.Target(
        dataclasses.replace(target.config, tie_word_embeddings=False),
        {**target.params, "lm_head": {"kernel": target.params["embed_tokens"]["embedding"].T}},
    )
    mesh = dry_run.resolve_mesh("data=2,tensor=4")
    res["untied_data=2,tensor=4"] = _run(
        dj.generate(untied, drafter, prompts, n, return_drafts=True, mesh=mesh)
    )
    res["untied_data=2,tensor=4"]["divergences"] = _divergences(
        target, prompts, res["ref"]["tokens"], res["untied_data=2,tensor=4"]["tokens"]
    )
    tp = sharding.param_specs(untied.params, mesh, sharding.target_rules(), 64)
    res["untied_data=2,tensor=4"]["lm_head"] = str(tp["lm_head"]["kernel"])
    # Tree decoding (16 nodes), one device and KV heads split.
    tree = lambda **kw: dj.generate(target, drafter, prompts, n, tree_budget=16, **kw)
    for name, r in (("tree", tree()), ("tree_data=4,tensor=2", tree(mesh=mesh4x2))):
        res[name] = dict(_run(r, drafts=False), acceptance=r.acceptance_lengths, tau=r.stats["tau"])
    res["context_split"] = _context_split()
    res["replicated_trees"] = _replicated_batch_trees(
        target, drafter, prompts, "data=2", (1, 3), res["ref_ar"]["tokens"]
    )
    out["generate"] = res


def _context_split(spec="data=2,tensor=4"):
    """A cache split by sequence (2 KV heads on tensor=4: 512 slots, 128 a chip) under the XLA
    reference and the Pallas kernels (interpreted, inside the shard_map): the drafter's
    attention against the one-device reference over the whole context (ragged lengths 300 and
    129); a target's verify of 16 queries at positions 120.. and 250.. (each straddling two
    chips' slots) against the one-device reference, and whether its program merges shares
    (a `pmax`); and a block write whose 16 rows straddle two chips' slots against the NumPy
    one. {impl: {"attention_err", "verify_err", "verify_merged", "write_equal"}}."""
    from dflash_jax.models import attention
    from pallas_kernels import reference

    rng = np.random.default_rng(0)
    b, t, hq, hkv, d, c = 2, 16, 8, 2, 64, 512
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, bk, bv = f(b, t, hq, d), f(b, t, hkv, d), f(b, t, hkv, d)
    ck, cv, new = f(b, c, hkv * d), f(b, c, hkv * d), f(b, t, hkv * d)
    n, starts = jnp.asarray([300, 129], jnp.int32), jnp.asarray([120, 250], jnp.int32)
    heads = lambda x: x.reshape(b, c, hkv, d)  # noqa: E731
    want = np.asarray(reference.draft_attention(q, heads(ck), heads(cv), n, bk, bv))
    written = np.array(ck)
    for i, s0 in enumerate(np.asarray(starts)):
        written[i, s0 : s0 + t] = np.asarray(new[i])
    pos = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    want_v = np.asarray(reference.verify_attention(q, heads(ck), heads(cv), pos))
    mesh, res = dry_run.resolve_mesh(spec), {}
    for impl in ("xla", "pallas_interpret"):
        attend = lambda *a: attention.draft_attention(*a, impl=impl, seq_split=True)  # noqa: B023,E731
        verify = lambda *a: attention.verify_attention(*a, impl=impl, seq_split=True)  # noqa: B023,E731
        write = lambda *a: attention.write_block(*a, impl, d, seq_split=True)  # noqa: B023,E731
        with sharding.compiling_for(mesh):
            got = jax.jit(attend)(q, ck, cv, n, bk, bv)
            got_v = jax.jit(verify)(q, ck, cv, pos)
            merged = "pmax" in str(jax.make_jaxpr(verify)(q, ck, cv, pos))
            w = jax.jit(write)(ck, new, starts)
        res[impl] = {
            "attention_err": float(np.max(np.abs(np.asarray(got) - want))),
            "verify_err": float(np.max(np.abs(np.asarray(got_v) - want_v))),
            "verify_merged": merged,
            "write_equal": bool(np.array_equal(np.asarray(w), written)),
        }
    return res


def _replicated_batch_trees(target, drafter, prompts, spec, batches, ar_tokens, n=24):
    """Tree decoding (8 nodes) on `spec` for batches that its data axes cannot split (the batch
    replicated: once a compiler abort in XLA:CPU's top-k), against the one-device AR tokens of
    the same prompts (`ar_tokens`: the whole batch's, longer; greedy AR of a row does not
    depend on the rows beside it): {batch: {"tokens", "ar", "acceptance"}}."""
    mesh = dry_run.resolve_mesh(spec)
    res = {}
    for b in batches:
        r = dj.generate(target, drafter, prompts[:b], n, tree_budget=8, mesh=mesh)
        ar = [list(t[:n]) for t in ar_tokens[:b]]
        res[b] = {"tokens": r.tokens, "ar": ar, "acceptance": r.acceptance_lengths}
    return res


def _routed_expert_parallel(target, drafter, prompts, n):
    """Issue 42: DFlash on expert=2,tensor=2,data=2 with every expert matmul of at most 512 rows
    through the routed Pallas kernel (interpret mode): inside the expert-parallel shard_map each
    device runs it over its own 2 experts (their width halved by tensor). The calls' (rows,
    local experts, method) show which path was traced."""
    from dflash_jax.models import moe

    calls = []

    def forced(rows, experts, impl="xla"):
        method = "routed_interpret" if 0 < rows <= 512 else "ragged"
        calls.append((rows, experts, method))
        return method

    # Programs compiled under another dispatch (a cache hit would not trace the one forced).
    with _patched(moe, "gmm_method", forced):
        mesh = dry_run.resolve_mesh("expert=2,tensor=2,data=2")
        res = _run(dj.generate(target, drafter, prompts, n, block_size=8, mesh=mesh))
    res["calls"] = sorted(set(calls))
    return res


def check_moe(out, workdir):
    """A Qwen3-MoE target (the bundled target turned MoE, `_pair.moe_from_dense`: 4 experts,
    top-2, layer 2 dense; the bundled drafter, accepted) decoded with DFlash on one device and
    expert parallel: expert=4,data=2 (one expert per device of a data shard) and
    expert=2,tensor=2,data=2 (two experts per device, each expert's width split in two; the
    attention heads tensor parallel too); autoregressive decoding on one device. Then three
    trainer steps of a drafter against a frozen random MoE target, one device and
    data=2,expert=2,tensor=2."""
    from _pair import moe_from_dense

    dense, drafter, prompts = bundled_pair()
    target = moe_from_dense(dense)
    n = 40
    res = {"ref": _run(dj.generate(target, drafter, prompts, n, return_drafts=True))}
    res["ref_ar"] = _run(dj.generate(target, None, prompts, n), drafts=False)
    for spec in ("expert=4,data=2", "expert=2,tensor=2,data=2"):
        mesh = dry_run.resolve_mesh(spec)
        res[spec] = _run(dj.generate(target, drafter, prompts, n, return_drafts=True, mesh=mesh))
        tp = sharding.param_specs(target.params, mesh, sharding.target_rules(), 64)
        mlp = tp["layers_0"]["mlp"]
        res[spec]["specs"] = {
            "down_proj": str(mlp["experts"]["down_proj"]["kernel"]),
            "gate_proj": str(mlp["experts"]["gate_proj"]["kernel"]),
            "router": str(mlp["gate"]["kernel"]),
            "dense_mlp": str(tp["layers_2"]["mlp"]["down_proj"]["kernel"]),
        }
        res[spec]["mesh"] = dict(mesh.shape)
    res["replicated_trees"] = _replicated_batch_trees(
        target, drafter, prompts, "expert=2", (1, 2), res["ref_ar"]["tokens"]
    )
    res["routed"] = _routed_expert_parallel(target, drafter, prompts[:2], 16)
    # The trainer's step against a frozen random MoE target (4 experts, top 2), one device
    # and data=2,expert=2,tensor=2 (the step partitioned by GSPMD).
    cfg = tiny_config(
        "qwen3_moe",
        vocab_size=128,
        num_layers=4,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        mlp_only_layers=(1,),
    )
    res["train"] = _train_steps(cfg, ("tensor=1", "data=2,expert=2,tensor=2"), workdir, "moe_train")
    out["moe"] = res


def check_hybrid(out, workdir):
    """A random Qwen3.5-style hybrid target (layers linear, full, linear, linear) decoded
    autoregressively on one device, then with DFlash on one device, data=2,tensor=4 and data=4,
    tensor=2 (the delta-rule states' value heads over tensor), its drafts read from the
    autoregressive continuation (wrong at every 5th position: accepted, ragged over the batch)."""
    from _pair import oracle_kinds

    from dflash_jax.drafters import registry

    types = ("linear_attention", "full_attention", "linear_attention", "linear_attention")
    cfg = tiny_config(
        "qwen3_5",
        vocab_size=128,
        intermediate_size=96,
        max_position_embeddings=512,
        hybrid={"layer_types": types},
    )
    target = dj.Target(cfg, _scaled(init_params(cfg, 0)))
    dcfg = dj.make_drafter_config(cfg, num_layers=1, num_taps=2, block_size=8, mask_token_id=127)
    drafter = dj.Drafter(dcfg, dj.init_drafter_params(dcfg, 1))
    rs = np.random.RandomState(5)
    prompts = [list(map(int, rs.randint(0, 127, n))) for n in (9, 26, 25, 7)]
    n = 24
    res = {"ref_ar": _run(dj.generate(target, None, prompts, n), drafts=False)}
    table = np.zeros((4, 128), np.int32)
    for i, (p, c) in enumerate(zip(prompts, res["ref_ar"]["tokens"])):
        table[i, : len(p) + len(c)] = p + c
    table = jnp.asarray(table)

    def oracle(kind, dec, ctx, x_last, start):
        pos = start[:, None] + 1 + jnp.arange(dec.plan.block_size - 1)[None]
        d = jnp.take_along_axis(table, jnp.minimum(pos, table.shape[1] - 1), axis=1)
        d = jnp.where(pos % 5 == 0, (d + 1) % 128, d)
        return d, jnp.ones(d.shape, jnp.float32)

    with registry.using(*oracle_kinds(draft_block=oracle)):  # this check's drafts only
        for spec in ("one", "data=2,tensor=4", "data=4,tensor=2"):
            mesh = None if spec == "one" else dry_run.resolve_mesh(spec)
            res[spec] = _run(dj.generate(target, drafter, prompts, n, block_size=8, mesh=mesh))
            if mesh is not None:
                tp = sharding.param_specs(target.params, mesh, sharding.target_rules(), 16)
                la = tp["layers_0"]["linear_attn"]
                res[spec]["specs"] = {
                    "in_proj_qkv": str(la["in_proj_qkv"]["kernel"]),
                    "out_proj": str(la["out_proj"]["kernel"]),
                    "A_log": str(la["A_log"]),
                }
    out["hybrid"] = res


def check_rules(out, workdir):
    target, drafter = small_pair()  # 4 query heads, 2 KV heads, head_dim 16, vocab 128
    res = {}
    for spec in ("tensor=4", "data=2,tensor=4", "tensor=2", "fsdp=2,tensor=4"):
        mesh = dry_run.resolve_mesh(spec)
        fsdp = mesh.shape["fsdp"] > 1
        tp = sharding.param_specs(target.params, mesh, sharding.target_rules(fsdp), 16)
        dp = sharding.param_specs(
            drafter.params, mesh, sharding.target_rules(fsdp), 16
        )  # one rule set
        cache = KVCache.create(target.config, 4, 32)
        ctx = KVCache.create(drafter.config, 4, 32)
        cs = sharding.cache_specs(cache, mesh)
        xs = sharding.cache_specs(ctx, mesh)
        lay = tp["layers_0"]
        res[spec] = {
            "q_proj": str(lay["self_attn"]["q_proj"]["kernel"]),
            "k_proj": str(lay["self_attn"]["k_proj"]["kernel"]),
            "o_proj": str(lay["self_attn"]["o_proj"]["kernel"]),
            "gate_proj": str(lay["mlp"]["gate_proj"]["kernel"]),
            "down_proj": str(lay["mlp"]["down_proj"]["kernel"]),
            "q_norm": str(lay["self_attn"]["q_norm"]["scale"]),
            "input_layernorm": str(lay["input_layernorm"]["scale"]),
            "embedding": str(tp["embed_tokens"]["embedding"]),
            "lm_head": str(tp["lm_head"]["kernel"]),
            "fc": str(dp["fc"]["kernel"]),
            "drafter_q_proj": str(dp["layers_0"]["self_attn"]["q_proj"]["kernel"]),
            "cache_k": str(cs.k[0]),
            "cache_lengths": str(cs.lengths),
            "ctx_k": str(xs.k[0]),
            "ctx_lengths": str(xs.lengths),
            "batch": str(sharding.batch_sharding(mesh, (4, 16)).spec),
            "odd_batch": str(sharding.batch_sharding(mesh, (3, 16)).spec),
        }
    # A vocabulary the tensor axis does not divide: the table is replicated on V.
    mesh = dry_run.resolve_mesh("tensor=8")
    odd = {"embed_tokens": {"embedding": jax.ShapeDtypeStruct((130, 64), jnp.float32)}}
    res["odd_vocab_tensor=8"] = str(
        sharding.param_specs(odd, mesh, sharding.target_rules())["embed_tokens"]["embedding"]
    )
    # shard_params really places the arrays.
    placed = sharding.shard_params(target.params, dry_run.resolve_mesh("tensor=4"), head_dim=16)
    q = placed["layers_0"]["self_attn"]["q_proj"]["kernel"]
    res["placed_q_shard_shape"] = list(q.addressable_shards[0].data.shape)
    res["placed_q_num_devices"] = len(q.sharding.device_set)
    res["mesh_shape_rest"] = dict(sharding.make_mesh(data=2, tensor=-1).shape)
    out["rules"] = res


def check_train(out, workdir):
    """The trainer's own step (`make_train_step` + `train_shardings` + `drafter_loss_fn`) on
    one device and on a data x fsdp x tensor mesh: the same losses and, after the three steps,
    the same parameters (train_params_{1,8}.npz); the batch really is split over the mesh's
    data and fsdp devices."""
    cfg = tiny_config(
        vocab_size=128, num_layers=4, tie_word_embeddings=False, max_position_embeddings=512
    )
    out["train"] = _train_steps(cfg, ("tensor=1", "data=2,fsdp=2,tensor=2"), workdir, "train")


def _train_steps(cfg, specs, workdir, name):
    """Three steps of the trainer's own step for a drafter of the random target `cfg` on each
    mesh of `specs` (the first: one device): losses, batch placement and specs per mesh; the
    final drafter parameters in {name}_params_{devices}.npz."""
    tparams = _scaled(init_params(cfg, 0), 2.0)
    dcfg = dj.make_drafter_config(cfg, num_layers=2, num_taps=3, block_size=8, mask_token_id=127)
    dparams0 = dj.init_drafter_params(dcfg, 1)
    rng = np.random.RandomState(0)
    b, s = 8, 48
    config = dry_run.train_config(batch=b, seq_len=s, num_anchors=4)
    config.learning_rate = 3e-3
    loss_fn = drafter_setup.drafter_loss_fn(config, Transformer(cfg), DFlashDrafter(dcfg))
    opt = make_optimizer(config, 20)[0]
    batches = []
    for _ in range(3):
        batches.append(
            {
                "input_ids": jnp.asarray(rng.randint(0, 127, (b, s)), jnp.int32),
                "loss_mask": jnp.asarray((rng.rand(b, s) < 0.8), jnp.float32),
                "segment_ids": jnp.ones((b, s), jnp.int32),
            }
        )
    res = {}
    for spec in specs:
        mesh = dry_run.resolve_mesh(spec, devices=jax.devices()[:1] if spec == specs[0] else None)
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=jax.tree_util.tree_map(jnp.copy, dparams0),
            opt_state=opt.init(dparams0),
            rng=jax.random.PRNGKey(0),
        )
        shardings = train_shardings(mesh, "drafter", state, tparams, 16, 16)
        step = make_train_step(loss_fn, opt, mesh, shardings)
        state = jax.device_put(state, shardings[0])
        tp = jax.device_put(tparams, shardings[1])
        losses, batch_devices = [], []
        for bt in batches:
            bt = jax.device_put(bt, shardings[2])
            batch_devices.append(len(bt["input_ids"].sharding.device_set))
            state, metrics = step(state, tp, bt)
            losses.append(float(metrics["loss"]))
        leaves = jax.tree_util.tree_leaves(jax.device_get(state.params))
        np.savez(os.path.join(workdir, f"{name}_params_{mesh.size}.npz"), *leaves)
        res[spec] = {
            "losses": losses,
            "batch_devices": batch_devices,
            "batch_spec": str(shardings[2].spec),
            "fc_spec": str(state.params["fc"]["kernel"].sharding.spec),
            "q_spec": str(state.params["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding.spec),
        }
        mlp = shardings[1]["layers_0"]["mlp"]
        if "experts" in mlp:  # a MoE target: where its frozen experts live
            res[spec]["expert_spec"] = str(mlp["experts"]["down_proj"]["kernel"].spec)
    return res


def check_dry_run(out, workdir):
    res = {}
    for spec in ("tensor=2", "tensor=8"):
        r = dry_run.dry_run_infer(
            "small",
            spec,
            batch=2,
            context=128,
            max_new_tokens=32,
            attention=("xla",),
            step_costs=False,
        )
        res["infer " + spec] = {k: r[k] for k in ("sizes", "programs")}
    r = dry_run.dry_run_train("small", "fsdp=8", batch=8, seq_len=64, num_anchors=2)
    res["train fsdp=8"] = {k: r[k] for k in ("sizes", "programs")}
    res["report"] = dry_run.format_report(r)
    out["dry_run"] = res


def _tiny_test_config(**data):
    from configs import tiny_test

    cfg = tiny_test.get_config()
    cfg.data.update(kind="synthetic", num_docs=64, doc_len=40, seq_len=64, batch_size=8, **data)
    return cfg


def check_fsdp_training(out, workdir):
    """train_and_evaluate on data=2,fsdp=4 and on one device; interrupted at step 3 and
    resumed from the sharded checkpoint; the sharded layout; both exported drafters (.npz)."""
    import dflash_jax as dj

    def config(mesh, **kw):
        cfg = _tiny_test_config()
        cfg.update(
            {
                **dict(
                    num_train_steps=6,
                    log_every=1,
                    eval_every=6,
                    eval_batches=1,
                    eval_num_prompts=4,
                    eval_max_new_tokens=8,
                    checkpoint_every=3,
                    async_checkpoint=False,
                    mesh=mesh,
                ),
                **kw,
            }
        )
        return cfg

    w = os.path.join(workdir, "fsdp_training")
    # tau (the sharded generate) is evaluated in the fsdp run; evaluation does not change the
    # training steps, so the reference and the resumed run skip it.
    one = trainer.train_and_evaluate(config("data=1,fsdp=1,tensor=1", eval_every=0), w + "/one")
    fsdp = trainer.train_and_evaluate(config("data=2,fsdp=4"), w + "/fsdp")
    # Interrupted at step 3 and resumed from the sharded checkpoint.
    trainer.train_and_evaluate(
        config("data=2,fsdp=4", stop_at_step=3, eval_every=0), w + "/resumed"
    )
    resumed = trainer.train_and_evaluate(config("data=2,fsdp=4", eval_every=0), w + "/resumed")
    res = {
        name: {"status": r["status"], "losses": r["losses"], "eval": r["eval"]}
        for name, r in (("one", one), ("fsdp", fsdp), ("resumed", resumed))
    }
    # The layout: which leaves of the drafter/AdamW state and of the frozen target split.
    exp = experiment.build_experiment(config("data=2,fsdp=4"), w + "/fsdp")
    opt, _ = make_optimizer(exp.config, 6)
    state = TrainState(
        step=0,
        params=exp.init_params,
        opt_state=opt.init(exp.init_params),
        rng=jax.random.PRNGKey(0),
    )
    mesh = sharding.make_mesh(data=2, fsdp=4, tensor=1)
    state_sh, frozen_sh, _ = train_shardings(
        mesh, "drafter", state, exp.frozen, exp.target_cfg.head_dim, exp.drafter_cfg.body.head_dim
    )
    res["param_specs"] = [str(s.spec) for s in jax.tree_util.tree_leaves(state_sh.params)]
    res["frozen_specs"] = [str(s.spec) for s in jax.tree_util.tree_leaves(frozen_sh)]
    # The trained drafters, as exported and loaded back.
    for name, r in (("one", one), ("fsdp", fsdp)):
        d = dj.load_drafter(r["export"], target=exp.target_for(None))
        np.savez(
            os.path.join(workdir, f"fsdp_drafter_{name}.npz"), *jax.tree_util.tree_leaves(d.params)
        )
    out["fsdp_training"] = res


if __name__ == "__main__":
    from dflash_jax.models import attention

    # The checks' caches are kilobytes: split by sequence where the mesh cannot split their
    # heads, as a long context's are (`attention.SEQ_SPLIT_MIN_BYTES`, tested on its own).
    attention.SEQ_SPLIT_MIN_BYTES = 0
    workdir = sys.argv[1]
    out = {"num_devices": len(jax.devices())}
    for name in sys.argv[2:]:
        t0 = time.perf_counter()
        globals()["check_" + name](out, workdir)
        out.setdefault("seconds", {})[name] = time.perf_counter() - t0
    print("RESULT " + json.dumps(out))
