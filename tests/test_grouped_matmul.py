"""The grouped matmul of few rows (issue 42): `pallas_kernels/grouped_matmul.py` and its use by
the MoE block (`dflash_jax/models/moe.py`).

- The routed Pallas TPU kernel (interpret mode) and the gather dispatch equal a float64 NumPy
  statement of ragged_dot (out[r] = rows[r] @ weights[expert of r], 0 past the groups) and
  ragged_dot itself: no group with rows, one expert, every expert, ragged sizes with zeros,
  rows past the groups' sum; float32 and bfloat16; more experts than rows and fewer.
- The kernel's declared cost: its bytes are the weight blocks its index map fetches over its
  grid (a new block at each change of block index) for the active-expert list it prefetches,
  at most min(E, M) experts, plus the rows and the output; a read of all E experts would not
  pass the same assertion.
- The MoE block through the routed kernel and the gather dispatch equals it through ragged_dot,
  on one device and as the expert-parallel shards compute it (rows of other shards' experts
  sorted past the last group, partial outputs summed); the dispatch rule per program shape.
- The kernel compiled for TPU (Mosaic, libtpu) at Qwen3-30B-A3B expert shapes: XLA's bytes
  for it scale with min(E, M) experts, ragged_dot's with E (slow: a TPU compile).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gm

M, K, N = 13, 32, 256  # 13 rows: not a multiple of the sublane tile (8 / 16)
TILE_N = 128  # two N tiles


def _reference(rows, weights, sizes):
    """ragged_dot in float64 NumPy: row r of group e (sizes[:e].sum() <= r < sizes[:e+1].sum())
    times weights[e]; rows past the groups' sum are 0."""
    x = np.asarray(rows, np.float64)
    w = np.asarray(weights, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    r = 0
    for e, size in enumerate(sizes):
        for _ in range(int(size)):
            if r < x.shape[0]:
                out[r] = x[r] @ w[e]
            r += 1
    return out


# (experts, group sizes) with sum <= M = 13.
PATTERNS = {
    "none": (6, [0, 0, 0, 0, 0, 0]),
    "one_expert": (6, [0, 0, 13, 0, 0, 0]),
    "every_expert": (6, [2, 3, 1, 4, 2, 1]),
    "ragged_with_zeros": (6, [0, 5, 0, 1, 7, 0]),
    "rows_past_the_sum": (6, [1, 0, 3, 0, 0, 2]),
    "last_expert_only": (6, [0, 0, 0, 0, 0, 4]),
    "more_experts_than_rows": (20, [0] * 3 + [2, 0, 0, 1] + [0] * 9 + [3, 0, 0, 1]),
}
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-4), jnp.bfloat16: dict(rtol=2e-2, atol=5e-2)}


