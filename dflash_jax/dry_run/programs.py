"""The programs a dry run compiles: `generate`'s prefill and decode loops (plus a two-step
loop for one step's cost) and the trainer's own step."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Optional, Sequence, Union

from dflash_jax.dry_run import hbm
from dflash_jax.dry_run import hlo as hlo_scan
from dflash_jax.dry_run.chips import DEFAULT_TAUS, GPU_CHIPS, chip_public, roofline
from dflash_jax.dry_run.compiled import (
    compile_stats,
    moved_bytes,
    tree_bytes,
    tree_bytes_per_device,
)
from dflash_jax.dry_run.presets import abstract_params, build_configs, train_config
from dflash_jax.dry_run.topology import UsageError, platform_name, resolve_mesh


def _loop_program(tmod, dmod, plan, reps: int):
    """The decode while_loop with `reps` steps per iteration (reps=1: `Decoder.decode`, up to
    the jit wrapper); for isolating one step's cost (see the `dflash_jax.dry_run` docstring)."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.decoding.step import Decoder

    def run(tp, dp, state):
        n_buf = state.tokens.shape[1]
        decoder = Decoder(tp, dp, tmod, dmod, plan)

        def body(s):
            for _ in range(reps):
                s = decoder.step(s)
            return s

        return jax.lax.while_loop(lambda s: (~jnp.all(s.done)) & (s.step < n_buf), body, state)

    return run


def _routed_share(tcfg, batch: int, rows: int):
    """A MoE target's expected share of its experts that a step's batch x rows tokens route to
    (`hbm.routed_fraction`: the floor's statistic, and what the routed kernel is charged in the
    compiled step); None for a dense target."""
    if not getattr(tcfg, "num_experts", 0):
        return None
    return hbm.routed_fraction(tcfg.num_experts, tcfg.num_experts_per_tok, batch * rows)


def _floor(
    tcfg, tparams, tshard, dparams, dshard, state, mesh, capacity, context, rows, passes, batch=1,
    head_passes=None,
):  # fmt: skip
    """The analytic per-chip floor of one decode step (`hbm.floor_bytes`) from the per-chip
    sizes of the weights and caches as sharded; a MoE target's experts at the share its
    batch x rows tokens route to (`hbm.routed_fraction`)."""
    import jax

    from dflash_jax.parallel import sharding

    flat = jax.tree_util.tree_flatten_with_path(tparams)[0]
    shards = jax.tree_util.tree_leaves(tshard)
    embed = head = experts = 0
    for (path, x), s in zip(flat, shards):
        keys = "/".join(str(getattr(k, "key", k)) for k in path)
        nbytes = tree_bytes_per_device(x, s)
        if "embed_tokens" in keys:
            embed += nbytes
        elif "lm_head" in keys:
            head += nbytes
        elif "/experts/" in f"/{keys}/":
            experts += nbytes
    total = tree_bytes_per_device(tparams, tshard)
    if tcfg.tie_word_embeddings:
        head = embed  # the LM head is the embedding table, read whole at each LM-head pass
    body = total - embed - (0 if tcfg.tie_word_embeddings else head)
    share = _routed_share(tcfg, batch, rows)
    if share is not None:  # the experts the step's tokens route to, not all of them
        body -= experts - int(experts * share)
    ctx = 0
    if state.ctx is not None:
        ctx = tree_bytes_per_device(state.ctx, sharding.decode_state_sharding(state, mesh).ctx)
    cache, cache_sh = state.cache, sharding.cache_sharding(state.cache, mesh)
    recurrent = 0
    if hasattr(cache, "kv"):  # a hybrid target: K/V per position, recurrent states per sequence
        recurrent = tree_bytes_per_device(
            (cache.conv, cache.state), (cache_sh.conv, cache_sh.state)
        )
        cache, cache_sh = cache.kv, cache_sh.kv
    return hbm.floor_bytes(
        body_weight_bytes=body,
        lm_head_bytes=head,
        drafter_weight_bytes=0 if dparams is None else tree_bytes_per_device(dparams, dshard),
        cache_bytes=tree_bytes_per_device(cache, cache_sh),
        recurrent_bytes=recurrent,
        ctx_bytes=ctx,
        capacity=capacity,
        context=context,
        rows=rows,
        passes=passes,
        head_passes=head_passes,
    )


