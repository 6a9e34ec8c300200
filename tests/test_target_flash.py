"""The flash attention of the frozen target pass (`attention.causal_attention`): the splash and
Triton kernels (in Pallas interpret mode on CPU) equal the chunked XLA attention on packed rows,
the taps-only forward is the same under either, the kernel choice follows the platform compiled
for, and the TPU training step compiles with splash in it."""

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models import attention as attn_lib
from dflash_jax.models.attention import chunked_causal_attention
from dflash_jax.models.transformer import Transformer
from dflash_jax.models.target import init_params
from dflash_jax.models.tiny import tiny_config


def _packed_rows(t=200, seed=0, hq=4, hkv=2, d=32):
    """Two packed rows of length t (not a multiple of 128): three documents, then right padding
    (segment 0) in row 0; two documents in row 1. Positions restart per document."""
    rng = np.random.RandomState(seed)
    q = jnp.asarray(rng.randn(2, t, hq, d), jnp.float32)
    k = jnp.asarray(rng.randn(2, t, hkv, d), jnp.float32)
    v = jnp.asarray(rng.randn(2, t, hkv, d), jnp.float32)
    seg = np.zeros((2, t), np.int32)
    seg[0, :70], seg[0, 70:150], seg[0, 150:185] = 1, 2, 3
    seg[1, :131], seg[1, 131:] = 1, 2
    pos = np.zeros_like(seg)
    for b in range(2):
        for s in np.unique(seg[b]):
            idx = np.flatnonzero(seg[b] == s)
            pos[b, idx] = np.arange(len(idx))
    return q, k, v, jnp.asarray(pos), jnp.asarray(seg)


@pytest.mark.parametrize("kernel", ["splash", "triton"])
def test_flash_kernels_equal_the_chunked_attention_on_packed_rows(kernel):
    from pallas_kernels import causal_attention as causal

    q, k, v, pos, seg = _packed_rows()
    want = chunked_causal_attention(q, k, v, pos, seg, chunk=64)
    fn = causal.splash_causal_attention if kernel == "splash" else causal.triton_causal_attention
    got = fn(q, k, v, seg, interpret=True)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    # The mask matters: without segments, the second document would read the first one.
    one_doc = fn(q, k, v, None, interpret=True)
    assert np.abs(np.asarray(one_doc[1, 131:]) - np.asarray(want[1, 131:])).max() > 1e-2


def test_causal_attention_dispatch_follows_impl_and_the_platform_compiled_for():
    from pallas_kernels import backend

    assert attn_lib.causal_kernel("xla") == "xla"
    assert attn_lib.causal_kernel("pallas_interpret") == "splash_interpret"
    with backend.compiling_for("tpu"):
        assert attn_lib.causal_kernel("pallas") == "splash"
        assert attn_lib.causal_kernel("auto") == "splash"
        assert attn_lib.causal_kernel("xla") == "xla"
    with backend.compiling_for("cuda"):
        want = "triton" if backend.triton_available() else "xla"
        assert attn_lib.causal_kernel("pallas") == want
    with backend.compiling_for("cpu"):
        assert attn_lib.causal_kernel("pallas") == "xla"
    with pytest.raises(ValueError, match="attention_impl"):
        attn_lib.causal_kernel("splash")
    # The dispatch itself: "pallas_interpret" runs splash and matches "xla".
    q, k, v, pos, seg = _packed_rows(t=150, seed=1)
    a = attn_lib.causal_attention(q, k, v, pos, seg, impl="xla", chunk=32)
    b = attn_lib.causal_attention(q, k, v, pos, seg, impl="pallas_interpret")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def test_taps_only_forward_is_the_same_with_splash_as_with_chunked_xla():
    cfg = tiny_config(
        vocab_size=97, num_layers=3, max_position_embeddings=512, tie_word_embeddings=False
    )
    params = init_params(cfg, seed=3)
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(0, cfg.vocab_size, (2, 137)), jnp.int32)
    seg = np.ones((2, 137), np.int32)
    seg[0, 50:] = 2
    seg[1, 100:] = 0  # right padding
    seg = jnp.asarray(seg)

    def taps(impl):
        return Transformer(cfg, impl).apply(
            {"params": params},
            ids,
            (0, 2),
            segment_ids_BT=seg,
            attn_chunk=32,
            method="taps",
        )

    want, got = taps("xla"), taps("pallas_interpret")
    assert got.shape == (2, 137, 2 * cfg.hidden_size)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # a TPU compile: `make test`, not `make test-fast`
@pytest.mark.skipif(
    __import__("dflash_jax.dry_run", fromlist=["x"]).libtpu_missing(),
    reason='needs libtpu: pip install "jax[tpu]" (make test does)',
)
def test_tpu_training_step_runs_splash_in_the_target_pass(monkeypatch):
    """attention_impl="pallas" on a sharded v5e mesh: the target pass adds one splash kernel
    per target layer up to the last tap, run per shard, to the drafter's training kernel."""
    from dflash_jax import dry_run

    devices, chip = dry_run.topology_devices("v5e:2x4")

    def mosaic(**kw):
        r = dry_run.dry_run_train(
            "tiny",
            "fsdp=2,tensor=4",
            batch=4,
            seq_len=200,  # not a multiple of splash's 128 tiles: padded inside
            num_anchors=4,
            devices=devices,
            chip=chip,
            attention_impl="pallas",
            **kw,
        )
        p = r["programs"]["train_step"]
        assert p["fits"] is True and p["flops"] > 0
        return p["mosaic_kernels"]

    with_splash = mosaic()
    with monkeypatch.context() as m:
        m.setattr(attn_lib, "causal_kernel", lambda impl: "xla")
        chunked = mosaic()
    assert chunked >= 2  # the drafter's training kernel, forward and backward
    # "tiny" taps layers 0 and 1: two target layers, one splash forward each.
    assert with_splash >= chunked + 2, (with_splash, chunked)