@pytest.mark.parametrize("layout", ["EKN", "ENK"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("fn", ["routed", "routed_plain", "gather"])
def test_grouped_matmul_equals_ragged_dot(fn, dtype, layout):
    """routed: the TPU interpret mode; routed_plain: Pallas' generic interpreter (what the
    decode loop's interpret path runs, under shard_map too). ENK: the weights given transposed,
    [E, N, K] (`transposed=True`), against the statement on their transpose."""
    rs = np.random.RandomState(0)
    t = layout == "ENK"
    run = {
        "routed": lambda x, w, s: gm.routed_gmm(
            x, w, s, interpret=True, tile_n=TILE_N, transposed=t
        ),
        "routed_plain": lambda x, w, s: gm.routed_gmm(
            x, w, s, interpret="plain", tile_n=TILE_N, transposed=t
        ),
        "gather": lambda x, w, s: gm.gather_gmm(x, w, s, transposed=t),
    }[fn]
    for name, (e, sizes) in PATTERNS.items():
        x = jnp.asarray(rs.randn(M, K), dtype)
        w = jnp.asarray(rs.randn(e, K, N), dtype)
        gs = jnp.asarray(sizes, jnp.int32)
        got = run(x, jnp.swapaxes(w, 1, 2) if t else w, gs)
        assert got.shape == (M, N) and got.dtype == dtype, name
        got = np.asarray(got.astype(jnp.float32))
        want = _reference(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
        np.testing.assert_allclose(got, want, **TOL[dtype], err_msg=name)
        ragged = np.asarray(jax.lax.ragged_dot(x, w, gs).astype(jnp.float32))
        np.testing.assert_allclose(got, ragged, **TOL[dtype], err_msg=name)
        assert not got[sum(sizes) :].any(), name  # rows past the groups: exactly 0
        if sum(sizes):
            assert np.abs(got[: sum(sizes)]).max() > 1.0, name


@pytest.mark.parametrize("layout", ["EKN", "ENK"])
@pytest.mark.parametrize("interpret", [True, "plain"], ids=["routed", "routed_plain"])
def test_the_routed_kernel_reads_a_layer_of_a_stack(interpret, layout):
    """`routed_gmm(..., layer=i)` over a scanned layer stack [L, E, K, N] (or [L, E, N, K],
    transposed; the layer index a scalar prefetch, traced) equals the NumPy statement on layer
    i's experts, and no other layer's weights reach the output."""
    rs = np.random.RandomState(1)
    t = layout == "ENK"
    for name in ("every_expert", "ragged_with_zeros", "more_experts_than_rows"):
        e, sizes = PATTERNS[name]
        x = jnp.asarray(rs.randn(M, K), jnp.float32)
        stack = jnp.asarray(rs.randn(3, e, K, N), jnp.float32)
        gs = jnp.asarray(sizes, jnp.int32)
        run = jax.jit(
            lambda x, w, s, i: gm.routed_gmm(
                x, w, s, interpret=interpret, tile_n=TILE_N, layer=i, transposed=t
            )
        )
        given = jnp.swapaxes(stack, 2, 3) if t else stack
        for i in (0, 2):
            got = np.asarray(run(x, given, gs, jnp.int32(i)))
            want = _reference(x, stack[i], sizes)
            np.testing.assert_allclose(got, want, **TOL[jnp.float32], err_msg=(name, i))
            assert np.abs(got[: sum(sizes)]).max() > 1.0, name


def test_active_expert_list():
    """The experts with rows in order, the tail repeating the last of them (0 when none)."""
    for sizes, slots, want in (
        ([0, 3, 0, 2, 0], 4, [1, 3, 3, 3]),
        ([0, 0, 0], 2, [0, 0]),
        ([0, 0, 5], 3, [2, 2, 2]),
        ([1, 1, 1], 3, [0, 1, 2]),
    ):
        ids, count = gm.active_experts(jnp.asarray(sizes, jnp.int32), slots)
        assert np.asarray(ids).tolist() == want and int(count) == sum(s > 0 for s in sizes)


def _pallas_call_params(fn, *args):
    """The params of the one pallas_call in fn's jaxpr (cost_estimate, grid_mapping, ...)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(eqn.params)
            for p in eqn.params.values():
                sub = getattr(p, "jaxpr", None)
                if sub is not None:
                    walk(getattr(sub, "jaxpr", sub))

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    assert len(found) == 1
    return found[0]


def _fetched_weight_blocks(sizes, grid):
    """Weight blocks the kernel's pipeline fetches over `grid` (N tiles outer, expert slots
    inner): its own index map (`gm.weight_block`) at each step, over the active-expert list
    written here from the sizes (experts with rows, in order, the last repeated), counting a
    fetch wherever the block index differs from the previous step's (the first step's too)."""
    active = [e for e, s in enumerate(sizes) if s > 0]
    n_tiles, slots = grid
    ids = np.array((active + [active[-1] if active else 0] * slots)[:slots], np.int32)
    assert np.asarray(gm.active_experts(jnp.asarray(sizes, jnp.int32), slots)[0]).tolist() == (
        ids.tolist()
    )  # the list the kernel prefetches
    fetched, prev = 0, None
    for j in range(n_tiles):
        for s in range(slots):
            block = tuple(int(i) for i in gm.weight_block(j, s, None, ids, None))
            fetched += block != prev
            prev = block
    return fetched


def _assert_declared(weight_bytes_read, rows_bytes, out_bytes, declared):
    """The declared bytes are the weight bytes read plus the rows block and the output."""
    assert weight_bytes_read + rows_bytes + out_bytes == declared, (
        weight_bytes_read + rows_bytes + out_bytes,
        declared,
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_declared_bytes_are_what_the_index_maps_fetch(dtype):
    """For each shape: the declared bytes_accessed (the pallas_call's own CostEstimate) are the
    weight blocks fetched at the most experts the grid can see active (min(E, M)) plus the
    rows and the output, and no pattern of group sizes fetches more; fewer active experts fetch
    proportionally less. Control: a dense read of all E experts fails the same assertion."""
    item = jnp.dtype(dtype).itemsize
    tm = 32 // item  # the rows' sublane tile
    for m, e, patterns in (
        (5, 16, ([0] * 16, [0] * 15 + [5], [1, 0, 2] + [0] * 12 + [2], [1] * 5 + [0] * 11)),
        (13, 6, ([0] * 6, [0, 13, 0, 0, 0, 0], [0, 5, 0, 1, 7, 0], [2, 3, 1, 4, 2, 1])),
    ):
        args = (
            jax.ShapeDtypeStruct((m, K), dtype),
            jax.ShapeDtypeStruct((e, K, N), dtype),
            jax.ShapeDtypeStruct((e,), jnp.int32),
        )
        params = _pallas_call_params(
            lambda x, w, s: gm.routed_gmm(x, w, s, interpret=True, tile_n=TILE_N), *args
        )
        declared = params["cost_estimate"].bytes_accessed
        grid = tuple(params["grid_mapping"].grid)
        assert grid == (N // TILE_N, min(e, m))  # expert slots bounded by min(E, M)
        block = K * TILE_N * item
        mp = -(-m // tm) * tm
        rows_bytes, out_bytes = mp * K * item, mp * N * item
        fetched = {tuple(p): _fetched_weight_blocks(p, grid) * block for p in patterns}
        for p, got in fetched.items():
            n_active = sum(s > 0 for s in p)
            assert got == max(n_active, 1) * K * N * item, p  # each active expert once
            assert got + rows_bytes + out_bytes <= declared, p
        busiest = patterns[-1]  # min(E, M) experts with rows: the grid's most
        assert sum(s > 0 for s in busiest) == min(e, m)
        _assert_declared(fetched[tuple(busiest)], rows_bytes, out_bytes, declared)
        assert declared == gm.cost(m, K, N, e, dtype, dtype).bytes_accessed
        if e > m:  # the control: all E experts read
            with pytest.raises(AssertionError):
                _assert_declared(e * K * N * item, rows_bytes, out_bytes, declared)


# ------------------------------------------------------------------------- the MoE block --
def _moe_config():
    """test_moe.py's small Qwen3-MoE shapes: hidden 32, 8 experts of width 16, top 2."""
    from dflash_jax.models.tiny import tiny_config

    return tiny_config(
        "qwen3_moe",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        head_dim=8,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        num_experts=8,
        moe_intermediate_size=16,
    )


@pytest.fixture(scope="module")
def moe_block():
    from dflash_jax.models import moe

    cfg = _moe_config()
    x = jnp.asarray(np.random.RandomState(1).randn(2, 40, 32), jnp.float32)
    params = moe.SparseMoE(cfg).init(jax.random.PRNGKey(0), x[:, :1])
    # larger than lecun init: outputs well away from 0, so a wrong row would show
    params = jax.tree_util.tree_map(lambda p: p * 4.0, params)
    return cfg, params, x


def _block(cfg, params, x, impl, method):
    """SparseMoE(x) under attention impl `impl`, checking that its matmuls run `method`."""
    from dflash_jax.models import moe

    b, t, _ = x.shape
    assert moe.gmm_method(b * t * cfg.num_experts_per_tok, cfg.num_experts, impl) == method
    return np.asarray(moe.SparseMoE(cfg, impl).apply(params, x))


def test_moe_block_through_the_routed_paths_equals_ragged_dot(moe_block, monkeypatch):
    """The block's output through the routed kernel (pallas_interpret) and the gather dispatch
    (xla, 2 rows of 8 experts) equals it with ragged_dot forced (DFLASH_MOE_GMM=ragged)."""
    from dflash_jax.models import moe

    cfg, params, x = moe_block
    for tokens, impl, method in (
        (x[:1, :1], "xla", "gather"),  # 2 rows, 8 experts: 3 x 2 < 8
        (x[:1, :1], "pallas_interpret", "routed_interpret"),
        (x[:1, :3], "pallas_interpret", "routed_interpret"),  # 6 rows
        (x, "pallas_interpret", "routed_interpret"),  # 160 rows: every expert busy
        (x[:1, :3], "xla", "ragged"),  # 3 x 6 >= 8: the gather would move more
    ):
        got = _block(cfg, params, tokens, impl, method)
        monkeypatch.setattr(moe, "MOE_GMM", "ragged")
        want = _block(cfg, params, tokens, "xla", "ragged")
        monkeypatch.setattr(moe, "MOE_GMM", "auto")
        scale = np.abs(want).max()  # float32 sums in another order: tolerance at its scale
        assert scale > 0.1
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * scale, err_msg=(impl, method))


def test_expert_parallel_shards_through_the_routed_paths(moe_block):
    """`expert_ffn` as each expert-parallel shard runs it (its 2 of the 8 experts, the pairs of
    other shards' experts sorted past its last group), summed over the 4 shards as the psum
    does, equals the one-device ragged_dot block, through every method."""
    from dflash_jax.models import moe

    cfg, params, x = moe_block
    p = params["params"]
    tokens = x[0, :3]  # 6 pairs
    weights, ids = moe.route(tokens, p["gate"]["kernel"], 2, True)
    ex = {n: p["experts"][n]["kernel"] for n in ("gate_proj", "up_proj", "down_proj")}
    want = moe.expert_ffn(tokens, weights, ids, *ex.values())
    for impl in ("xla", "pallas_interpret"):
        assert moe.gmm_method(6, 2, impl) == ("ragged" if impl == "xla" else "routed_interpret")
        total = sum(
            moe.expert_ffn(
                tokens, weights, ids, *(w[2 * i : 2 * i + 2] for w in ex.values()), 2 * i, impl
            )
            for i in range(4)
        )
        atol = 1e-6 * float(jnp.abs(want).max())
        np.testing.assert_allclose(total, want, rtol=1e-5, atol=atol, err_msg=impl)
    # Shards of 7 + 1 experts: 6 rows against 7 local experts, the routed and the gather paths.
    for impl, method in (("xla", "gather"), ("pallas_interpret", "routed_interpret")):
        big = slice(0, 7)
        assert moe.gmm_method(2, 7, impl) == method
        one = tokens[:1]  # 2 pairs
        w1, i1 = weights[:1], ids[:1]
        want1 = moe.expert_ffn(one, w1, i1, *ex.values())
        parts = moe.expert_ffn(one, w1, i1, *(w[big] for w in ex.values()), 0, impl)
        parts += moe.expert_ffn(one, w1, i1, *(w[7:] for w in ex.values()), 7, impl)
        atol = 1e-6 * float(jnp.abs(want1).max())
        np.testing.assert_allclose(parts, want1, rtol=1e-5, atol=atol, err_msg=impl)


def test_dispatch_rule_per_program_shape(monkeypatch):
    """Few rows (<= ROUTED_MAX_ROWS): the routed kernel under a TPU Pallas impl (on the
    platform compiled for), the gather dispatch elsewhere where 3 x rows < E; ragged_dot for
    more rows (prefill, training) and under DFLASH_MOE_GMM=ragged."""
    from dflash_jax.models import moe
    from pallas_kernels import backend

    e = 128  # Qwen3-30B-A3B; rows = tokens x top-8
    with backend.compiling_for("tpu"):
        assert moe.gmm_method(8, e, "pallas") == "routed"  # AR step, batch 1
        assert moe.gmm_method(128, e, "auto") == "routed"  # a block of 16
        assert moe.gmm_method(128, 16, "pallas_tpu") == "routed"  # expert=8: 16 per device
        assert moe.gmm_method(512, e, "pallas") == "routed"
        assert moe.gmm_method(513, e, "pallas") == "ragged"  # prefill / training
        assert moe.gmm_method(8, e, "xla") == "gather"
    with backend.compiling_for("cpu"):
        assert moe.gmm_method(8, e, "auto") == "gather"
        assert moe.gmm_method(42, e, "xla") == "gather"
        assert moe.gmm_method(43, e, "xla") == "ragged"  # 3 x 43 >= 128
        assert moe.gmm_method(8, e, "pallas_interpret") == "routed_interpret"
        assert moe.gmm_method(4096, e, "xla") == "ragged"
    monkeypatch.setattr(moe, "MOE_GMM", "ragged")
    with backend.compiling_for("tpu"):
        assert moe.gmm_method(8, e, "pallas") == "ragged"
    monkeypatch.setattr(moe, "MOE_GMM", "gather")
    with backend.compiling_for("tpu"):
        assert moe.gmm_method(8, e, "pallas") == "gather"


@pytest.mark.slow  # a TPU compile
def test_routed_kernel_compiles_for_tpu_and_reads_min_e_m_experts():
    """Compiled for a v5e chip (Mosaic, from this CPU process) at Qwen3-30B-A3B expert shapes
    (K 2048, N 768, 128 experts, bfloat16): XLA's bytes for the kernel are its declared
    min(E, M) experts (8 rows: 8 experts; 64 rows: 64), ragged_dot's all 128 at any rows."""
    from dflash_jax import dry_run
    from pallas_kernels import backend

    if dry_run.libtpu_missing():
        pytest.skip('needs libtpu: pip install "jax[tpu]"')
    devices, _ = dry_run.topology_devices("v5e:2x4")
    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    k, n, e, bf = 2048, 768, 128, jnp.bfloat16
    expert = k * n * 2

    def bytes_of(fn, m):
        args = (
            jax.ShapeDtypeStruct((m, k), bf, sharding=one),
            jax.ShapeDtypeStruct((e, k, n), bf, sharding=one),
            jax.ShapeDtypeStruct((e,), jnp.int32, sharding=one),
        )
        with backend.compiling_for(mesh):
            lowered = jax.jit(fn).lower(*args)
            cost = lowered.compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return lowered.as_text(), cost["bytes accessed"]

    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)  # as users compile (conftest)
    try:
        for m in (8, 64):
            text, routed = bytes_of(gm.routed_gmm, m)
            assert "tpu_custom_call" in text
            assert min(e, m) * expert <= routed < (min(e, m) + 1) * expert, (m, routed)
            _, ragged = bytes_of(lambda x, w, s: jax.lax.ragged_dot(x, w, s), m)
            assert ragged >= e * expert, (m, ragged)
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@pytest.mark.slow  # three TPU compiles of the kernel
def test_transposed_expert_slices_reach_the_tpu_kernel_without_a_copy():
    """A chip's slice of 64 experts' gate projection at Qwen3.5-35B-A3B's shapes under tensor=8
    (hidden 2048, a 64-wide slice of the 512 width, bfloat16), compiled for v5e with the full
    optimizations users get. Given [E, H, 64] (the control) libtpu stores it transposed and the
    program copies every expert into the kernel's row-major read: a weight-sized copy,
    temporaries twice the weights. Given [E, 64, H] (`transposed=True`, H minor) the kernel
    reads it where it lies: no copy, temporaries under 1 MB, XLA's bytes those of min(E, M)
    experts; a scanned stack [L, E, 64, H] read at a traced layer too."""
    import re

    from dflash_jax import dry_run
    from pallas_kernels import backend

    if dry_run.libtpu_missing():
        pytest.skip('needs libtpu: pip install "jax[tpu]"')
    devices, _ = dry_run.topology_devices("v5e:2x4")
    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    e, h, w, m, bf = 64, 2048, 64, 8, jnp.bfloat16
    expert = h * w * 2

    def compiled(shape, **kw):
        args = [jax.ShapeDtypeStruct(s, d, sharding=one) for s, d in
                (((m, h), bf), (shape, bf), ((e,), jnp.int32))]  # fmt: skip
        fn = lambda x, wt, s: gm.routed_gmm(x, wt, s, **kw)  # noqa: E731
        if "layer" in kw:
            args.append(jax.ShapeDtypeStruct((), jnp.int32, sharding=one))
            fn = lambda x, wt, s, i: gm.routed_gmm(x, wt, s, transposed=True, layer=i)  # noqa: E731
        with backend.compiling_for(mesh):
            c = jax.jit(fn).lower(*args).compile()
        cost = c.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        dims = ",".join(map(str, shape))
        weight_copies = re.findall(rf"= bf16\[{dims}\]\S* copy\(", c.as_text())
        return weight_copies, c.memory_analysis().temp_size_in_bytes, cost["bytes accessed"]

    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)  # as users compile (conftest)
    try:
        copies, temps, read = compiled((e, h, w))
        assert copies and temps >= e * expert, (copies, temps)  # the control
        for shape, kw in (((e, w, h), {}), ((3, e, w, h), {"layer": None})):
            copies, temps, read = compiled(shape, transposed=True, **kw)
            assert copies == [] and temps < 2**20, (shape, copies, temps)
            assert m * expert <= read < (m + 2) * expert, (shape, read / expert)
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@pytest.mark.slow  # three TPU compiles of a MoE decode loop
def test_the_tpu_decode_loop_reads_the_routed_experts(monkeypatch):
    """The AR decode loop of Qwen3-30B-A3B's layers (preset qwen3_30b_a3b_2l: 2 layers of 128
    experts [2048 -> 768 -> 2048], top 8) compiled for a v5e chip with the Pallas kernels: by
    the HBM model (the routed kernel charged the experts a step's tokens route to on average,
    `hbm.routed_fraction`, its declared bound beside), the expert matmuls of a step read 8 of
    128 experts at batch 1 (8 rows: bound and average alike) and 82.4 at batch 16 (128 rows:
    the bound all 128); the control, ragged_dot (DFLASH_MOE_GMM=ragged), reads all 128 at batch
    1, which the batch-1 assertion rejects."""
    from dflash_jax import dry_run
    from dflash_jax.models import moe

    if dry_run.libtpu_missing():
        pytest.skip('needs libtpu: pip install "jax[tpu]"')
    devices, chip = dry_run.topology_devices("v5e:2x4")
    kw = dict(context=128, max_new_tokens=16, devices=devices[:1], chip=chip)
    kw.update(attention=("pallas",), only=("ar_decode",))

    def expert_reads(batch):
        r = dry_run.dry_run_infer("qwen3_30b_a3b_2l", "tensor=1", batch=batch, **kw)
        step = r["roofline"]["steps"]["ar_step"]
        by_op = step["hbm_by_op"]
        above = step["hbm_bytes_bound"] - step["hbm_bytes"]  # the bound's further experts
        return by_op.get("kernel (declared bytes)", 0) + by_op.get("kernel", 0), by_op, above

    expert = 3 * 2048 * 768 * 2 * 2  # gate, up, down in bfloat16, x 2 layers
    one, by_op, above = expert_reads(1)
    assert 8 * expert <= one < 10 * expert and above == 0, (one / expert, by_op)
    sixteen, _, above = expert_reads(16)
    routed = 128 * (1 - (1 - 8 / 128) ** 16)  # 82.4 experts expected of 128
    assert routed * expert <= sixteen < (routed + 1) * expert, sixteen / expert
    assert 128 * expert <= sixteen + above < 129 * expert, (sixteen + above) / expert
    # The scanned layer stack: the routed kernel reads each layer's experts in the stack where
    # they lie (a slice handed to the kernel was a copy of all 128 experts a layer each step).
    kw["scan_layers"] = True
    scanned, scanned_by_op, _ = expert_reads(1)
    assert 8 * expert <= scanned < 10 * expert, (scanned / expert, scanned_by_op)
    total = lambda ops: sum(ops.values())  # noqa: E731 - every op's bytes a step
    assert total(scanned_by_op) < total(by_op) + expert, (scanned_by_op, by_op)
    kw["scan_layers"] = False
    monkeypatch.setattr(moe, "MOE_GMM", "ragged")
    dense, _, _ = expert_reads(1)
    assert dense >= 128 * expert, dense / expert
    assert not 8 * expert <= dense < 10 * expert  # the control fails the routed assertion


def test_an_unknown_interpret_mode_is_one_line():
    x, w, s = jnp.ones((4, 8)), jnp.ones((2, 8, 128)), jnp.asarray([2, 2], jnp.int32)
    with pytest.raises(ValueError, match=r"interpret must be False, True or 'plain', got 'tpu'"):
        gm.routed_gmm(x, w, s, interpret="tpu")