# DFlash 2's sizes in the published drafters (../shared/docs/dflash.md).
DFLASH2_PUBLISHED = dict(
    conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16
)


# The other drafters a dry run compiles in the DFlash loop's place.
# The dry run's DFlash drafters (`drafter_variant`); every other registered kind is compiled
# through its kind (`other_drafter`).
DFLASH_DRAFTERS = ("dflash", "dflash2")


def other_drafters() -> tuple:
    """The registered drafter kinds besides DFlash: what `other_drafter` compiles."""
    from dflash_jax.drafters import registry

    return tuple(n for n in registry.names() if n not in DFLASH_DRAFTERS)


def other_drafter(tcfg, drafter: str, block_size: int, draft_vocab_size: Optional[int] = None):
    """(module, abstract decode parameters or None, passes, target-LM-head passes) of a drafter
    that is not DFlash, for a target config `tcfg`, as its kind matches one to the target
    (`DrafterKind.for_target`), e.g. "eagle3": one Llama layer at the target's width over its
    default taps, the target's embedding shared, its own LM head over `draft_vocab_size`
    tokens (default the kind's `draft_vocab_default`, at most the vocabulary), drafting
    block_size - 1 tokens one step at a time; "prompt_lookup": no parameters, no pass."""
    from dflash_jax.drafters import registry

    if drafter not in other_drafters():
        raise ValueError(f"drafter must be one of {other_drafters()}, got {drafter!r}")
    kind = registry.named(drafter)
    options = {}
    if kind.draft_vocab_default is not None:
        options["draft_vocab_size"] = draft_vocab_size or kind.draft_vocab_default
    elif draft_vocab_size:
        raise ValueError(f"draft_vocab_size is not a setting of drafter={drafter!r}")
    cfg = kind.for_target(tcfg, block_size, **options)
    return (kind.module(cfg), kind.abstract_params(cfg)) + kind.passes(cfg, block_size)


def drafter_variant(dcfg, drafter: str = "dflash", window: Optional[int] = None):
    """The preset's drafter as `drafter` ("dflash": as is; "dflash2": with DFlash 2's
    convolutions and candidate selector at the published sizes), every layer sliding with
    `window` when given (`DFlashKind.variant`)."""
    from dflash_jax.drafters import registry

    if drafter not in ("dflash", "dflash2"):
        raise ValueError(f"drafter must be dflash or dflash2, got {drafter!r}")
    fields = DFLASH2_PUBLISHED if drafter == "dflash2" else None
    return registry.named("dflash").variant(dcfg, fields, window)


