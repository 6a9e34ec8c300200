"""Tests for pallas_kernels: references vs brute force, kernels (interpret mode) vs references.

Runs on CPU: both Pallas variants execute in interpret mode (TPU kernels via
pltpu.InterpretParams, Triton kernels via the HLO interpreter).  Shapes are
tiny and tile sizes forced small so that padding, multiple tiles, multiple
splits and tile skipping are all exercised.
"""

import contextlib

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np
import pytest

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import backend, reference  # noqa: E402

VARIANTS = ["pallas_tpu", "pallas_triton"]
ATOL = 2e-5


def _rand(rng, *shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


# ----------------------------------------------------- brute-force numpy ----
def _np_attend(q, k, v, visible, scale):
    """q [T,Hq,D], k/v [S,Hkv,D], visible(t, j) -> bool. Plain loops."""
    t_len, hq, d = q.shape
    g = hq // k.shape[1]
    out = np.zeros((t_len, hq, d))
    for t in range(t_len):
        js = [j for j in range(k.shape[0]) if visible(t, j)]
        if not js:
            continue
        for h in range(hq):
            kh = h // g
            s = np.array([np.dot(q[t, h], k[j, kh]) * scale for j in js], np.float64)
            w = np.exp(s - s.max())
            w /= w.sum()
            out[t, h] = sum(wi * v[j, kh] for wi, j in zip(w, js))
    return out


def _np_verify(q, k, v, pos):
    q, k, v, pos = map(np.asarray, (q, k, v, pos))
    scale = q.shape[-1] ** -0.5
    return np.stack(
        [
            _np_attend(q[b], k[b], v[b], lambda t, j: j <= pos[b, t], scale)
            for b in range(q.shape[0])
        ]
    )


def _np_draft(q, ck, cv, clen, bk, bv):
    q, ck, cv, clen, bk, bv = map(np.asarray, (q, ck, cv, clen, bk, bv))
    c = ck.shape[1]
    scale = q.shape[-1] ** -0.5
    outs = []
    for b in range(q.shape[0]):
        k = np.concatenate([ck[b], bk[b]])
        v = np.concatenate([cv[b], bv[b]])
        outs.append(_np_attend(q[b], k, v, lambda t, j: j >= c or j < clen[b], scale))
    return np.stack(outs)


def _np_training(q, kc, vc, kb, vb, anchors, valid, bs, inclusive=False, ctx_start=None):
    q, kc, vc, kb, vb, anchors, valid = map(np.asarray, (q, kc, vc, kb, vb, anchors, valid))
    start = np.zeros_like(anchors) if ctx_start is None else np.asarray(ctx_start)
    s_len = kc.shape[1]
    scale = q.shape[-1] ** -0.5
    outs = []
    for b in range(q.shape[0]):
        k = np.concatenate([kc[b], kb[b]])
        v = np.concatenate([vc[b], vb[b]])

        def visible(t, j, b=b):
            n = t // bs
            if not valid[b, n]:
                return False
            if j < s_len:
                if j < start[b, n]:
                    return False
                return j <= anchors[b, n] if inclusive else j < anchors[b, n]
            return (j - s_len) // bs == n

        outs.append(_np_attend(q[b], k, v, visible, scale))
    return np.stack(outs)


def test_reference_verify_matches_brute_force():
    rng = np.random.default_rng(0)
    q, k, v = _rand(rng, 2, 3, 4, 8), _rand(rng, 2, 11, 2, 8), _rand(rng, 2, 11, 2, 8)
    pos = jnp.array([[0, 1, 2], [8, 9, 10]], jnp.int32)
    np.testing.assert_allclose(
        reference.verify_attention(q, k, v, pos), _np_verify(q, k, v, pos), atol=1e-5
    )


def test_reference_draft_matches_brute_force():
    rng = np.random.default_rng(1)
    q = _rand(rng, 3, 4, 4, 8)
    ck, cv = _rand(rng, 3, 9, 1, 8), _rand(rng, 3, 9, 1, 8)
    bk, bv = _rand(rng, 3, 4, 1, 8), _rand(rng, 3, 4, 1, 8)
    clen = jnp.array([0, 5, 9], jnp.int32)
    np.testing.assert_allclose(
        reference.draft_attention(q, ck, cv, clen, bk, bv),
        _np_draft(q, ck, cv, clen, bk, bv),
        atol=1e-5,
    )


def test_reference_training_matches_brute_force_and_catches_le_trap():
    rng = np.random.default_rng(2)
    bs, n, s_len = 3, 4, 10
    q = _rand(rng, 2, n * bs, 4, 8)
    kc, vc = _rand(rng, 2, s_len, 2, 8), _rand(rng, 2, s_len, 2, 8)
    kb, vb = _rand(rng, 2, n * bs, 2, 8), _rand(rng, 2, n * bs, 2, 8)
    anchors = jnp.array([[0, 3, 7, 9], [2, 2, 5, 8]], jnp.int32)
    valid = jnp.array([[True, True, False, True], [True, True, True, False]])
    ref = np.asarray(reference.training_attention(q, kc, vc, kb, vb, anchors, valid, block_size=bs))
    good = _np_training(q, kc, vc, kb, vb, anchors, valid, bs)
    np.testing.assert_allclose(ref, good, atol=1e-5)
    # Rows of invalid blocks are exactly zero.
    assert np.all(ref[0, 2 * bs : 3 * bs] == 0) and np.all(ref[1, 3 * bs :] == 0)
    # The `<=` anchor trap: an implementation attending to slot `anchor` must
    # fail the very same check.
    trap = _np_training(q, kc, vc, kb, vb, anchors, valid, bs, inclusive=True)
    assert not np.allclose(ref, trap, atol=1e-3)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(trap, good, atol=1e-5)


def test_reference_training_ctx_start_matches_brute_force():
    """ctx_start[b,n] <= j < anchors[b,n]: a lower bound (empty when ctx_start >=
    anchor) that the reference must honour exactly."""
    rng = np.random.default_rng(12)
    bs, n, s_len = 3, 4, 10
    q = _rand(rng, 2, n * bs, 4, 8)
    kc, vc = _rand(rng, 2, s_len, 2, 8), _rand(rng, 2, s_len, 2, 8)
    kb, vb = _rand(rng, 2, n * bs, 2, 8), _rand(rng, 2, n * bs, 2, 8)
    anchors = jnp.array([[4, 3, 7, 9], [2, 6, 5, 8]], jnp.int32)
    start = jnp.array([[0, 3, 2, 5], [1, 7, 0, 6]], jnp.int32)  # == / > anchor too
    valid = jnp.array([[True, True, True, True], [True, True, True, False]])
    ref = np.asarray(
        reference.training_attention(
            q, kc, vc, kb, vb, anchors, valid, block_size=bs, ctx_start=start
        )
    )
    np.testing.assert_allclose(
        ref, _np_training(q, kc, vc, kb, vb, anchors, valid, bs, ctx_start=start), atol=1e-5
    )
    # The bound matters: ignoring it gives a different answer.
    assert not np.allclose(ref, _np_training(q, kc, vc, kb, vb, anchors, valid, bs), atol=1e-3)
    # ctx_start = 0 is the default.
    np.testing.assert_array_equal(
        reference.training_attention(
            q, kc, vc, kb, vb, anchors, valid, block_size=bs, ctx_start=jnp.zeros_like(anchors)
        ),
        reference.training_attention(q, kc, vc, kb, vb, anchors, valid, block_size=bs),
    )


def test_reference_training_grads_finite_for_invalid_blocks():
    rng = np.random.default_rng(3)
    q = _rand(rng, 1, 4, 2, 8)
    kc, vc = _rand(rng, 1, 5, 1, 8), _rand(rng, 1, 5, 1, 8)
    kb, vb = _rand(rng, 1, 4, 1, 8), _rand(rng, 1, 4, 1, 8)
    anchors = jnp.array([[0, 3]], jnp.int32)
    valid = jnp.array([[False, True]])
    grads = jax.grad(
        lambda *x: jnp.sum(reference.training_attention(*x, anchors, valid, block_size=2) ** 2),
        argnums=(0, 1, 2, 3, 4),
    )(q, kc, vc, kb, vb)
    for g in grads:
        assert np.all(np.isfinite(g))
    assert np.all(grads[0][0, :2] == 0)  # invalid block: zero dq


# ------------------------------------------------------------- backend ------
def test_backend_resolution():
    assert backend.resolve("auto", platform="cpu") == "xla"
    assert backend.resolve("auto", platform="tpu") == "tpu"
    assert backend.resolve("auto", platform="gpu") == backend._default_gpu_variant()
    assert backend.resolve("pallas", platform="cuda") == backend._default_gpu_variant()
    assert backend.resolve("cudnn", platform="gpu") == "cudnn"
    with pytest.raises(ValueError, match="GPU only"):
        backend.resolve("cudnn", interpret=True, platform="cpu")
    assert backend.resolve("xla", platform="tpu") == "xla"
    assert backend.resolve("pallas", interpret=True, platform="cpu") == "tpu"
    assert backend.resolve("pallas_triton", interpret=True, platform="cpu") == "triton"
    with pytest.raises(ValueError):
        backend.resolve("pallas", platform="cpu")
    with pytest.raises(ValueError):
        backend.resolve("pallas_tpu", platform="gpu")
    with pytest.raises(ValueError):
        backend.resolve("bogus")
    with pytest.raises(NotImplementedError, match="Mosaic GPU"):
        backend.resolve("pallas_mosaic_gpu", interpret=True)


@pytest.mark.parametrize(
    "version,has_triton,kind,want",
    [
        ((0, 10, 2), True, "NVIDIA H200", "triton"),  # Triton not deprecated yet
        ((0, 10, 2), True, "NVIDIA A100-SXM4-80GB", "triton"),
        ((0, 11, 2), True, "NVIDIA H200", "cudnn"),  # deprecated: Hopper -> cuDNN
        ((0, 12, 0), True, "NVIDIA GH200 480GB", "cudnn"),
        ((0, 12, 0), True, "NVIDIA B200", "cudnn"),
        ((0, 12, 0), True, "NVIDIA A100-SXM4-80GB", "triton"),  # pre-Hopper keeps Triton
        ((0, 12, 0), True, "NVIDIA L4", "triton"),
        ((0, 13, 0), False, "NVIDIA A100-SXM4-80GB", "cudnn"),  # Triton gone
    ],
)
def test_backend_gpu_default_by_jax_version_and_device_kind(
    monkeypatch, version, has_triton, kind, want
):
    monkeypatch.delenv("DFLASH_PALLAS_GPU_BACKEND", raising=False)
    monkeypatch.setattr(backend, "jax_version", lambda: version)
    monkeypatch.setattr(backend, "triton_available", lambda: has_triton)
    monkeypatch.setattr(backend, "_gpu_device_kind", lambda: kind)
    assert backend._default_gpu_variant() == want
    assert backend.resolve("auto", platform="gpu") == want
    if not has_triton:
        with pytest.raises(ValueError, match="no longer ships"):
            backend.resolve("pallas_triton", platform="gpu")
    monkeypatch.setenv("DFLASH_PALLAS_GPU_BACKEND", "triton" if want == "cudnn" else "cudnn")
    assert backend._default_gpu_variant() != want  # the override wins


def test_gpu_variant_follows_the_devices_compiled_for(monkeypatch):
    """On jax >= 0.11 the GPU variant is chosen by the device kind of the devices compiled for
    (an abstract H200's: cuDNN, what a real H200 runs), not the local GPU's, in `resolve` and
    in `attention.for_devices`; outside a block naming devices the local GPU decides, and
    DFLASH_PALLAS_GPU_BACKEND overrides both."""
    import types

    from dflash_jax.models import attention

    gpu = lambda kind: types.SimpleNamespace(platform="gpu", device_kind=kind)
    h200, a100 = gpu("NVIDIA H200"), gpu("NVIDIA A100-SXM4-80GB")
    monkeypatch.delenv("DFLASH_PALLAS_GPU_BACKEND", raising=False)
    monkeypatch.setattr(backend, "jax_version", lambda: (0, 12, 0))
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    for local in (None, "NVIDIA A100-SXM4-80GB", "NVIDIA H200"):  # no GPU here, or another
        monkeypatch.setattr(backend, "_gpu_device_kind", lambda local=local: local)
        with backend.compiling_for([h200]):
            assert backend.resolve("auto") == backend.resolve("pallas") == "cudnn", local
        with backend.compiling_for(a100):
            assert backend.resolve("auto") == "triton", local
        assert attention.for_devices("pallas", [h200]) == "pallas_cudnn"
        assert attention.for_devices("auto", [a100]) == "pallas_triton"
        # A platform name names no device: the local GPU's kind decides.
        want = "cudnn" if local == "NVIDIA H200" else "triton"
        assert backend.resolve("auto", platform="gpu") == want
        with backend.compiling_for("cuda"):
            assert backend.resolve("auto") == want
    assert backend.device_kind_of([h200]) == "NVIDIA H200" and backend.device_kind_of("gpu") is None
    monkeypatch.setenv("DFLASH_PALLAS_GPU_BACKEND", "triton")
    with backend.compiling_for([h200]):
        assert backend.resolve("auto") == "triton"
    assert attention.for_devices("pallas", [h200]) == "pallas_triton"


def test_backend_this_jax_version():
    """The version gate reads the installed jax; Triton ships in every version we test on."""
    major, minor = backend.jax_version()[:2]
    assert backend.triton_deprecated() == ((major, minor) >= (0, 11))
    assert backend.triton_available()


def test_cudnn_takes_256_wide_heads_from_hopper_on():
    """cuDNN's fused attention takes heads of up to 256 from Hopper on, 128 before (jax's own
    check, `fused_attention_stablehlo.check_is_flash_attention`): `supported` follows the GPU
    compiled for, so Qwen3.5's 256-wide gated-attention heads run cuDNN on an H100 / H200
    (test_gpu_compile.py compiles them) and the XLA reference on an A100 or with no GPU named."""
    import types

    from pallas_kernels import cudnn_attention

    def q(d, dtype=jnp.bfloat16):
        return jnp.zeros((1, 1, 16, d), dtype)

    gpu = lambda kind: types.SimpleNamespace(platform="gpu", device_kind=kind)
    for kind, widest in (("NVIDIA H200", 256), ("NVIDIA H100 80GB HBM3", 256),
                         ("NVIDIA A100-SXM4-80GB", 128)):  # fmt: skip
        with backend.compiling_for(gpu(kind)):
            assert cudnn_attention.max_head_dim() == widest, kind
            assert [cudnn_attention.supported(q(d)) for d in (128, 256)] == [True, widest == 256]
            assert not cudnn_attention.supported(q(264))  # over any GPU's limit
            assert not cudnn_attention.supported(q(204))  # not a multiple of 8
            assert not cudnn_attention.supported(q(128, jnp.float32))  # not a cuDNN dtype
    if backend._gpu_device_kind() is None:  # no local GPU and none named: the safe 128
        assert cudnn_attention.max_head_dim() == 128


def test_cudnn_variant_masks_and_layout(monkeypatch):
    """cudnn_attention's pieces (the prefix through jax.nn.dot_product_attention's XLA
    implementation of the same seq-length call, the block in XLA), their log-sum-exp merge,
    GQA layout and scale (the cuDNN kernel itself needs a GPU; its lowering is tested below
    and in test_gpu_compile.py)."""
    from pallas_kernels import cudnn_attention

    monkeypatch.setattr(cudnn_attention, "_IMPLEMENTATION", "xla")
    monkeypatch.setattr(cudnn_attention, "supported", lambda q: True)
    rng = np.random.default_rng(11)
    q, k, v = _rand(rng, 3, 5, 8, 16), _rand(rng, 3, 37, 2, 16), _rand(rng, 3, 37, 2, 16)
    pos = jnp.asarray(np.array([4, 20, 36])[:, None] - 4 + np.arange(5)[None], jnp.int32)
    np.testing.assert_allclose(
        cudnn_attention.verify_attention(q, k, v, pos, sm_scale=0.3),
        _np_verify(q * (0.3 * 4), k, v, pos),
        atol=ATOL,
    )
    # The prefix (cuDNN, seq lengths) and block (XLA, T rows sliced out of the cache) pieces
    # merged by log-sum-exp: a block at slot 0 (empty prefix) and one running past the end.
    pos2 = jnp.asarray(np.array([0, 34, 7])[:, None] + np.arange(5)[None], jnp.int32)
    np.testing.assert_allclose(
        cudnn_attention.verify_attention(q, k, v, pos2), _np_verify(q, k, v, pos2), atol=ATOL
    )
    bk, bv = _rand(rng, 3, 5, 2, 16), _rand(rng, 3, 5, 2, 16)
    clen = jnp.array([0, 13, 37], jnp.int32)
    np.testing.assert_allclose(
        cudnn_attention.draft_attention(q, k, v, clen, bk, bv),
        _np_draft(q, k, v, clen, bk, bv),
        atol=ATOL,
    )
    # float32 is not a cuDNN dtype: the public entry point runs the reference instead.
    monkeypatch.undo()
    assert not cudnn_attention.supported(q)
    np.testing.assert_array_equal(
        cudnn_attention.verify_attention(q, k, v, pos), reference.verify_attention(q, k, v, pos)
    )


def test_triton_verify_of_a_long_block_runs_in_query_chunks(monkeypatch):
    """A verify block of more than TRITON_MAX_ROWS query rows (a prefill chunk's) runs the Triton
    kernel (interpret mode) on chunks of TRITON_MAX_ROWS // G positions, the last one padded,
    and equals the reference; without chunks the kernel's tile would hold all T x G rows (more
    shared memory than a Hopper block has at 512 positions: test_gpu_compile.py)."""
    import pallas_kernels

    pallas_kernels._attend.clear_cache()  # traced again under the patched limit
    monkeypatch.setattr(pallas_kernels, "TRITON_MAX_ROWS", 16)  # 4 positions a chunk at G = 4
    calls = []
    real = pallas_kernels._by_query_chunks
    monkeypatch.setattr(
        pallas_kernels, "_by_query_chunks", lambda *a: calls.append(a[3]) or real(*a)
    )
    rng = np.random.default_rng(5)
    q, k, v = _rand(rng, 2, 10, 8, 16), _rand(rng, 2, 37, 2, 16), _rand(rng, 2, 37, 2, 16)
    pos = jnp.asarray(np.array([3, 27])[:, None] + np.arange(10)[None], jnp.int32)
    out = pk.verify_attention(q, k, v, pos, impl="pallas_triton", interpret=True)
    pallas_kernels._attend.clear_cache()
    assert calls == [4]  # 10 positions: chunks of 4, 4 and 2 (+ 2 padded)
    np.testing.assert_allclose(out, _np_verify(q, k, v, pos), atol=ATOL)


def test_backend_mosaic_gpu_env_placeholder(monkeypatch):
    monkeypatch.setenv("DFLASH_PALLAS_GPU_BACKEND", "mosaic_gpu")
    with pytest.raises(NotImplementedError, match="Mosaic GPU"):
        backend.resolve("auto", platform="gpu")


def test_auto_on_cpu_is_reference():
    rng = np.random.default_rng(4)
    q, k, v = _rand(rng, 1, 2, 2, 8), _rand(rng, 1, 6, 1, 8), _rand(rng, 1, 6, 1, 8)
    pos = jnp.array([[3, 4]], jnp.int32)
    np.testing.assert_array_equal(
        pk.verify_attention(q, k, v, pos), reference.verify_attention(q, k, v, pos)
    )


def test_tpu_kernel_runs_a_long_block_in_query_chunks(monkeypatch):
    """Too many query rows for one program (SmolLM2's 512-token prefill chunk, 9 query / 3 KV
    heads of 64: 4608 rows of 192 lanes, out of v5e's scoped VMEM in one call,
    test_tpu_compile.py): the TPU kernel runs the queries in equal chunks, one call each, and
    equals the brute-force rule, verify and a tree's masked block alike. Here (interpret mode) a
    lowered limit makes 10 queries at 3 KV heads of 16 take 5 calls of 2."""
    import pallas_kernels
    from pallas_kernels import tpu_decode

    pallas_kernels._attend.clear_cache()  # traced again under the patched limit
    monkeypatch.setattr(tpu_decode, "_MAX_QUERY_BLOCK", 1500)
    monkeypatch.setattr(tpu_decode, "_BIG_QUERY_BLOCK", 1500)
    rng = np.random.default_rng(7)
    q, k, v = _rand(rng, 2, 10, 9, 16), _rand(rng, 2, 37, 3, 16), _rand(rng, 2, 37, 3, 16)
    pos = jnp.asarray(np.array([3, 26])[:, None] + np.arange(10)[None], jnp.int32)

    def calls(fn, *args):
        return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")

    verify = lambda *a: pk.verify_attention(*a, impl="pallas_tpu", interpret=True)
    assert calls(verify, q, k, v, pos) == 5
    np.testing.assert_allclose(verify(q, k, v, pos), _np_verify(q, k, v, pos), atol=ATOL)
    # a tree of 10 nodes after prefixes of 5 and 30 slots, each node seeing itself, its
    # parent chain (node u's parent: u // 2) and the prefix
    bk, bv = _rand(rng, 2, 10, 3, 16), _rand(rng, 2, 10, 3, 16)
    anc = np.zeros((10, 10), bool)
    for u in range(10):
        w = u
        while True:
            anc[u, w] = True
            if w == 0:
                break
            w //= 2
    mask = jnp.asarray(np.broadcast_to(anc, (2, 10, 10)))
    pre = jnp.asarray([5, 30], jnp.int32)
    tree = lambda *a: pk.tree_attention(*a, impl="pallas_tpu", interpret=True)
    got = tree(q, k, v, pre, bk, bv, mask)
    pallas_kernels._attend.clear_cache()
    want = np.stack(
        [
            _np_attend(
                np.asarray(q[b]),
                np.concatenate([np.asarray(k[b]), np.asarray(bk[b])]),
                np.concatenate([np.asarray(v[b]), np.asarray(bv[b])]),
                lambda t, j, b=b: j < int(pre[b]) if j < 37 else anc[t, j - 37],
                16**-0.5,
            )
            for b in range(2)
        ]
    )
    np.testing.assert_allclose(got, want, atol=ATOL)


# ------------------------------------------------- kernels vs reference -----
# The b1g1 cases use head_dim 128 (TPU kernels: lane-dense views of the
# [B, S, Hkv*D] cache, one kv head per program); the b3g4 cases use head_dim
# 16 (TPU: block-diagonal multi-head tiles for decode, head-major copies for
# training; Triton: power-of-two tiles).
# (B, T, Hq, Hkv, D, S, block_k, num_splits)
VERIFY_CASES = [
    (1, 1, 2, 2, 128, 45, 16, None),  # GQA 1, single query, S % tile != 0
    (3, 5, 8, 2, 16, 77, 16, 2),  # GQA 4, different lengths, 2 splits,
    # NaN in stale slots
]


@pytest.mark.parametrize("impl", VARIANTS)
@pytest.mark.parametrize("case", VERIFY_CASES, ids=["b1g1", "b3g4"])
def test_verify_kernel(impl, case):
    b, t, hq, hkv, d, s, bk, ns = case
    rng = np.random.default_rng(5)
    q, k, v = _rand(rng, b, t, hq, d), _rand(rng, b, s, hkv, d), _rand(rng, b, s, hkv, d)
    last = np.array([4, 40, s - 1][:b])
    if b == 1:
        last = np.array([30])
    pos = jnp.asarray(last[:, None] - (t - 1) + np.arange(t)[None, :], jnp.int32)
    ref = reference.verify_attention(q, k, v, pos)
    if b > 1:
        # Slots beyond each sequence's last position (stale / never written) may
        # hold anything, even NaN: they must be masked or never read at all
        # (skipped tiles, masked boundary tile).
        stale = jnp.arange(s)[None, :, None, None] > pos[:, -1][:, None, None, None]
        k, v = jnp.where(stale, jnp.nan, k), jnp.where(stale, jnp.nan, v)
    out = pk.verify_attention(q, k, v, pos, impl=impl, interpret=True, block_k=bk, num_splits=ns)
    np.testing.assert_allclose(out, ref, atol=ATOL)


def test_verify_and_tree_kernels_read_one_layer_of_a_stack():
    """With a layer index the TPU decode kernel (interpret mode) reads that layer of a stacked
    cache [L,B,S,Hkv,D] where it lies: verify (1 and 16 query rows) and tree attention equal
    the reference on the layer's own slice, for every layer; the other layers hold NaN, so a
    read of the wrong layer would show. A capacity that is not a tile multiple takes the
    layer's slice (the same numbers)."""
    rng = np.random.default_rng(7)
    n, b, hq, hkv, d = 3, 2, 4, 2, 128
    for s, t in ((64, 1), (64, 16), (45, 1)):
        q = _rand(rng, b, t, hq, d)
        k, v = _rand(rng, n, b, s, hkv, d), _rand(rng, n, b, s, hkv, d)
        pos = jnp.asarray(np.array([20, s - t])[:, None] + np.arange(t)[None, :], jnp.int32)
        for layer in range(n):
            others = (jnp.arange(n) != layer)[:, None, None, None, None]
            kn, vn = jnp.where(others, jnp.nan, k), jnp.where(others, jnp.nan, v)
            want = reference.verify_attention(q, k[layer], v[layer], pos)
            got = pk.verify_attention(
                q, kn, vn, pos, impl="pallas", interpret=True, layer=jnp.int32(layer)
            )
            np.testing.assert_allclose(got, want, atol=ATOL)
    t = 4
    q, bk, bv = _rand(rng, b, t, hq, d), _rand(rng, b, t, hkv, d), _rand(rng, b, t, hkv, d)
    k, v = _rand(rng, n, b, 64, hkv, d), _rand(rng, n, b, 64, hkv, d)
    prefix = jnp.asarray([9, 30], jnp.int32)
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None].repeat(b, 0)).at[:, 2, 1].set(False)
    for layer in range(n):
        want = reference.tree_attention(q, k[layer], v[layer], prefix, bk, bv, mask)
        got = pk.tree_attention(
            q, k, v, prefix, bk, bv, mask, impl="pallas", interpret=True, layer=jnp.int32(layer)
        )
        np.testing.assert_allclose(got, want, atol=ATOL)


