"""The compiled programs of generation: the prefill and the decode loop of a `Decoder`, jitted
with shardings for a mesh (`generate_programs`), their buffer sizes (bucketed so other lengths
reuse a program) and the bounded cache of compiled executables (`_Compiled`)."""

from __future__ import annotations

import collections
import os
import time

import jax
import jax.numpy as jnp

from dflash_jax.decoding.step import Decoder, Plan
from dflash_jax.drafters import registry
from dflash_jax.parallel import sharding


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, int(n - 1).bit_length()))


# Cache capacities are multiples of the decode kernels' KV tile (the TPU kernel's 512-slot tile;
# 128 below it), so no kernel pads, i.e. copies, a cache to its tile in any step.
KV_TILE, KV_TILE_SMALL = 512, 128


def cache_capacity(slots: int) -> int:
    """`slots` rounded up to a multiple of the KV tile (of 128 while under one tile)."""
    tile = KV_TILE if slots > KV_TILE else KV_TILE_SMALL
    return -(-int(slots) // tile) * tile


def buffer_sizes(prompt_len: int, max_new_tokens: int, block_size: int):
    """(p_pad, n_buf, capacity) of one program: the prompt bucket, the output buffer and the
    cache slots. Bucketed (powers of two) so that other lengths within a bucket reuse the
    compiled program. n_buf >= max_new_tokens is enough: a row is done once it holds
    max_new_tokens tokens, so a block never writes past p_pad + n_buf - 2 + block_size."""
    p_pad = _bucket(int(prompt_len), 16)
    n_buf = _bucket(int(max_new_tokens), 32)
    return p_pad, n_buf, cache_capacity(p_pad + n_buf + int(block_size))


def generate_programs(
    tmod,
    dmod,
    plan: Plan,
    capacity: int,
    n_buf: int,
    mesh,
    tparams,
    dparams,
    batch: int,
    prompt_len: int,
):
    """(prefill_jit, decode_jit, shardings): `Decoder.prefill` and `Decoder.decode` (these are
    their only `jax.jit`s; the decode state donated) with in/out shardings fixed for
    `mesh`: parameters by the partition rules, prompts and per-sequence state over the batch
    axes, caches B over batch and K over tensor; GSPMD propagates them through the layers and the `while_loop`. With
    `mesh=None` (one device) no shardings are fixed and `shardings` is None.

    shardings: dict(tparams, dparams, ids, lens, state, state_shape, arg_shapes), for lowering
    on abstract values (`sharding.with_shardings`). `tparams` / `dparams` may be shapes.
    """

    def prefill(tp, dp, ids, lens, max_new, key):
        return Decoder(tp, dp, tmod, dmod, plan).prefill(capacity, n_buf, ids, lens, max_new, key)

    def decode(tp, dp, state):
        return Decoder(tp, dp, tmod, dmod, plan).decode(state)

    if mesh is None:
        return jax.jit(prefill), jax.jit(decode, donate_argnums=(2,)), None
    tsh = sharding.param_shardings(tparams, mesh, sharding.target_rules(), tmod.cfg.head_dim)
    dsh = (
        None
        if dparams is None
        else sharding.param_shardings(
            dparams, mesh, sharding.target_rules(), registry.loop_of(dmod).head_dim(dmod.cfg)
        )
    )
    repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    ids_sh = jax.sharding.NamedSharding(mesh, sharding.batch_spec((batch, prompt_len), mesh))
    lens_sh = jax.sharding.NamedSharding(mesh, sharding.batch_spec((batch,), mesh))
    arg_shapes = (
        jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.eval_shape(lambda: jax.random.PRNGKey(0)),
    )
    with sharding.compiling_for(mesh):  # traces the prefill: kernels for the mesh's platform
        state_shape = jax.eval_shape(prefill, tparams, dparams, *arg_shapes)
    state_sh = sharding.decode_state_sharding(state_shape, mesh)
    prefill_jit = jax.jit(
        prefill, in_shardings=(tsh, dsh, ids_sh, lens_sh, repl, repl), out_shardings=state_sh
    )
    decode_jit = jax.jit(
        decode, in_shardings=(tsh, dsh, state_sh), out_shardings=state_sh, donate_argnums=(2,)
    )
    shardings = dict(
        tparams=tsh,
        dparams=dsh,
        ids=ids_sh,
        lens=lens_sh,
        state=state_sh,
        state_shape=state_shape,
        arg_shapes=arg_shapes,
    )
    return prefill_jit, decode_jit, shardings


class _Compiled:
    """AOT-compiled (prefill, decode) executables keyed by their static configuration, so
    compile time is measured apart and new prompt lengths within a bucket never recompile.
    A prefill is an entry of its own too (key ending "prefill", its Plan reduced by
    `Plan.prefill_plan`), shared by the configurations that differ only in decode settings.
    Bounded: at most `max_entries` entries stay (least recently used goes first), so a
    long-lived process (a server, a notebook sweeping settings) does not keep every program it
    ever built; `DFLASH_COMPILED_PROGRAMS` sets the bound (default 32: 16 configurations with
    prefills of their own).
    Programs that stream keep only the latest callback's (a new function each call would
    otherwise keep every program alive)."""

    cache: "collections.OrderedDict" = collections.OrderedDict()
    max_entries: int = int(os.environ.get("DFLASH_COMPILED_PROGRAMS", "32"))

    @classmethod
    def get(cls, key, build):
        """(executables, seconds spent compiling now: 0 on a hit). key[2] is the Plan."""
        if key in cls.cache:
            cls.cache.move_to_end(key)
            return cls.cache[key], 0.0
        if key[2].stream is not None:
            for old in [k for k in cls.cache if k[2].stream not in (None, key[2].stream)]:
                del cls.cache[old]
        t0 = time.perf_counter()
        built = build()
        cls.cache[key] = built
        while len(cls.cache) > max(1, cls.max_entries):
            cls.cache.popitem(last=False)
        return built, time.perf_counter() - t0