def dry_run_infer(
    model: str = "qwen3_8b",
    mesh: Union[str, dict, Any] = "tensor=8",
    batch: int = 1,
    context: int = 4096,
    max_new_tokens: int = 256,
    block_size: Optional[int] = None,
    dtype: Optional[str] = None,
    devices=None,
    chip: Optional[dict] = None,
    attention: Sequence[str] = ("pallas",),
    step_costs: bool = True,
    prefill_chunk: Optional[int] = None,
    topology: str = "",
    taus: Sequence[float] = DEFAULT_TAUS,
    only: Optional[Sequence[str]] = None,
    hlo_dir: Optional[str] = None,
    tree_budget: Optional[int] = None,
    denoise_steps: int = 1,
    quantize: Optional[str] = None,
    quantize_lm_head: bool = False,
    drafter: str = "dflash",
    drafter_window: Optional[int] = None,
    draft_vocab_size: Optional[int] = None,
    scan_layers: bool = False,
) -> Dict[str, Any]:
    """Compiles the prefill, DFlash decode and autoregressive decode programs of `generate` for
    `model` on `mesh` (over `devices`: a topology's, default the first JAX devices) for each
    attention implementation in `attention`, and, with `step_costs`, one step of each decode
    loop (the roofline's input). context: prompt tokens (padded to a power of two as `generate`
    does); the caches hold context + max_new_tokens (rounded up) + block_size positions.
    only: a subset of ("prefill", "dflash_decode", "ar_decode") to compile (default: all).
    prefill_chunk: overrides `Plan.prefill_chunk` (0: one-pass prefill).
    hlo_dir: write each program's optimized HLO text as `hlo_dir/<program>[@impl].hlo`.
    tree_budget: the DFlash loop verifies a draft tree of this many nodes (B + 1 tokens per
    verify, `dflash_jax.drafters.tree`) instead of the chain.
    denoise_steps: drafter passes per DFlash step (`Plan.denoise_steps`).
    quantize="int8": the target's decoder linears int8 per output channel (`layers.Int8Dense`;
    its LM head too with `quantize_lm_head`), as `load_target(quantize="int8")` loads them.
    drafter: "dflash" or "dflash2" (`drafter_variant`: the published DFlash 2 sizes), or
    another registered kind, e.g. "eagle3" / "prompt_lookup" (`other_drafter`: compiled in the
    DFlash loop's place, the JSON's "dflash_*" entries then that drafter's loop;
    draft_vocab_size: EAGLE-3's draft vocabulary);
    drafter_window: every drafter layer slides with this window (its context cache a ring).
    scan_layers: the target's layers stacked and scanned (`models/layer_stack.py`).
    Returns the dry-run JSON dict (see the `dflash_jax.dry_run` docstring)."""
    import jax

    from dflash_jax.models import attention as attn_lib
    from dflash_jax.parallel import sharding

    tcfg, dcfg = build_configs(model, dtype, quantize, quantize_lm_head)
    tcfg = tcfg.replace(scan_layers=bool(scan_layers))
    tparams, drafted = _infer_drafter(
        tcfg, dcfg, drafter, block_size, tree_budget, denoise_steps, drafter_window,
        draft_vocab_size,
    )  # fmt: skip
    bs, dparams = drafted.block_size, drafted.params
    m = resolve_mesh(mesh, devices)
    gpu = chip is not None and chip.get("chip") in GPU_CHIPS
    job = _InferJob(
        tcfg=tcfg, tparams=tparams, mesh=m, batch=batch, context=context,
        max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk,
        capacity_bytes=None if chip is None else chip["hbm_bytes"], hlo_dir=hlo_dir,
        step_costs=step_costs and (gpu or chip is not None), gpu=gpu,
    )  # fmt: skip
    programs, steps, sizes = {}, {}, {}  # the JSON's entries, filled by `_compile_loops`
    want = {"prefill", "dflash_decode", "ar_decode"} if only is None else set(only)
    for impl_name in attention:
        for kind in ("dflash", "ar"):
            if not ({f"{kind}_decode"} | ({"prefill"} if kind == "dflash" else set())) & want:
                continue
            suffix = "" if impl_name == attention[0] else f"@{impl_name}"
            p_pad = _compile_loops(
                job, drafted if kind == "dflash" else None, kind, impl_name, suffix, want,
                programs, steps, sizes if impl_name == attention[0] else None,
            )  # fmt: skip
    settings = dict(
        batch=batch, context=context, prompt_pad=p_pad, max_new_tokens=max_new_tokens,
        block_size=bs, tree_budget=tree_budget, denoise_steps=denoise_steps, drafter=drafter,
        quantize=quantize, quantize_lm_head=bool(quantize_lm_head), scan_layers=tcfg.scans_layers,
        attention=list(attention),
        # What each became for these devices (e.g. "pallas_cudnn" on an H200).
        compiled_attention={a: attn_lib.for_devices(a, m) for a in attention},
    )  # fmt: skip
    return {
        "topology": topology or platform_name(m),
        "model": model,
        "mode": "infer",
        "mesh": sharding.mesh_str(m),
        "devices": int(m.size),
        "chip": chip_public(chip),
        "settings": settings,
        "sizes": sizes,
        "programs": programs,
        "param_bytes_total": tree_bytes(tparams) + tree_bytes(dparams),
        "backend": jax.default_backend(),
        "roofline": roofline(steps, chip, sizes, attention, taus) if steps else {},
        "notes": [],  # what the figures do not say, printed (none since the [E, I, H] experts)
    }