# (B, T, Hq, Hkv, D, C, block_k, ctx_len)
DRAFT_CASES = [
    (1, 4, 2, 2, 128, 40, 16, [23]),
    (3, 5, 8, 2, 16, 50, 16, [0, 13, 50]),  # includes empty context
]


@pytest.mark.parametrize("impl", VARIANTS)
@pytest.mark.parametrize("case", DRAFT_CASES, ids=["b1g1", "b3g4"])
def test_draft_kernel(impl, case):
    b, t, hq, hkv, d, c, bk, clen = case
    rng = np.random.default_rng(6)
    q = _rand(rng, b, t, hq, d)
    ck, cv = _rand(rng, b, c, hkv, d), _rand(rng, b, c, hkv, d)
    blk_k, blk_v = _rand(rng, b, t, hkv, d), _rand(rng, b, t, hkv, d)
    clen = jnp.asarray(clen, jnp.int32)
    out = pk.draft_attention(
        q, ck, cv, clen, blk_k, blk_v, impl=impl, interpret=True, block_k=bk, num_splits=2
    )
    ref = reference.draft_attention(q, ck, cv, clen, blk_k, blk_v)
    np.testing.assert_allclose(out, ref, atol=ATOL)


@pytest.mark.parametrize("impl", ("xla", "pallas"))
def test_draft_attention_shares_merge_to_the_whole_context(impl):
    """A context split into two shares of 1,040 slots, as the chips of a sequence-split cache
    hold it: `draft_attention_lse` over each share (the block's keys seen by the first share
    only), merged in NumPy by their log-sum-exp, is the brute-force attention over the whole
    context, for lengths ending in the second share, in the first, and at 0; a row that sees
    nothing in a share gets output 0 and lse NEG. The TPU kernel (interpreted) reads a share
    in 208-slot tiles, a multiple of 16 dividing 1,040, not padded to 1,536."""
    from pallas_kernels import tpu_decode

    assert tpu_decode._choose_kv_tile(1040, 512, 16) == (208, 1040)
    assert tpu_decode._choose_kv_tile(33280, 512, 16) == (512, 33280)  # powers of two first
    assert tpu_decode._choose_kv_tile(1000, 512, 16) == (512, 1024)  # no divisor: padded
    b, t, hq, hkv, d, share = 3, 4, 4, 2, 32, 1040
    rng = np.random.default_rng(11)
    q = _rand(rng, b, t, hq, d)
    ck, cv = _rand(rng, b, 2 * share, hkv, d), _rand(rng, b, 2 * share, hkv, d)
    blk_k, blk_v = _rand(rng, b, t, hkv, d), _rand(rng, b, t, hkv, d)
    clen = np.array([1500, 700, 0], np.int32)
    outs, lses = [], []
    for i in (0, 1):
        part = slice(i * share, (i + 1) * share)
        o, lse = pk.draft_attention_lse(
            q, ck[:, part], cv[:, part], jnp.asarray(np.clip(clen - i * share, 0, share)),
            blk_k, blk_v, jnp.full((b,), i == 0), impl=impl, interpret=True,
        )  # fmt: skip
        assert o.dtype == lse.dtype == jnp.float32 and lse.shape == (b, t, hq)
        outs.append(np.asarray(o, np.float64))
        lses.append(np.asarray(lse, np.float64))
    assert np.all(lses[1][1:] <= -1e29) and np.all(outs[1][1:] == 0)  # rows 1, 2: nothing
    top = np.maximum(*lses)
    w = [np.exp(x - top) for x in lses]
    merged = (w[0][..., None] * outs[0] + w[1][..., None] * outs[1]) / (w[0] + w[1])[..., None]
    np.testing.assert_allclose(merged, _np_draft(q, ck, cv, clen, blk_k, blk_v), atol=ATOL)


