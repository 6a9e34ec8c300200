"""Where a DFlash step's time goes: target forward cost vs tokens, drafter cost, and the
speedup they allow at a given tau.

  python benchmarks/step_costs.py --target=assets/tiny-code/target \
      --drafter=assets/tiny-code/drafter [--context=256] [--json_out=...]

Times (median of --repeats, after warm-up) at a fixed context length, batch 1:
  t_target(T)  one cached target forward over T new tokens (T=1 is an autoregressive step;
               T=bs is a verify pass), logits included;
  t_draft(bs)  one drafter pass over a block of bs (embedding, layers, LM head);
and prints the speedup model of ../shared/docs/dflash.md,
  speedup ~= tau * t_target(1) / (t_draft(bs) + t_target(bs)),
i.e. the tau needed for a 3x speedup at each block size, and its ceiling: the speedup if
every draft were accepted (tau = bs), which no drafter can beat on this device. Standalone
calls carry their dispatch cost, which flatters the 1-token step; the same figures are then
measured per iteration of `generate`'s compiled decode loop, which is what the benchmark sees.

Committed results: `python benchmarks/step_costs.py
--json_out=benchmarks/results/tiny-code/step_costs.json`.
"""

import json

import numpy as np
from absl import app, flags

from benchmarks.timing import loop_step_ms, median_time  # noqa: E402
from dflash_jax.support import provenance  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "assets/tiny-code/target", "Target directory.")
flags.DEFINE_string("drafter", "assets/tiny-code/drafter", "Drafter directory.")
flags.DEFINE_integer("context", 256, "Committed tokens in the cache when timing.")
flags.DEFINE_list("block_sizes", ["1", "2", "4", "8", "16"], "Forward widths to time.")
flags.DEFINE_integer("repeats", 50, "Timed calls per measurement (median).")
flags.DEFINE_string("json_out", None, "Write the figures here.")
flags.DEFINE_integer("loop_tokens", 64, "Tokens generated per in-loop timing (the benchmark's 64).")
flags.DEFINE_integer("loop_repeats", 5, "In-loop timings per setting (median).")