@dataclasses.dataclass(frozen=True)
class _InferJob:
    """What `dry_run_infer` compiles, whatever the loop: the target, the mesh, the shapes."""

    tcfg: Any
    tparams: Any
    mesh: Any
    batch: int
    context: int
    max_new_tokens: int
    prefill_chunk: Optional[int]
    capacity_bytes: Optional[int]
    hlo_dir: Optional[str]
    step_costs: bool  # the roofline's step figures (a chip to charge them to)
    gpu: bool


@dataclasses.dataclass(frozen=True)
class _InferDrafter:
    """The drafter of `dry_run_infer`'s DFlash loop (another kind's in its place)."""

    module: Any
    params: Any
    block_size: int
    tree_budget: Optional[int]
    denoise_steps: int
    passes: Any
    head_passes: Any


def _infer_drafter(
    tcfg, dcfg, drafter, block_size, tree_budget, denoise_steps, drafter_window, vocab_size
):
    """(the target's abstract parameters, the `_InferDrafter` of `dry_run_infer`'s DFlash
    loop): the preset's DFlash drafter as `drafter` asks (`drafter_variant`), or another
    registered kind's (`other_drafter`), which drafts a chain (no tree, denoising or window)."""
    from dflash_jax.drafters import registry

    if drafter not in DFLASH_DRAFTERS + other_drafters():
        raise ValueError(
            f"drafter must be one of {DFLASH_DRAFTERS + other_drafters()}, got {drafter!r}"
        )
    other = drafter not in DFLASH_DRAFTERS
    if other and (tree_budget is not None or denoise_steps != 1 or drafter_window):
        raise ValueError(f"drafter={drafter!r} drafts a chain: no tree, denoising or window")
    dcfg = dcfg if other else drafter_variant(dcfg, drafter, drafter_window)
    bs = block_size or dcfg.block_size
    tparams, dparams = abstract_params(tcfg, dcfg)
    passes, head_passes = denoise_steps, None
    if other:
        module, dparams, passes, head_passes = other_drafter(tcfg, drafter, bs, vocab_size)
    else:
        module = registry.of(dcfg).module(dcfg)
    return tparams, _InferDrafter(
        module=module, params=dparams, block_size=bs, tree_budget=tree_budget,
        denoise_steps=denoise_steps, passes=passes, head_passes=head_passes,
    )  # fmt: skip


