"""The HBM model of a decode step (`dflash_jax.dry_run.hbm`) on single-op loops whose HBM
traffic is known, compiled for one TPU v5e chip by libtpu (compile only, no TPU): a matmul of 1
and of 16 rows reads its weights once (the cost analysis counts the 16-row one's VMEM reuse as
extra traffic on some shapes; the model must not), a donated cache update costs its update, not
its cache, and a pad of a cache costs a read and a write of it. Plus the analytic floor by hand
and the collective latency's hop counts."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflash_jax import dry_run
from dflash_jax.dry_run import hbm

CAP = 34304  # a Qwen3-8B cache's capacity at 32K context (positions), one KV head per chip


@pytest.fixture(scope="module")
def chip():
    devices, _ = dry_run.topology_devices("v5e:1x1")
    return NamedSharding(Mesh(np.array(devices[:1]), ("x",)), P())


def _text(chip, fn, *shapes, donate=()):
    args = [jax.ShapeDtypeStruct(s, d, sharding=chip) for s, d in shapes]
    n = jax.ShapeDtypeStruct((), jnp.int32, sharding=chip)
    return jax.jit(fn, donate_argnums=donate).lower(*args, n).compile().as_text()


def _traffic(chip, fn, *shapes, donate=()):
    return hbm.hbm_traffic(_text(chip, fn, *shapes, donate=donate))


def _matmul_loop(w, x, n):
    return jax.lax.fori_loop(0, n, lambda i, c: (c @ w).astype(c.dtype), x)


@pytest.mark.slow  # a libtpu compile
@pytest.mark.parametrize("rows", (1, 16))
def test_a_matmul_reads_its_weights_once_per_step(chip, rows):
    w = 4096 * 4096 * 2
    t = _traffic(chip, _matmul_loop, ((4096, 4096), jnp.bfloat16), ((rows, 4096), jnp.bfloat16))
    assert w <= t["hbm_bytes"] <= 1.01 * w, t


@pytest.mark.slow  # a libtpu compile
def test_a_donated_cache_update_costs_its_update_not_its_cache(chip):
    def update(cache, rows, n):
        step = lambda i, c: jax.lax.dynamic_update_slice(c, rows, (0, i * 16, 0))
        return jax.lax.fori_loop(0, n, step, cache)

    rows = 16 * 128 * 2
    t = _traffic(
        chip,
        update,
        ((1, CAP, 128), jnp.bfloat16),
        ((1, 16, 128), jnp.bfloat16),
        donate=(0,),
    )
    assert rows <= t["hbm_bytes"] <= 4 * rows, t  # the rows read and written, a few scalars
    assert t["by_op"].get("in-place update", 0) >= rows


@pytest.mark.slow  # a libtpu compile
def test_a_pad_of_a_cache_costs_a_read_and_a_write_of_it(chip):
    def pad(cache, rows, n):
        def step(i, c):
            padded = jnp.pad(c, ((0, 0), (0, 511), (0, 0)))  # to a 512 multiple: a new array
            return jax.lax.dynamic_slice(padded, (0, i, 0), c.shape) + rows[:, :1]

        return jax.lax.fori_loop(0, n, step, cache)

    cache = (CAP + 513) * 128 * 2
    t = _traffic(
        chip, pad, ((1, CAP + 513, 128), jnp.bfloat16), ((1, 16, 128), jnp.bfloat16), donate=(0,)
    )
    assert 2 * cache <= t["hbm_bytes"] <= 2.2 * cache, t
    assert t["top_ops"][0]["bytes"] >= cache  # the largest instruction is a cache-sized one


@pytest.mark.slow  # a libtpu compile (Mosaic)
def test_a_routed_grouped_matmul_is_charged_its_routed_experts(chip):
    """A loop step through Qwen3-30B-A3B's expert shapes (up [128, 2048, 768], down [128, 768,
    2048], bfloat16) with 8 rows: the routed kernel (pallas_kernels/grouped_matmul.py) is
    charged the 8 experts its grid can fetch (its declared bytes), ragged_dot all 128. Given a
    routed share (a MoE step's expected share of the experts its tokens route to), each routed
    call is charged share x 128 experts' weights instead of its 8 slots', its rows and output
    as before, and the bound stays beside."""
    from pallas_kernels import backend
    from pallas_kernels.grouped_matmul import routed_gmm

    k, n, e, m = 2048, 768, 128, 8
    expert = 2 * k * n * 2  # an expert's up and down projections

    def loop(fn):
        def run(x, up, down, sizes, steps):
            step = lambda i, c: fn(fn(c, up, sizes), down, sizes).astype(c.dtype)
            return jax.lax.fori_loop(0, steps, step, x)

        return run

    shapes = (
        ((m, k), jnp.bfloat16),
        ((e, k, n), jnp.bfloat16),
        ((e, n, k), jnp.bfloat16),
        ((e,), jnp.int32),
    )
    with backend.compiling_for(chip.mesh):
        text = _text(chip, loop(routed_gmm), *shapes)
    routed = hbm.hbm_traffic(text)
    ragged = _traffic(chip, loop(jax.lax.ragged_dot), *shapes)
    assert m * expert <= routed["hbm_bytes"] < (m + 1) * expert, routed
    assert routed["by_op"].get("kernel (declared bytes)", 0) >= m * expert
    assert ragged["hbm_bytes"] >= e * expert, ragged
    assert "hbm_bytes_bound" not in routed
    share = hbm.routed_fraction(e, 8, 1)  # one token: its 8 rows, 8 distinct experts, = slots
    assert share == 8 / 128
    for s in (share, 0.03, 0.0):
        got = hbm.hbm_traffic(text, routed_share=s)
        # Two calls a step, each m slots of one expert's [k, n] bfloat16 weights declared.
        fewer = 2 * (m - s * e) * k * n * 2
        assert got["hbm_bytes_bound"] == routed["hbm_bytes"], got
        assert abs(got["hbm_bytes"] - (routed["hbm_bytes"] - fewer)) <= 2, (s, got)


@pytest.mark.slow  # a libtpu compile
def test_a_scan_nested_in_the_step_is_charged_its_trip_count(chip):
    """An EAGLE-3 step drafts its K tokens in a `lax.scan` inside the decode loop: the scan's
    body runs K times a step, so K nested 1-row matmuls over weights too large for VMEM (8192^2
    bfloat16, 128 MiB) read them K times (the trip count read from the compiled condition,
    `hlo.trip_count`), not once."""
    from dflash_jax.dry_run import hlo

    def loop(w, x, n):
        def step(i, c):
            inner = lambda c, _: ((c @ w).astype(c.dtype), None)
            return jax.lax.scan(inner, c, None, length=7)[0]

        return jax.lax.fori_loop(0, n, step, x)

    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=chip) for s in ((8192, 8192), (1, 8192))]
    n = jax.ShapeDtypeStruct((), jnp.int32, sharding=chip)
    text = jax.jit(loop).lower(*args, n).compile().as_text()
    times = hlo.loop_body_multiplicity(text)
    assert sorted(set(times.values())) == [1, 7], times  # the step's body once, the scan's 7
    w = 8192 * 8192 * 2
    t = hbm.hbm_traffic(text)
    assert 7 * w <= t["hbm_bytes"] <= 7.1 * w, t


@pytest.mark.slow  # a libtpu compile
@pytest.mark.parametrize("rows", (1, 16))
def test_a_scanned_layer_stack_is_charged_one_layer_per_iteration(chip, rows):
    """A scanned layer stack (`models/layer_stack.py`): each iteration's matmul reads its
    layer's slice of the stacked weights [L, 4096, 4096]; XLA puts the `dynamic-slice` in a
    fusion nested inside the dot's (at 16 rows), and the step is charged L slices, not L whole
    stacks."""
    layers, w = 6, 4096 * 4096 * 2

    def loop(ws, x, n):
        def step(i, c):
            return jax.lax.scan(lambda c, wl: ((c @ wl).astype(c.dtype), None), c, ws)[0]

        return jax.lax.fori_loop(0, n, step, x)

    t = _traffic(chip, loop, ((layers, 4096, 4096), jnp.bfloat16), ((rows, 4096), jnp.bfloat16))
    assert layers * w <= t["hbm_bytes"] <= 1.02 * layers * w, t


@pytest.mark.slow  # a libtpu compile
def test_a_collective_in_a_scanned_stack_counts_every_layer():
    """The all-reduce of a scanned layer stack's body (tensor-parallel o_proj / down_proj) runs
    once per layer: the step's collective count and latency are the nested loop's trip count
    times one layer's, as the looped stack's are."""
    from jax.sharding import PartitionSpec

    devices, _ = dry_run.topology_devices("v5e:2x4")
    mesh = Mesh(np.array(devices), ("t",))

    def layer(c, w):
        part = jax.shard_map(
            lambda c, w: jax.lax.psum(c @ w, "t"),
            mesh=mesh,
            in_specs=(PartitionSpec(None, "t"), PartitionSpec("t", None)),
            out_specs=PartitionSpec(),
        )
        return part(c, w).astype(c.dtype), None

    def loop(ws, x, n):
        return jax.lax.fori_loop(0, n, lambda i, c: jax.lax.scan(layer, c, ws)[0], x)

    sh = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    args = (
        jax.ShapeDtypeStruct((5, 1024, 1024), jnp.bfloat16, sharding=sh(None, "t", None)),
        jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16, sharding=sh()),
        jax.ShapeDtypeStruct((), jnp.int32, sharding=sh()),
    )
    text = jax.jit(loop).lower(*args).compile().as_text()
    count, latency = hbm.loop_collective_latency(text)
    assert count == 5, count
    assert latency == pytest.approx(5 * hbm._hops("all-reduce", 8) * hbm.ICI_HOP_LATENCY_S)


@pytest.mark.slow  # a libtpu compile (Mosaic)
def test_a_stacked_caches_attention_is_charged_one_layer(chip):
    """The decode attention over a scanned stack's cache [L, 1, S, 1, 128] reads one layer,
    picked by its index maps: the step is charged that layer's K and V (its declared bytes),
    not the L-layer operands it is handed; a single cache's kernel is charged the same."""
    from pallas_kernels import backend

    import pallas_kernels as pk

    layers, s, d = 8, 4096, 128
    one = 2 * s * d * 2  # a layer's K and V, bfloat16

    def loop(stacked):
        def run(q, k, v, pos, steps):
            def step(i, c):
                kk, vv = (k, v) if stacked else (k[0], v[0])
                out = pk.verify_attention(
                    c, kk, vv, pos, impl="pallas", layer=jnp.int32(3) if stacked else None
                )
                return out.astype(c.dtype)

            return jax.lax.fori_loop(0, steps, step, q)

        return run

    shapes = lambda lead: (  # noqa: E731
        ((1, 1, 2, d), jnp.bfloat16),
        ((*lead, 1, s, 1, d), jnp.bfloat16),
        ((*lead, 1, s, 1, d), jnp.bfloat16),
        ((1, 1), jnp.int32),
    )
    with backend.compiling_for(chip.mesh):
        stacked = _traffic(chip, loop(True), *shapes((layers,)))
        single = _traffic(chip, loop(False), *shapes((1,)))
    assert one <= stacked["hbm_bytes"] <= 1.05 * one, stacked
    assert stacked["by_op"].get("kernel (declared bytes)", 0) >= one
    assert one <= single["hbm_bytes"] <= 1.05 * one, single


def test_trip_counts_from_the_annotation_or_the_condition():
    """`hlo.trip_count`: XLA's known_trip_count where given, else `counter < constant` read from
    the loop's condition, else 1 (charged once, as an unknown loop always was)."""
    from dflash_jax.dry_run import hlo

    cond = [
        "%c.1 = s32[] constant(0)",
        "%constant.9 = s32[]{:T(128)} constant(15)",
        "%p = (s32[], f32[4]) parameter(0)",
        "%g = s32[]{:T(128)} get-tuple-element(%p), index=0",
        "ROOT %lt.2 = pred[]{:T(512)} compare(%g, %constant.9), direction=LT, metadata={}",
    ]
    comps = {"cond": cond, "cond_ne": [*cond[:-1], cond[-1].replace("LT", "NE")]}
    line = "%w = (s32[], f32[4]) while(%t), condition=%cond, body=%body"
    assert hlo.trip_count(line, comps) == 15
    assert hlo.trip_count(line.replace("%cond,", "%cond_ne,"), comps) == 1
    known = line + ', backend_config={"known_trip_count":{"n":"7"}}'
    assert hlo.trip_count(known, comps) == 7
    assert hlo.trip_count(line.replace("%cond,", "%missing,"), comps) == 1


def test_the_floor_by_hand():
    """Per chip: body weights once, the LM head per verify and per drafter pass, the drafter's
    weights per pass, the KV cache over the filled prefix plus the new rows, the drafter's
    context per pass plus the block's rows."""
    kw = dict(body_weight_bytes=1000, lm_head_bytes=100, drafter_weight_bytes=50)
    caches = dict(cache_bytes=4000, ctx_bytes=400, capacity=400, context=300)
    ar = hbm.floor_bytes(**kw, **caches, rows=1, passes=0)
    assert ar == 1000 + 100 + 10 * 301
    dflash = hbm.floor_bytes(**kw, **caches, rows=16, passes=1)
    assert dflash == 1000 + 200 + 50 + 10 * 316 + 1 * (300 + 16)
    two = hbm.floor_bytes(**kw, **caches, rows=16, passes=2)
    assert two - dflash == 100 + 50 + 300  # one more pass: LM head, drafter, context read
    # EAGLE-3, K = 7 steps of its own layer and LM head (drafter_weight_bytes), the target's
    # LM head at the verify only, its cache read per step:
    eagle3 = hbm.floor_bytes(**kw, **caches, rows=8, passes=7, head_passes=0)
    assert eagle3 == 1000 + 100 + 7 * 50 + 10 * 308 + 7 * 300 + 8


def test_routed_fraction_is_the_share_of_experts_tokens_touch():
    """A MoE floor's expert share: 1 token reads exactly its top-k of E; T tokens the expected
    distinct experts of T independent uniform top-k draws, against a NumPy simulation."""
    assert hbm.routed_fraction(128, 8, 1) == 8 / 128
    assert hbm.routed_fraction(128, 8, 0) == 0.0
    assert hbm.routed_fraction(0, 0, 16) == 1.0  # dense: everything
    rng = np.random.default_rng(0)
    for e, k, t in ((128, 8, 16), (128, 8, 4), (64, 6, 64)):
        picks = np.argsort(rng.random((2000, t, e)), axis=-1)[..., :k]  # uniform top-k sets
        touched = np.array([np.unique(p).size for p in picks.reshape(2000, -1)]) / e
        assert abs(hbm.routed_fraction(e, k, t) - touched.mean()) < 0.01, (e, k, t)


def test_collective_hops_on_a_ring():
    assert hbm._hops("all-reduce", 8) == 8  # reduce-scatter then all-gather, 4 hops each way
    assert hbm._hops("all-gather-start", 8) == 4
    assert hbm._hops("all-to-all", 4) == 2
    assert hbm._hops("collective-permute", 8) == 1


def test_loop_dot_flops_counts_each_matmul_of_one_iteration():
    """The GPU dry run's step FLOPs (`hbm.loop_dot_flops`, XLA:GPU's cost analysis giving none):
    the matmuls of one iteration of the loop as lowered, 2 x rows x K x N each, a 1-row one
    included (XLA:GPU rewrites those into reductions after optimization), a matmul inside a
    nested jit counted at its call and the one outside the loop not at all."""
    inner = jax.jit(lambda x, w: x @ w.T)

    def fn(x, w1, w2, n):
        x = x @ w1  # outside the loop: not a step's
        body = lambda i, x: jnp.tanh(inner(x @ w1, w2))
        return jax.lax.fori_loop(0, n, body, x)

    f32 = jnp.float32
    for rows in (1, 16):
        text = (
            jax.jit(fn)
            .lower(
                jax.ShapeDtypeStruct((rows, 256), f32),
                jax.ShapeDtypeStruct((256, 256), f32),
                jax.ShapeDtypeStruct((256, 256), f32),
                jax.ShapeDtypeStruct((), jnp.int32),
            )
            .as_text(dialect="hlo")
        )
        assert hbm.loop_dot_flops(text) == 2 * (2 * rows * 256 * 256), rows


def test_loop_dot_flops_counts_a_nested_loop_per_trip_and_the_kernels_declared_flops():
    """A loop nested in the step (a scanned layer stack: 3 layers) counts its body once per
    trip (`nested_trips=False`: once, as XLA's cost analysis does); `kernels=True` adds the
    FLOPs a Pallas call declares in its cost estimate, read across the lines the lowered text
    spreads it over."""

    def fn(x, ws, n):
        def step(i, x):
            return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

        return jax.lax.fori_loop(0, n, step, x)

    f32 = jnp.float32
    args = (
        jax.ShapeDtypeStruct((16, 256), f32),
        jax.ShapeDtypeStruct((3, 256, 256), f32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    text = jax.jit(fn).lower(*args).as_text(dialect="hlo")
    layer = 2 * 16 * 256 * 256
    assert hbm.loop_dot_flops(text) == 3 * layer
    assert hbm.loop_dot_flops(text, nested_trips=False) == layer
    kernel = (
        '  k.1 = f32[8]{0} custom-call(a.1), custom_call_target="tpu_custom_call", '
        'backend_config={"custom_call_config": {"body": "x", "cost_estimate": {\n'
        '"bytes_accessed":10,\n"flops":777,\n"transcendentals":0}}}\n'
    )
    lines = text.splitlines(keepends=True)
    at = next(i for i, l in enumerate(lines) if " dot(" in l)  # the layer's matmul
    with_kernel = "".join(lines[: at + 1]) + kernel + "".join(lines[at + 1 :])
    assert hbm.loop_dot_flops(with_kernel, kernels=True) == 3 * (layer + 777)
    assert hbm.loop_dot_flops(with_kernel) == 3 * layer  # (a kernel's FLOPs only when asked)


@pytest.mark.slow  # an XLA:GPU compile
@pytest.mark.skipif(
    dry_run.cuda_plugin_missing(), reason="needs the CUDA build of jax (make test-newest)"
)
def test_a_block_sliced_from_a_cache_viewed_per_head_costs_the_block():
    """A step that reads 16 rows of a cache stored [1, S, K*D] through its per-head view
    [1, S, K, D] (models/attention.py's `_heads`; cuDNN's verify takes the block's keys so):
    XLA:GPU fuses the reshape as a `bitcast` of the fusion's parameter, then `dynamic-slice`s
    it, and the model charges the 16 rows, not the cache (it charged the whole cache before:
    Qwen3-8B's H200 AR step counted 5.06 GB too many, two caches a layer)."""
    devices, _ = dry_run.topology_devices("h200")
    gpu = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), P())

    def loop(cache, q, n):
        def step(i, acc):
            view = cache.reshape(1, CAP, 8, 128)
            blk = jax.lax.dynamic_slice(view, (0, i * 16, 0, 0), (1, 16, 8, 128))
            s = jnp.einsum("bhd,bshd->bh", acc.astype(jnp.float32), blk.astype(jnp.float32))
            return acc + s[..., None].astype(acc.dtype)

        return jax.lax.fori_loop(0, n, step, q)

    args = [((1, CAP, 1024), jnp.bfloat16), ((1, 8, 128), jnp.bfloat16), ((), jnp.int32)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=gpu) for s, d in args]
    text = jax.jit(loop).lower(*args).compile().as_text()
    assert re.search(r"bitcast\(%param", text)  # the view is a bitcast inside the fusion
    block = 16 * 1024 * 2
    t = hbm.hbm_traffic(text)
    assert block <= t["hbm_bytes"] <= 2 * block, t  # the rows and a few small operands