@pytest.mark.parametrize("impl", ("xla", "pallas"))
def test_verify_attention_shares_merge_to_the_whole_cache(impl):
    """A target cache split into two shares of 1,040 slots, as the chips of a sequence-split
    cache hold it: `verify_attention_lse` over each share, the query positions shifted by the
    share's first slot, merged in NumPy by their log-sum-exp, is the brute-force verify over
    the whole cache, for blocks ending in the second share, straddling the two, and inside the
    first (whose rows see nothing in the second: output 0, lse NEG); an autoregressive step
    (T = 1) too."""
    b, hq, hkv, d, share = 3, 4, 2, 32, 1040
    rng = np.random.default_rng(12)
    ck, cv = _rand(rng, b, 2 * share, hkv, d), _rand(rng, b, 2 * share, hkv, d)
    for t in (5, 1):
        q = _rand(rng, b, t, hq, d)
        pos = np.array([1500, share - 2, 30], np.int32)[:, None] + np.arange(t, dtype=np.int32)
        outs, lses = [], []
        for i in (0, 1):
            part = slice(i * share, (i + 1) * share)
            o, lse = pk.verify_attention_lse(
                q, ck[:, part], cv[:, part], jnp.asarray(pos - i * share), impl=impl,
                interpret=True,
            )  # fmt: skip
            assert o.dtype == lse.dtype == jnp.float32 and lse.shape == (b, t, hq)
            outs.append(np.asarray(o, np.float64))
            lses.append(np.asarray(lse, np.float64))
        assert np.all(lses[1][2] <= -1e29) and np.all(outs[1][2] == 0)  # row 2: nothing there
        top = np.maximum(*lses)
        w = [np.exp(x - top) for x in lses]
        merged = (w[0][..., None] * outs[0] + w[1][..., None] * outs[1]) / (w[0] + w[1])[..., None]
        np.testing.assert_allclose(merged, _np_verify(q, ck, cv, pos), atol=ATOL)


