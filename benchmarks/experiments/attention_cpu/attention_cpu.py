"""XLA:CPU attention forms side by side: the [B, K, G]-batched einsum this project used before,
the merged-query form of `pallas_kernels.reference.gqa_attention` (prefill, verify, training)
and the multiply-and-reduce decode form (`dflash_jax.models.attention.decode_attention_xla`).

  python benchmarks/experiments/attention_cpu/attention_cpu.py \
      [--batch=16 --heads=9 --kv_heads=3 --slots=1024]

Prints ms per call (median of --repeats, measured in one run, side by side) and the largest
difference from the old form. SmolLM2-135M's attention shape by default (9 / 3 heads of 64).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 16, "Rows.")
flags.DEFINE_integer("heads", 9, "Query heads.")
flags.DEFINE_integer("kv_heads", 3, "Key/value heads.")
flags.DEFINE_integer("head_dim", 64, "Head width.")
flags.DEFINE_integer("slots", 1024, "Cache slots (keys).")
flags.DEFINE_list("queries", ["512", "16", "1"], "Query lengths (prefill, a verify block, AR).")
flags.DEFINE_integer("decode_batch", 64, "Rows of the 1-query (decode) case.")
flags.DEFINE_integer("repeats", 5, "Timed calls per form.")


def old_form(q, k, v, mask):
    """The einsum form used before (batch dims [B, K, G] not leading in the cache)."""
    b, t, n, d = q.shape
    kh = k.shape[2]
    qq = q.reshape(b, t, kh, n // kh, d)
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("btkgd,bskd->bkgts", qq, k, precision=hi) * d**-0.5
    m = jnp.broadcast_to(mask, (b, t, k.shape[1]))[:, None, None]
    p = jnp.where(m, jax.nn.softmax(jnp.where(m, logits, -1e30), axis=-1), 0.0)
    return jnp.einsum("bkgts,bskd->btkgd", p, v, precision=hi).reshape(b, t, n, d)


def _time(f, *args):
    f(*args).block_until_ready()
    ts = []
    for _ in range(FLAGS.repeats):
        t0 = time.perf_counter()
        f(*args).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def main(argv):
    del argv
    from dflash_jax.models.attention import decode_attention_xla
    from pallas_kernels.reference import gqa_attention

    rng = np.random.default_rng(0)
    hi = jax.lax.Precision.HIGHEST
    new = jax.jit(lambda q, k, v, m: gqa_attention(q, k, v, m, precision=hi))
    old = jax.jit(old_form)
    dec = jax.jit(decode_attention_xla)
    print(f"{'queries':>8} {'rows':>5} {'old ms':>8} {'new ms':>8} {'speedup':>8}  max |diff|")
    for t in map(int, FLAGS.queries):
        b = FLAGS.decode_batch if t == 1 else FLAGS.batch
        shape = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
        q = shape(b, t, FLAGS.heads, FLAGS.head_dim)
        k = shape(b, FLAGS.slots, FLAGS.kv_heads, FLAGS.head_dim)
        v = shape(b, FLAGS.slots, FLAGS.kv_heads, FLAGS.head_dim)
        pos = FLAGS.slots // 2 - t + jnp.arange(t)[None, :] + jnp.zeros((b, 1), jnp.int32)
        mask = jnp.arange(FLAGS.slots)[None, None, :] <= pos[:, :, None]
        form = dec if t == 1 else new
        t_old, t_new = _time(old, q, k, v, mask), _time(form, q, k, v, mask)
        diff = float(jnp.abs(form(q, k, v, mask) - old(q, k, v, mask)).max())
        print(f"{t:>8} {b:>5} {t_old:>8.2f} {t_new:>8.2f} {t_old / t_new:>7.2f}x  {diff:.2e}")


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