def _compile_loops(job, drafted, kind, impl_name, suffix, want, programs, steps, sizes):
    """One loop's programs of `dry_run_infer` ("dflash": with `drafted`; "ar": None) for the
    attention implementation `impl_name`: the prefill (DFlash's; the AR prefill is it without
    the drafter context), the decode loop with its cache-sized copies, the step figures (a
    two-step loop minus the real one on TPU), and (sizes not None) the size figures. Fills
    `programs`, `steps` and `sizes`; returns the prompt bucket."""
    import jax

    from dflash_jax.decoding.programs import buffer_sizes, generate_programs
    from dflash_jax.decoding.step import Plan
    from dflash_jax.models import attention as attn_lib
    from dflash_jax.models.target import target_module
    from dflash_jax.parallel import sharding

    m, tcfg, tparams = job.mesh, job.tcfg, job.tparams
    impl = attn_lib.for_devices(impl_name, m)
    k_bs = 1 if drafted is None else drafted.block_size
    plan_kw = {} if job.prefill_chunk is None else dict(prefill_chunk=job.prefill_chunk)
    tree = None if drafted is None else drafted.tree_budget
    if drafted is not None and drafted.denoise_steps != 1:
        plan_kw["denoise_steps"] = drafted.denoise_steps
    plan = Plan(block_size=k_bs, attention_impl=impl, tree_budget=tree, **plan_kw)
    width = k_bs if tree is None else tree + 1  # verified tokens (cache rows) per step
    p_pad, n_buf, capacity = buffer_sizes(job.context, job.max_new_tokens, width)
    tmod = target_module(tcfg, impl)
    dmod = None if drafted is None else drafted.module
    dp = None if drafted is None else drafted.params
    prefill_jit, decode_jit, sh = generate_programs(
        tmod, dmod, plan, capacity, n_buf, m, tparams, dp, job.batch, p_pad
    )
    tp_a = sharding.with_shardings(tparams, sh["tparams"])
    dp_a = None if dp is None else sharding.with_shardings(dp, sh["dparams"])
    ids, lens, max_new, key = sh["arg_shapes"]
    ids = jax.ShapeDtypeStruct(ids.shape, ids.dtype, sharding=sh["ids"])
    lens = jax.ShapeDtypeStruct(lens.shape, lens.dtype, sharding=sh["lens"])
    state = sharding.with_shardings(sh["state_shape"], sh["state"])

    def hlo(name):
        return None if not job.hlo_dir else os.path.join(job.hlo_dir, name + suffix + ".hlo")

    with sharding.compiling_for(m):
        if kind == "dflash" and "prefill" in want:
            programs["prefill" + suffix] = compile_stats(
                lambda: prefill_jit.lower(tp_a, dp_a, ids, lens, max_new, key),
                job.capacity_bytes,
                hlo("prefill"),
            )
        if f"{kind}_decode" not in want:
            return p_pad  # (no size figures: as for a loop not compiled)
        loop, text, lowered = _decode_loop(
            lambda: decode_jit.lower(tp_a, dp_a, state),
            job.capacity_bytes,
            hlo(f"{kind}_decode"),
            capacity * max(1, tcfg.num_kv_heads // m.shape["tensor"]) * tcfg.head_dim,
            capacity,
        )
        programs[f"{kind}_decode" + suffix] = loop
        if job.step_costs and loop["flops"] is not None:
            twice = None
            if not job.gpu:  # the cost analysis' step: a two-step loop minus the real one
                two_jit = jax.jit(
                    _loop_program(tmod, dmod, plan, 2),
                    in_shardings=(sh["tparams"], sh["dparams"], sh["state"]),
                    out_shardings=sh["state"],
                    donate_argnums=(2,),
                )
                twice = compile_stats(lambda: two_jit.lower(tp_a, dp_a, state), None)
            steps[f"{kind}_step" + suffix] = _step_figures(
                loop, text, lowered, twice, _routed_share(tcfg, job.batch, width)
            )
    if sizes is not None:
        sizes.update(
            _size_figures(
                kind, sh, tparams, dp, tcfg, m, capacity, job.context, width,
                0 if drafted is None else drafted.passes, job.batch,
                0 if drafted is None else drafted.head_passes,
            )
        )  # fmt: skip
    return p_pad


def _decode_loop(lower, capacity_bytes, hlo_path, cache_elems, capacity):
    """(the decode loop's compile stats, its optimized HLO text, its lowered HLO text), with
    the loop body's instructions that copy a cache-sized buffer (pad, copy, transpose,
    concatenate, relayout: `hlo.cache_sized_copies`) at the smallest per-chip cache
    (`cache_elems`: KV heads per chip x head_dim x capacity)."""
    loop = compile_stats(lower, capacity_bytes, hlo_path, keep_text=True)
    text = loop.pop("hlo_text", None)
    lowered = loop.pop("lowered_hlo_text", None)
    if text is not None:
        loop["cache_sized_copies"] = hlo_scan.cache_sized_copies(text, capacity, cache_elems)
    return loop, text, lowered


def _step_figures(loop, text, lowered, twice, routed_share=None) -> Dict[str, Any]:
    """One decode step's figures. On a TPU (`twice`: the stats of the loop with two steps per
    iteration) the cost analysis' FLOPs, bytes and collectives as the difference from the real
    loop (with a nested loop's further trips' matmuls and kernels added); on a GPU (`twice`
    None: XLA:GPU's cost analysis gives no FLOPs or bytes) the matmuls of the lowered loop
    body, one GPU, no collectives. Both with the HBM model
    (`dry_run.hbm`: one iteration of the real loop's body is one step; no differencing; a MoE
    target's routed kernels at `routed_share` of their experts, the bound kept beside)."""
    if twice is None:
        step = {
            "flops": hbm.loop_dot_flops(lowered),
            "flops_source": "matmuls of the lowered loop body (hbm.loop_dot_flops)",
            "bytes_accessed": None,
            "collective_moved_bytes": moved_bytes(loop),
        }
    else:
        step = {
            "flops": twice["flops"] - loop["flops"],
            "bytes_accessed": twice["bytes_accessed"] - loop["bytes_accessed"],
            "collective_moved_bytes": moved_bytes(twice) - moved_bytes(loop),
            "collectives_per_step": sum(c["count"] for c in twice["collectives"])
            - sum(c["count"] for c in loop["collectives"]),
            "loop_flops": loop["flops"],
        }
        if text is not None and any(n > 1 for n in hlo_scan.loop_body_multiplicity(text).values()):
            # A loop nested in the step (a scanned layer stack, EAGLE-3's drafting steps): the
            # cost analysis counts its body once; its further trips' matmuls and kernels are
            # added (their other ops, elementwise, stay counted once).
            once = hbm.loop_dot_flops(lowered, nested_trips=False, kernels=True)
            step["flops"] += hbm.loop_dot_flops(lowered, kernels=True) - once
            step["flops_source"] = (
                "cost analysis, plus the matmuls and kernels of a nested loop's further trips "
                "(hbm.loop_dot_flops; the cost analysis counts a nested body once)"
            )
    traffic = hbm.hbm_traffic(text, routed_share=routed_share)
    count, latency = hbm.loop_collective_latency(text)
    if "hbm_bytes_bound" in traffic:
        step.update(hbm_bytes_bound=traffic["hbm_bytes_bound"], routed_share=routed_share)
    step.update(
        hbm_bytes=traffic["hbm_bytes"],
        hbm_by_op=traffic["by_op"],
        top_ops=traffic["top_ops"],
        loop_collectives=count,
        collective_latency_s=latency,
    )
    return step


def _size_figures(
    kind, sh, tparams, dp, tcfg, m, capacity, context, width, passes, batch=1, head_passes=None
):
    """Per-device bytes of the caches and parameters of one kind of decode ("dflash", "ar")
    and the analytic floor of its step (`_floor`)."""

    st = sh["state_shape"]
    caches = [st.cache] + ([st.ctx] if st.ctx is not None else [])
    shardings = [sh["state"].cache] + ([sh["state"].ctx] if st.ctx is not None else [])
    ctx_bytes = (
        {}
        if st.ctx is None
        else {  # the drafter's context cache alone (a ring of its window when it slides)
            f"{kind}_context_cache_bytes": tree_bytes_per_device(st.ctx, sh["state"].ctx)
        }
    )
    return {
        **ctx_bytes,
        f"{kind}_cache_bytes": sum(
            tree_bytes_per_device(c, s) for c, s in zip(caches, shardings)
        ),
        f"{kind}_param_bytes": tree_bytes_per_device(tparams, sh["tparams"])
        + (0 if dp is None else tree_bytes_per_device(dp, sh["dparams"])),
        f"{kind}_floor_bytes": _floor(
            tcfg, tparams, sh["tparams"], dp, sh["dparams"], st, m, capacity, context, width,
            passes, batch, head_passes,
        ),
    }  # fmt: skip


def _train_inputs(state, state_sh, tparams, frozen_sh, batch_sh, batch: int, seq_len: int):
    """The train step's abstract arguments in their shardings: the drafter's train state, the
    frozen target, and a batch of `batch` packed sequences of `seq_len` tokens."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.parallel import sharding

    batch_shapes = {
        "input_ids": jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
        "loss_mask": jax.ShapeDtypeStruct((batch, seq_len), jnp.float32),
        "segment_ids": jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
    }
    return (
        sharding.with_shardings(state, state_sh),
        sharding.with_shardings(tparams, frozen_sh),
        jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sh), batch_shapes
        ),
    )


def dry_run_train(
    model: str = "qwen3_8b",
    mesh: Union[str, dict, Any] = "fsdp=8",
    batch: int = 8,
    seq_len: int = 3072,
    num_anchors: int = 512,
    dtype: Optional[str] = None,
    devices=None,
    chip: Optional[dict] = None,
    loss_chunk_anchors: int = 0,
    attention_impl: str = "xla",
    config=None,
    topology: str = "",
    grad_accum_steps: int = 1,
) -> Dict[str, Any]:
    """Compiles the trainer's own step (`make_train_step` with `train_shardings` and
    `drafter_loss_fn`) for `model` on `mesh`: global `batch` sequences of `seq_len`, the
    recipe of `config` (default: configs/default.py with these settings), the batch in
    `grad_accum_steps` micro-batches (the config's `grad_accum_steps` when a config is given).
    Drafter weights and their AdamW moments in the config's drafter.param_dtype (float32 by
    default; "": the target's dtype), as the trainer stores them; the frozen target in its
    dtype."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.drafters import registry
    from dflash_jax.models.config import as_dtype
    from dflash_jax.models.target import target_module
    from dflash_jax.parallel import sharding
    from dflash_jax.training.drafter_setup import drafter_loss_fn
    from dflash_jax.training import step as train_step
    from dflash_jax.training.step import TrainState, make_optimizer, make_train_step

    if config is None:
        config = train_config(
            batch, seq_len, num_anchors, loss_chunk_anchors, attention_impl, grad_accum_steps
        )
    batch, seq_len = config.data.batch_size, config.data.seq_len
    accum = int(config.get("grad_accum_steps", 1))
    tcfg, dcfg = build_configs(model, dtype)
    if config.drafter.get("param_dtype"):  # the trainer's storage dtype of the drafter weights
        dcfg = dcfg.replace(
            body=dcfg.body.replace(param_dtype=as_dtype(config.drafter.param_dtype))
        )
    m = resolve_mesh(mesh, devices)
    try:
        train_step.check_grad_accum(batch, accum, m.shape["data"] * m.shape["fsdp"])
    except ValueError as e:
        raise UsageError(str(e)) from None
    capacity_bytes = None if chip is None else chip["hbm_bytes"]
    tparams, dparams = abstract_params(tcfg, dcfg)
    tmod, dmod = target_module(tcfg, config.attention_impl), registry.of(dcfg).module(dcfg)
    optimizer = make_optimizer(config, 10000)[0]
    state = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=dparams,
        opt_state=jax.eval_shape(optimizer.init, dparams),
        rng=jax.eval_shape(lambda: jax.random.PRNGKey(0)),
    )
    state_sh, frozen_sh, batch_sh = train_step.train_shardings(
        m, "drafter", state, tparams, tcfg.head_dim, registry.of(dcfg).head_dim(dcfg)
    )
    step = make_train_step(
        drafter_loss_fn(config, tmod, dmod),
        optimizer,
        m,
        (state_sh, frozen_sh, batch_sh),
        donate=True,
        grad_accum_steps=accum,
    )
    args = _train_inputs(state, state_sh, tparams, frozen_sh, batch_sh, batch, seq_len)
    with sharding.compiling_for(m):
        stats = compile_stats(lambda: step.lower(*args), capacity_bytes)
    settings = dict(
        batch=batch, seq_len=seq_len, num_anchors=config.num_anchors, block_size=dcfg.block_size,
        loss_chunk_anchors=config.loss_chunk_anchors, attention=config.attention_impl,
        grad_accum_steps=accum, drafter_param_dtype=jnp.dtype(dcfg.body.param_dtype).name,
    )  # fmt: skip
    sizes = dict(
        param_bytes=tree_bytes_per_device(tparams, frozen_sh)
        + tree_bytes_per_device(dparams, state_sh.params),
        opt_bytes=tree_bytes_per_device(state.opt_state, state_sh.opt_state),
        param_bytes_total=tree_bytes(tparams) + tree_bytes(dparams),
        opt_bytes_total=tree_bytes(state.opt_state),
    )
    return {
        "topology": topology or platform_name(m),
        "model": model,
        "mode": "train",
        "mesh": sharding.mesh_str(m),
        "devices": int(m.size),
        "chip": chip_public(chip),
        "settings": settings,
        "sizes": sizes,
        "programs": {"train_step": stats},
        "roofline": {},
        "backend": jax.default_backend(),
    }