@pytest.mark.parametrize("impl", VARIANTS)
def test_draft_kernel_without_context_capacity(impl):
    """C == 0 (no context cache at all): only the block keys are attended."""
    rng = np.random.default_rng(10)
    q, bk, bv = _rand(rng, 2, 3, 4, 16), _rand(rng, 2, 3, 2, 16), _rand(rng, 2, 3, 2, 16)
    ck = jnp.zeros((2, 0, 2, 16), jnp.float32)
    clen = jnp.zeros((2,), jnp.int32)
    out = pk.draft_attention(q, ck, ck, clen, bk, bv, impl=impl, interpret=True)
    np.testing.assert_allclose(out, reference.draft_attention(q, ck, ck, clen, bk, bv), atol=ATOL)


# (B, N, bs, Hq, Hkv, D, S, anchors, ctx_start, valid, nan_slots); context
# tile 16, query tiles of 16 rows.
# "b1g1": no ctx_start (= 0); anchor 0 and anchor == S.
# "b1g1_start": 4 blocks per query tile with different windows
#   [ctx_start, anchor) inside one tile; the second query tile skips context
#   tiles 0-1.
# "b3g4_start": one block per query tile; windows inside one tile ([18,20):
#   tile 0 skipped), spanning a whole tile ([3,36): tile 1 mask-free), up to
#   anchor == S ([2,37), padded last tile); empty windows (ctx_start ==
#   anchor, ctx_start > anchor, anchor 0); invalid blocks, a query tile with
#   no valid row.  nan_slots (row, stop): context slots [0, stop) of that row,
#   a whole tile no block of the row sees, are NaN: skipped tiles must not
#   be read at all.
TRAIN_CASES = [
    (1, 3, 4, 2, 2, 128, 21, [[5, 0, 21]], None, [[True, True, True]], None),
    (1, 5, 4, 2, 2, 128, 45, [[10, 40, 44, 30, 45]], [[3, 20, 44, 17, 33]], [[True] * 5], None),
    (
        3,
        3,
        4,
        8,
        2,
        16,
        37,
        [[0, 20, 36], [5, 33, 30], [17, 3, 37]],
        [[5, 18, 3], [5, 17, 29], [16, 0, 2]],
        [[True, True, True], [True, False, True], [False, True, True]],
        (1, 16),
    ),
]


