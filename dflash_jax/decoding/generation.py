"""`generate` and `Generator`: the API of generation. The settings checked once, then per call
the prompts checked, the plan and buffers chosen, the programs compiled (or found compiled),
run, and read back, as a short sequence of named steps;
the algorithm is `step.py`, the programs `programs.py`, the checks and the result `request.py`."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding.programs import _Compiled, buffer_sizes, generate_programs
from dflash_jax.decoding.request import (
    GenerationResult,
    Request,
    Settings,
    collect,
    gather_multiprocess,
)
from dflash_jax.decoding.step import Plan
from dflash_jax.drafters import registry
from dflash_jax.models import attention as attn_lib
from dflash_jax.models.target import target_module
from dflash_jax.parallel import sharding
from dflash_jax.support import checks


def generate(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    block_size: Optional[int] = None,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: int = 0,
    stop_token_ids: Sequence[int] = (),
    denoise_steps: int = 1,
    confidence_threshold: Optional[float] = None,
    return_drafts: bool = False,
    attention_impl: Optional[str] = None,
    stream_callback: Optional[Callable[[List[List[int]]], None]] = None,
    mesh=None,
    prefill_chunk: Optional[int] = None,
    tree_budget: Optional[int] = None,
    denoise_schedule: str = "confidence",
    remask: bool = False,
    draft_sampling: Optional[str] = None,
) -> GenerationResult:
    """Generates continuations of `prompts` (lists of token ids) with DFlash (or another
    drafter of a registered kind, `drafters.registry`: `PromptLookup`, an EAGLE-3 `Eagle3`), or
    autoregressively when `drafter` is None. See `GenerationResult` for what it returns.

    stream_callback: called on the host with, per sequence, the token ids just committed: once
    after prefill (the first token), then after every decode step. Concatenated, the calls give
    `result.tokens`. Streaming adds one host callback per step; leave it None for speed.
    mesh: a `jax.sharding.Mesh` (see `dflash_jax.parallel.sharding.make_mesh`): the same programs run
    sharded on it (parameters by the partition rules, batch over data axes, KV heads over
    `tensor`); stats then also name the mesh and the cache sharding.
    prefill_chunk: prompts longer than this are prefilled this many tokens at a time (default
    `Plan.prefill_chunk`; 0: one pass). Same tokens either way.
    tree_budget: verify a draft tree of this many nodes per step (`dflash_jax.drafters.tree`: the most
    probable prefixes of depth <= block_size - 1 under the drafter's one pass) instead of the
    chain of block_size - 1 drafts; None: the chain. Same tokens either way (lossless). With
    denoise_steps > 1 the tree is built from the K passes' distributions (`DFlashKind.draft_logprobs`).
    denoise_schedule: which positions each of the denoise_steps passes fixes, "confidence"
    (the most confident) or "fixed" (left to right); remask: a fixed low-confidence token may
    be masked and predicted again (denoise_steps >= 3, "confidence"). They change the drafts,
    never the output.
    draft_sampling: how a drafter drafts at temperature > 0: "sample" (each draft sampled from
    the drafter's distribution under the same temperature / top-k / top-p, verified by
    rejection sampling against it: the reference implementations' rule) or "argmax" (its most
    probable drafts, verified as one-hot proposals); None: the drafter's default
    (`DrafterKind.default_draft_sampling`: "sample"; a DFlash tree or denoising passes
    draft from the argmax). Lossless either way; it changes the acceptance. Temperature > 0
    only (refused at 0, where every drafter drafts its argmax).
    """
    given = locals()
    settings = Settings.of({name: given[name] for name in Settings.names()})
    gen = Generator(target, drafter, settings, mesh=mesh, attention_impl=attention_impl)
    return gen(prompts, max_new_tokens, stream_callback=stream_callback)


@dataclasses.dataclass(frozen=True, eq=False)  # (its models hold arrays: no ==)
class Generator:
    """A target and a drafter (None: autoregressive) with their generation `Settings`, checked
    once and called per batch of prompts (gemma's `Sampler`): the pair, the loaded drafter,
    every setting, the mesh's expert axis and the attention implementation are checked when it
    is built; a call checks only its prompts. `generate` is one `Generator` called once.

        gen = Generator(target, drafter, Settings(temperature=0.7, stop_token_ids=(2,)))
        for b, batch in enumerate(batches):
            result = gen(batch, max_new_tokens=128, seed=b)

    settings: as given (checked now) or already checked against equal configs
    (`Settings.check`): then not checked again.
    mesh / attention_impl: `generate`'s. Raises ValueError (one line) naming what is refused.
    """

    target: object
    drafter: object = None
    settings: Settings = Settings()
    mesh: object = None
    attention_impl: Optional[str] = None

    def __post_init__(self):
        tcfg = self.target.config
        dcfg = self.drafter.config if self.drafter is not None else None
        settings = self.settings
        if not isinstance(settings, Settings):
            raise TypeError(f"settings must be a Settings, got {type(settings).__name__}")
        registry.of(self.drafter).check_loaded(self.drafter, tcfg)  # the pair, as loaded
        if not settings.is_checked_for(tcfg, dcfg):
            settings = settings.check(tcfg, dcfg, pair_checked=True)
        if self.mesh is not None:
            sharding.check_expert_axis(self.mesh.shape.get("expert", 1), tcfg.num_experts)
        # "pallas" / "auto" made concrete for the devices compiled for (the mesh's).
        impl = attn_lib.for_devices(self.attention_impl or self.target.attention_impl, self.mesh)
        object.__setattr__(self, "settings", settings)
        object.__setattr__(self, "attention_impl", impl)

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        seed: Optional[int] = None,
        stream_callback: Optional[Callable[[List[List[int]]], None]] = None,
        labels: Optional[Sequence[str]] = None,
    ) -> GenerationResult:
        """Generates continuations of `prompts` (`generate`). seed: this call's (None: the
        settings'); labels: how a bad prompt is named (`Request.of`)."""
        settings = self.settings
        if seed is not None:
            settings = dataclasses.replace(settings, seed=checks.seed_param("seed", seed))
        request = Request.of(settings, prompts, max_new_tokens, labels=labels)
        target, drafter, mesh = self.target, self.drafter, self.mesh
        plan = request.plan(self.attention_impl, stream_callback)
        args, shape = _inputs(request)
        (prefill_x, decode_x, placement), compile_s = _programs(
            target, drafter, plan, args, shape, mesh
        )
        tparams = target.params
        dparams = _drafter_params(drafter)
        if placement is not None:  # put parameters and inputs where the sharded programs want them
            from dflash_jax.parallel import distributed  # put: also across processes (pod hosts)

            tsh, dsh, arg_sh = placement
            tparams = distributed.put(tparams, tsh)
            dparams = None if dparams is None else distributed.put(dparams, dsh)
            args = tuple(distributed.put(a, s) for a, s in zip(args, arg_sh))
        state, times = _run(prefill_x, decode_x, tparams, dparams, args, stream_callback)
        times += (compile_s,)
        if mesh is not None and jax.process_count() > 1:
            state, times = gather_multiprocess(state, plan, times)
        b = len(request.prompts)
        result = collect(state, plan, b, prefill_s=times[0], decode_s=times[1], compile_s=times[2])
        if mesh is not None:
            result.stats.update(
                mesh=sharding.mesh_str(mesh), cache_sharding=str(state.cache.k[0].sharding.spec)
            )
            ctx_k = getattr(state.ctx, "k", None)  # a DFlash drafter's context cache
            if isinstance(ctx_k, tuple) and ctx_k and hasattr(ctx_k[0], "sharding"):
                result.stats["context_sharding"] = str(ctx_k[0].sharding.spec)
        return result


def _drafter_params(drafter):
    """What the programs take as the drafter's parameters (`Decoder.dparams`): its kind's
    `decode_params` (e.g. EAGLE-3's parameters, d2t and own embedding)."""
    if drafter is None:
        return None
    return registry.of(drafter).decode_params(drafter)


def _inputs(request: Request):
    """The programs' inputs (prompts right-padded to their bucket, lengths, max_new_tokens,
    the PRNG key) and their static shape (batch, padded prompt, output buffer, cache slots)."""
    prompts, settings = request.prompts, request.settings
    lens = np.array([len(p) for p in prompts], np.int32)
    tree = settings.tree_budget
    width = settings.block_size if tree is None else tree + 1  # cache slots one step writes
    p_pad, n_buf, capacity = buffer_sizes(int(lens.max()), request.max_new_tokens, width)
    ids = np.zeros((len(prompts), p_pad), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    args = (
        jnp.asarray(ids),
        jnp.asarray(lens),
        jnp.asarray(request.max_new_tokens, jnp.int32),
        jax.random.PRNGKey(settings.seed),
    )
    return args, (len(prompts), p_pad, n_buf, capacity)


def _programs(target, drafter, plan: Plan, args, shape, mesh):
    """((prefill, decode, placement), seconds compiling): the compiled executables of this
    plan and shape, found in `_Compiled` or built now. placement: None on one device, else the
    (target, drafter, input) shardings the sharded programs take their arguments in."""
    b, p_pad, n_buf, capacity = shape
    tmod = target_module(target.config, plan.attention_impl)
    dmod = drafter.module if drafter is not None else None
    tparams = target.params
    dparams = _drafter_params(drafter)
    key = (
        tmod,
        dmod,
        plan,
        b,
        p_pad,
        n_buf,
        capacity,
        mesh,
        _layout(tparams),
        _layout(dparams),  # shapes too: a kind's module need not imply its parameters' shapes
        registry.loop_of(dmod),  # the kind drafting in the loop (a test's oracle: its own)
    )

    # Plans differing only in what the decode loop reads share one prefill executable: its own
    # entry in `_Compiled`, keyed by `Plan.prefill_plan()` (so every reset of the table drops it).
    prefill_key = key[:2] + (plan.prefill_plan(),) + key[3:] + ("prefill",)

    def build():
        prefill_jit, decode_jit, sh = generate_programs(
            tmod, dmod, plan, capacity, n_buf, mesh, tparams, dparams, b, p_pad
        )
        if sh is None:  # one device: lowered on the arrays as they are placed
            state = jax.eval_shape(prefill_jit, tparams, dparams, *args)
            prefill_x, _ = _Compiled.get(
                prefill_key, lambda: prefill_jit.lower(tparams, dparams, *args).compile()
            )
            return prefill_x, decode_jit.lower(tparams, dparams, state).compile(), None
        repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        arg_sh = (sh["ids"], sh["lens"], repl, repl)
        # Lowered on shapes: the arrays may be placed otherwise (e.g. a trainer's FSDP
        # layout); they are moved to the programs' shardings by the caller.
        shapes = lambda tree: jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree
        )
        tp_s, dp_s = shapes(tparams), shapes(dparams)
        with sharding.compiling_for(mesh):  # kernels for the mesh's platform
            prefill_x, _ = _Compiled.get(
                prefill_key, lambda: prefill_jit.lower(tp_s, dp_s, *shapes(args)).compile()
            )
            return (
                prefill_x,
                decode_jit.lower(tp_s, dp_s, sh["state_shape"]).compile(),
                (sh["tparams"], sh["dparams"], arg_sh),
            )

    return _Compiled.get(key, build)


def _layout(tree):
    """What a compiled program fixes of a pytree of parameters: its structure and each leaf's
    shape and dtype (hashable: part of `_Compiled`'s key)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)


def _run(prefill_x, decode_x, tparams, dparams, args, stream_callback):
    """The prefill and the decode loop, timed apart: (final state, (prefill_s, decode_s))."""
    t0 = time.perf_counter()
    state = prefill_x(tparams, dparams, *args)
    jax.block_until_ready(state.tokens)
    t1 = time.perf_counter()
    if stream_callback is not None:
        stream_callback([[int(t)] for t in np.asarray(state.tokens[:, 0])])
    state = decode_x(tparams, dparams, state)
    jax.block_until_ready(state.tokens)
    jax.effects_barrier()
    t2 = time.perf_counter()
    return state, (t1 - t0, t2 - t1)