def _widths(values):
    """--block_sizes as sorted distinct ints >= 1, always with 1: the autoregressive step every
    wider one is compared with."""
    try:
        widths = {int(x) for x in values}
    except ValueError:
        raise app.UsageError(f"--block_sizes wants integers, got {values}") from None
    if not widths or min(widths) < 1:
        raise app.UsageError(f"--block_sizes wants integers >= 1, got {values}")
    return sorted(widths | {1})


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    widths = _widths(FLAGS.block_sizes)
    import functools

    import jax
    import jax.numpy as jnp

    import dflash_jax as dj
    from dflash_jax.decoding.step import Decoder, Plan
    from dflash_jax.drafters.dflash import ContextCache, decode_attend
    from dflash_jax.models import hub
    from dflash_jax.models.transformer import KVCache
    from dflash_jax.support import console

    target_dir = hub.resolve_or_exit(FLAGS.target, what="--target")
    drafter_dir = hub.resolve_or_exit(FLAGS.drafter, what="--drafter")
    console.cli_startup()
    target = dj.load_target(target_dir)
    drafter = dj.load_drafter(drafter_dir, target=target)
    tmod, dmod = target.module, drafter.module
    ctx_len = FLAGS.context
    capacity = ctx_len + 64
    rng = np.random.RandomState(0)
    prompt = jnp.asarray(rng.randint(0, target.config.vocab_size, (1, ctx_len)), jnp.int32)
    taps_layers = drafter.config.target_layer_ids

    @jax.jit
    def prefill(tp, dp):
        cache = KVCache.create(target.config, 1, capacity)
        _, cache, taps = tmod.apply({"params": tp}, prompt, cache=cache, tap_layers=taps_layers)
        ctx = ContextCache.create(drafter.config, 1, capacity)
        decoder = Decoder(tp, dp, tmod, dmod, Plan(block_size=drafter.config.block_size))
        ctx = decoder.write_context(ctx, taps, jnp.arange(ctx_len)[None], jnp.array([ctx_len]))
        return cache, ctx

    cache, ctx = prefill(target.params, drafter.params)

    @functools.partial(jax.jit, static_argnums=0)
    def target_step(t, tp, cache):
        ids = jnp.ones((1, t), jnp.int32)
        hidden, cache, taps = tmod.apply(
            {"params": tp}, ids, cache=cache, tap_layers=taps_layers if t > 1 else ()
        )
        return Decoder(tp, None, tmod, None, Plan(1)).lm_logits(hidden), cache.lengths

    @functools.partial(jax.jit, static_argnums=0)
    def draft_step(bs, tp, dp, ctx):
        ids = jnp.ones((1, bs), jnp.int32)
        emb = tmod.apply({"params": tp}, ids, method=dj.Transformer.embed)
        pos = ctx.lengths[:, None] + jnp.arange(bs)[None]
        h = dmod.apply({"params": dp}, emb, pos, ctx.k, ctx.v, decode_attend(ctx.lengths))
        return jnp.argmax(Decoder(tp, None, tmod, None, Plan(1)).lm_logits(h[:, 1:]), -1)

    rows = {}
    for t in console.progress(widths, desc="block widths", unit="width"):
        rows[t] = {
            "t_target_ms": 1e3
            * median_time(lambda: target_step(t, target.params, cache), FLAGS.repeats)
        }
        if t > 1:
            rows[t]["t_draft_ms"] = 1e3 * median_time(
                lambda: draft_step(t, target.params, drafter.params, ctx), FLAGS.repeats
            )
    t1 = rows[1]["t_target_ms"]
    print(
        f"context {ctx_len}, backend {jax.default_backend()}: one autoregressive step "
        f"t_target(1) = {t1:.3f} ms"
    )
    print(
        "  bs | t_target(bs) ms | t_draft(bs) ms | step/AR-step | tau for 3x | speedup at tau=6"
        " | ceiling (tau=bs)"
    )
    for t in widths[1:]:
        r = rows[t]
        step = r["t_target_ms"] + r["t_draft_ms"]
        r["step_over_ar"] = step / t1
        r["tau_for_3x"] = 3.0 * step / t1
        r["speedup_at_tau6"] = 6.0 * t1 / step
        r["speedup_ceiling"] = t * t1 / step
        print(
            f"  {t:2d} | {r['t_target_ms']:15.3f} | {r['t_draft_ms']:14.3f} | "
            f"{r['step_over_ar']:12.2f} | {r['tau_for_3x']:10.2f} | "
            f"{r['speedup_at_tau6']:15.2f}x | {r['speedup_ceiling']:.2f}x"
        )
    # The same inside the compiled decode loop (no per-call dispatch): seconds per iteration of
    # `generate`'s while loop, median over repeats, on a random prompt of the same length.
    ids = np.asarray(prompt[0]).tolist()
    ar_loop = loop_step_ms(target, None, ids, FLAGS.loop_tokens, None, FLAGS.loop_repeats)
    print(f"in the compiled loop: one autoregressive step {ar_loop:.3f} ms")
    print("  bs | DFlash step ms | step/AR-step | tau for 3x | ceiling (tau=bs)")
    for t in widths[1:]:
        r = rows[t]
        r["loop_step_ms"] = loop_step_ms(
            target, drafter, ids, FLAGS.loop_tokens, t, FLAGS.loop_repeats
        )
        r["loop_step_over_ar"] = r["loop_step_ms"] / ar_loop
        r["loop_tau_for_3x"] = 3.0 * r["loop_step_over_ar"]
        r["loop_speedup_ceiling"] = t / r["loop_step_over_ar"]
        print(
            f"  {t:2d} | {r['loop_step_ms']:14.3f} | {r['loop_step_over_ar']:12.2f} | "
            f"{r['loop_tau_for_3x']:10.2f} | {r['loop_speedup_ceiling']:.2f}x"
        )
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(
                {
                    "context": ctx_len,
                    "backend": jax.default_backend(),
                    "loop_ar_step_ms": ar_loop,
                    "rows": {str(k): v for k, v in rows.items()},
                    **provenance.record(),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)