@pytest.mark.parametrize("impl", VARIANTS)
@pytest.mark.parametrize("case", TRAIN_CASES, ids=["b1g1", "b1g1_start", "b3g4_start"])
def test_training_kernel_forward_and_grads(impl, case):
    b, n, bs, hq, hkv, d, s, anchors, start, valid, nan_slots = case
    rng = np.random.default_rng(7)
    l = n * bs
    args = (
        _rand(rng, b, l, hq, d),
        _rand(rng, b, s, hkv, d),
        _rand(rng, b, s, hkv, d),
        _rand(rng, b, l, hkv, d),
        _rand(rng, b, l, hkv, d),
    )
    anchors = jnp.asarray(anchors, jnp.int32)
    valid = jnp.asarray(valid)
    ct = _rand(rng, b, l, hq, d)
    kw = dict(block_size=bs)
    if start is not None:
        kw["ctx_start"] = jnp.asarray(start, jnp.int32)
    ref, vjp_ref = jax.vjp(lambda *x: reference.training_attention(*x, anchors, valid, **kw), *args)
    kargs = list(args)
    if nan_slots is not None:
        row, stop = nan_slots
        poison = (jnp.arange(b) == row)[:, None, None, None] & (jnp.arange(s) < stop)[
            None, :, None, None
        ]
        kargs[1] = jnp.where(poison, jnp.nan, args[1])
        kargs[2] = jnp.where(poison, jnp.nan, args[2])
    out, vjp = jax.vjp(
        lambda *x: pk.training_attention(
            *x, anchors, valid, impl=impl, interpret=True, block_q_rows=16, block_k=16, **kw
        ),
        *kargs,
    )  # several query and context tiles
    np.testing.assert_allclose(out, ref, atol=ATOL)
    names = ["q", "k_ctx", "v_ctx", "k_blk", "v_blk"]
    for name, g, gr in zip(names, vjp(ct), vjp_ref(ct)):
        assert np.all(np.isfinite(g)), name
        np.testing.assert_allclose(g, gr, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("impl", VARIANTS)
def test_bfloat16_verify_and_training(impl):
    rng = np.random.default_rng(9)
    bf = jnp.bfloat16
    q, k, v = (
        _rand(rng, 2, 4, 4, 32, dtype=bf),
        _rand(rng, 2, 50, 1, 32, dtype=bf),
        _rand(rng, 2, 50, 1, 32, dtype=bf),
    )
    pos = jnp.array([[3, 4, 5, 6], [46, 47, 48, 49]], jnp.int32)
    out = pk.verify_attention(q, k, v, pos, impl=impl, interpret=True, block_k=16)
    assert out.dtype == bf
    np.testing.assert_allclose(
        out.astype(np.float32),
        reference.verify_attention(q, k, v, pos).astype(np.float32),
        atol=3e-2,
    )

    bs, n = 4, 2
    args = (
        _rand(rng, 1, n * bs, 4, 32, dtype=bf),
        _rand(rng, 1, 40, 1, 32, dtype=bf),
        _rand(rng, 1, 40, 1, 32, dtype=bf),
        _rand(rng, 1, n * bs, 1, 32, dtype=bf),
        _rand(rng, 1, n * bs, 1, 32, dtype=bf),
    )
    anchors, valid = jnp.array([[9, 35]], jnp.int32), jnp.array([[True, True]])

    def loss(fn):
        return lambda *x: jnp.sum(fn(*x, anchors, valid, block_size=bs).astype(jnp.float32) ** 2)

    kern = lambda *x, **kw: pk.training_attention(
        *x, impl=impl, interpret=True, block_q_rows=32, block_k=32, **kw
    )
    gk = jax.grad(loss(kern), argnums=(0, 1, 2, 3, 4))(*args)
    gr = jax.grad(loss(reference.training_attention), argnums=(0, 1, 2, 3, 4))(*args)
    for a, r in zip(gk, gr):
        assert a.dtype == bf
        np.testing.assert_allclose(a.astype(np.float32), r.astype(np.float32), atol=0.1, rtol=0.05)


# ------------------------------------------ drafter loss on packed rows ------
def test_drafter_loss_pallas_equals_xla_on_packed_rows(monkeypatch):
    """Several documents per row: the fused kernel gets ctx_start = first
    position of each anchor's document and matches the segment-aware XLA mask;
    without that bound it would not (earlier documents' context leaks)."""
    import dflash_jax as dj
    from dflash_jax.models.target import init_params
    from dflash_jax.models.tiny import tiny_config
    from dflash_jax.training import losses

    seg = np.array(
        [[1] * 9 + [2] * 13 + [3] * 7 + [0] * 3, [1] * 5 + [2] * 14 + [3] * 13], np.int32
    )
    np.testing.assert_array_equal(  # first position of each position's document
        losses._segment_starts(jnp.asarray(seg))[0], [0] * 9 + [9] * 13 + [22] * 7 + [29] * 3
    )
    cfg = tiny_config(hidden_size=32, intermediate_size=64)
    tparams = init_params(cfg, seed=0)
    dcfg = dj.make_drafter_config(
        cfg, num_layers=1, num_taps=2, block_size=4, target_layer_ids=(0, 1)
    )
    dparams = dj.init_drafter_params(dcfg)
    rng = np.random.default_rng(13)
    batch = {
        "input_ids": jnp.asarray(rng.integers(0, 63, seg.shape), jnp.int32),
        "loss_mask": jnp.asarray(seg > 0, jnp.int32),
        "segment_ids": jnp.asarray(seg),
    }

    def loss(impl):
        recipe = losses.DrafterRecipe(
            block_size=4,
            mask_token_id=dcfg.mask_token_id,
            tap_layers=(0, 1),
            num_anchors=8,
            gamma=4.0,
            attention_impl=impl,
        )
        fn = jax.jit(
            lambda dp: losses.drafter_loss(
                dj.Transformer(cfg),
                dj.DFlashDrafter(dcfg),
                recipe,
                dp,
                tparams,
                batch,
                jax.random.PRNGKey(0),
            )[0]
        )
        return float(fn(dparams))

    xla = loss("xla")
    assert abs(loss("pallas_interpret") - xla) < 1e-5
    # The check discriminates: dropping the lower bound changes the loss.
    monkeypatch.setattr(losses, "_segment_starts", jnp.zeros_like)
    assert abs(loss("pallas_interpret") - xla) > 1e-3


# ---------------------------------------- lowering for the real accelerators --
@pytest.mark.parametrize("platform,impl,d", [("tpu", "pallas", 128), ("tpu", "pallas", 64)])
def test_kernels_lower_for_accelerator(monkeypatch, platform, impl, d):
    """Cross-lowers all kernels (Qwen3-8B-like heads, bf16) to Mosaic TPU /
    Triton IR on this CPU machine: catches block-shape and lowering errors that
    interpret mode cannot (the final Mosaic/Triton compile still needs the chip)."""
    monkeypatch.setattr(backend, "_platform", lambda: "tpu" if platform == "tpu" else "gpu")
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    b, t, hkv, g, s, bs, n = 2, 16, 8, 4, 4096, 16, 8
    q, kv = sd((b, t, hkv * g, d), bf), sd((b, s, hkv, d), bf)
    i32 = lambda *shape: sd(shape, jnp.int32)
    lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=(platform,))
    lower(lambda *a: pk.verify_attention(*a, impl=impl), q, kv, kv, i32(b, t))
    lower(
        lambda *a: pk.draft_attention(*a, impl=impl),
        q,
        kv,
        kv,
        i32(b),
        sd((b, t, hkv, d), bf),
        sd((b, t, hkv, d), bf),
    )
    qt, kb = sd((b, n * bs, hkv * g, d), bf), sd((b, n * bs, hkv, d), bf)

    def train_grads(q_, kc, vc, kb_, vb, anchors, valid):
        f = lambda *x: jnp.sum(
            pk.training_attention(*x, anchors, valid, block_size=bs, impl=impl).astype(jnp.float32)
        )
        return jax.grad(f, argnums=(0, 1, 2, 3, 4))(q_, kc, vc, kb_, vb)

    text = lower(train_grads, qt, kv, kv, kb, kb, i32(b, n), sd((b, n), bool)).as_text()
    marker = "tpu_custom_call" if platform == "tpu" else "xla.gpu.triton"
    assert text.count(marker) >= 3  # fwd + 2 backward kernels


@pytest.fixture
def abstract_h200(monkeypatch):
    """Lowering for an NVIDIA H200 on a machine without a GPU.

    Pallas Triton reads the target's compute capability from an abstract device
    (jax >= 0.11 refuses to guess; 0.10 falls back to sm_90 and accepts it too).
    cuDNN attention cannot lower under an abstract mesh (its primitives require
    devices), and asks the installed cuDNN for its version and the local GPU for
    its compute capability: the probes answer for cuDNN 9.8 on sm_90 here.
    """
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(
        fa, "check_compute_capability", lambda c: tuple(map(int, c.split("."))) <= (9, 0)
    )
    monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda c: c == "9.0")
    monkeypatch.setattr(backend, "_platform", lambda: "gpu")
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,), abstract_device=dev
    )
    return lambda: jax.sharding.use_abstract_mesh(mesh)


def test_gpu_kernels_lower_for_cuda(abstract_h200):
    """Every GPU variant at Qwen3-8B heads (32 q / 8 kv heads, head_dim 128, bf16) lowers for
    CUDA on this CPU: Triton verify, draft, training fwd + both backward kernels; cuDNN verify
    and draft, each one cuDNN call over the cache with sequence lengths, no capacity-wide bias
    and no copy of the cache (the final PTX / cuDNN compile still needs the GPU)."""
    import re

    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    b, t, hkv, g, d, s, bs, n = 2, 16, 8, 4, 128, 4096, 16, 8
    q, kv, blk = sd((b, t, hkv * g, d), bf), sd((b, s, hkv, d), bf), sd((b, t, hkv, d), bf)
    i32 = lambda *shape: sd(shape, jnp.int32)
    lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
    calls = lambda text: re.findall(r"custom_call @([^(]+)\(", text)
    qt, kb = sd((b, n * bs, hkv * g, d), bf), sd((b, n * bs, hkv, d), bf)

    def train_grads(q_, kc, vc, kb_, vb, anchors, valid):
        f = lambda *x: jnp.sum(
            pk.training_attention(*x, anchors, valid, block_size=bs, impl="pallas_triton").astype(
                jnp.float32
            )
        )
        return jax.grad(f, argnums=(0, 1, 2, 3, 4))(q_, kc, vc, kb_, vb)

    # jax >= 0.11 deprecates the Pallas Triton backend and says so when lowering it.
    deprecated = (
        pytest.warns(DeprecationWarning, match="Pallas Triton backend is deprecated")
        if backend.triton_deprecated()
        else contextlib.nullcontext()
    )
    with abstract_h200(), deprecated:
        texts = [
            lower(lambda *a: pk.verify_attention(*a, impl="pallas_triton"), q, kv, kv, i32(b, t)),
            lower(
                lambda *a: pk.draft_attention(*a, impl="pallas_triton"), q, kv, kv, i32(b), blk, blk
            ),
            lower(train_grads, qt, kv, kv, kb, kb, i32(b, n), sd((b, n), bool)),
        ]
    assert [calls(x).count("__gpu$xla.gpu.triton") for x in texts] == [1, 1, 3]
    for fn, args in [
        (pk.verify_attention, (q, kv, kv, i32(b, t))),
        (pk.draft_attention, (q, kv, kv, i32(b), blk, blk)),
    ]:
        text = lower(lambda *a, fn=fn: fn(*a, impl="cudnn"), *args)
        # One cuDNN call over the cache as it lies, with seq lengths and no bias (no
        # "ScaleBias" variant, no [B,1,T,S] mask), and no concatenation of the cache with the
        # block (nothing of S + T = 4112 rows).
        assert calls(text) == ["__cudnn$fmhaSoftmax"], calls(text)
        assert f"x{t}x{s}x" not in text, "a [B,1,T,S] mask or bias"
        assert f"{b}x{s + t}x" not in text, "the cache concatenated with the block"
        assert not re.search(rf"concatenate[^\n]*{b}x{s}x{hkv}x{d}", text)


def test_bench_script_smoke(tmp_path, monkeypatch):
    """bench.py runs end to end on CPU (interpret mode, one tiny shape), the variant checked
    against the reference; by default it times every variant of the backend it runs on."""
    import json
    import types

    from pallas_kernels import bench

    out = tmp_path / "bench.json"
    rows = bench.main(
        [
            "--quick",
            "--interpret",
            "--kernel",
            "verify",
            "--impl",
            "pallas_triton",
            "--contexts",
            "40",
            "--batches",
            "1",
            "--repeats",
            "1",
            "--json_out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert data["variants"] == ["pallas_triton"]
    assert {r["impl"] for r in data["rows"]} == {
        "pallas_triton",
        "xla_ref",
        "dot_product_attention",
    }
    assert all("time_ms" in r and r["gbps"] > 0 for r in rows)
    [kernel_row] = [r for r in rows if r["impl"] == "pallas_triton"]
    assert kernel_row["max_abs_err_vs_ref"] < 1e-4
    every = lambda: bench.variants(types.SimpleNamespace(impl="all", interpret=False))
    assert bench.variants(types.SimpleNamespace(impl="all", interpret=True)) == [
        "pallas_tpu",
        "pallas_triton",
    ]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert every() == ["pallas_triton", "cudnn"]
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    assert every() == ["cudnn"]
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert every() == ["pallas_tpu"]


# ------------------------------------------------------------------ kv_update --
def test_kv_update_kernel_writes_one_layer_of_a_stack():
    """With a layer index the kernel writes that layer of a stacked cache [L,B,S,K,D] (a
    scanned layer stack) and leaves every other layer as it was (interpret mode), against
    the rule in NumPy: aligned, unaligned, past-the-end and out-of-range starts; a traced
    layer index under jit."""
    n, b, s, k, d, t = 3, 4, 64, 2, 128, 5
    rs = np.random.RandomState(0)
    cache = rs.randn(n, b, s, k, d).astype(np.float32)
    new = rs.randn(b, t, k, d).astype(np.float32)
    starts = np.asarray([0, 16, 61, 70], np.int32)
    for layer in range(n):
        want = cache.copy()
        for r in range(b):
            for i in range(t):
                if 0 <= starts[r] + i < s:
                    want[layer, r, starts[r] + i] = new[r, i]
        write = jax.jit(lambda c, x, st, li: pk.kv_update(c, x, st, li, interpret=True))
        got = write(jnp.asarray(cache), jnp.asarray(new), jnp.asarray(starts), jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kv_update_kernel_equals_the_xla_write(dtype):
    """The Pallas TPU cache write (interpret mode) equals `model.write_kv`'s scatter: batch
    rows with different starts (tile-aligned: one DMA; unaligned: the window path), a block
    reaching past the cache (its in-range rows kept) and one wholly out of range (dropped);
    T = 16 (a tile of rows) and T = 5 / 1 (padded rows); S = 40 (not a tile multiple: XLA)."""
    from dflash_jax.models.transformer import write_kv

    b, k, d = 4, 2, 128
    for s, t, starts in (
        (64, 16, [0, 16, 3, 70]),
        (64, 16, [48, 40, 63, 1]),
        (64, 5, [0, 7, 60, 64]),
        (64, 1, [63, 8, 0, 100]),
        (40, 5, [0, 37, 3, 40]),
    ):
        kc, kn = jax.random.split(jax.random.PRNGKey(s + t))
        cache = jax.random.normal(kc, (b, s, k, d), jnp.float32).astype(dtype)
        new = jax.random.normal(kn, (b, t, k, d), jnp.float32)
        st = jnp.asarray(starts, jnp.int32)
        want = write_kv(cache, new, st[:, None] + jnp.arange(t)[None])
        got = pk.kv_update(cache, new, st, interpret=True)
        assert got.dtype == cache.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
