"""Costs of the per-step token choosers, and whether inference drafts equal the training-time
(teacher-forced) drafts of the same drafter.

  python benchmarks/experiments/token_choosers/op_costs.py
      [--target=... --drafter=... --regenerated=FILE.jsonl]
      [--json_out=benchmarks/results/tiny-code/op_costs.json]

1. Microseconds per call, inside a compiled 1000-iteration loop (no dispatch), over a
   [1, 16, V] block of logits: `jnp.argmax` vs `sampling.greedy_argmax`, and
   `jax.random.categorical` vs `sampling.sample_categorical`.
2. With --regenerated (records of `training/regenerate.py`, e.g. a drafter run's
   workdir/regenerated.jsonl): for the last --num_records prompts, the drafts `generate`
   made at each step against the drafter run teacher-forced on the final sequence at the same
   anchor (context = the target's taps before it); their agreement should be 1.0. Also tau
   there and the acceptance the teacher-forced drafts would get.

The last line printed is the result as JSON; --json_out also writes it, with the command,
commit, date and machine (`dflash_jax.support.provenance`).
"""

import json
import time

import numpy as np
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "assets/tiny-code/target", "Target directory.")
flags.DEFINE_string("drafter", "assets/tiny-code/drafter", "Drafter directory.")
flags.DEFINE_string("regenerated", None, "Regenerated records for the draft-consistency check.")
flags.DEFINE_integer("num_records", 8, "Records checked.")
flags.DEFINE_integer("max_new_tokens", 96, "Tokens generated per record.")
flags.DEFINE_string("json_out", None, "Also write the result (with its provenance) here.")
flags.DEFINE_integer("iters", 1000, "Calls per chooser inside the compiled loop.", lower_bound=1)


def per_call_us(fn, x, keyed=False, iters=1000):
    import jax
    import jax.numpy as jnp

    def body(i, c):  # the carry feeds back so the loop cannot be hoisted
        key = jax.random.PRNGKey(i) if keyed else None
        return c + fn(x + c[..., None].astype(x.dtype) * 0, key).sum()

    loop = jax.jit(lambda x: jax.lax.fori_loop(0, iters, body, jnp.zeros(x.shape[:-1], jnp.int32)))
    loop(x).block_until_ready()
    t0 = time.perf_counter()
    loop(x).block_until_ready()
    return 1e6 * (time.perf_counter() - t0) / iters


def choosers(vocab, iters):
    import jax
    import jax.numpy as jnp

    from dflash_jax.models import sampling

    x = jax.random.normal(jax.random.PRNGKey(0), (1, 16, vocab)) * 3
    rows = {
        "jnp.argmax": per_call_us(lambda l, k: jnp.argmax(l, -1).astype(jnp.int32), x, iters=iters),
        "sampling.greedy_argmax": per_call_us(
            lambda l, k: sampling.greedy_argmax(l), x, iters=iters
        ),
        "jax.random.categorical": per_call_us(
            lambda l, k: jax.random.categorical(k, l, axis=-1).astype(jnp.int32), x, True, iters
        ),
        "sampling.sample_categorical": per_call_us(
            lambda l, k: sampling.sample_categorical(k, l), x, True, iters
        ),
    }
    for name, us in rows.items():
        print(f"  {name:28s} {us:8.1f} us per [1,16,{vocab}] block")
    return rows


def ratios(rows):
    """How many times cheaper the library's choosers are than jax's (time ratios)."""
    return {
        "categorical_over_sample_categorical": rows["jax.random.categorical"]
        / rows["sampling.sample_categorical"],
        "argmax_over_greedy_argmax": rows["jnp.argmax"] / rows["sampling.greedy_argmax"],
    }


def draft_consistency(target, drafter):
    import jax.numpy as jnp

    import dflash_jax as dj
    from dflash_jax.drafters.dflash import DFlashDrafter, decode_attend
    from dflash_jax.support import console
    from dflash_jax.training.regenerate import read_records

    tmod, dmod = target.module, drafter.module
    bs, mask = drafter.config.block_size, drafter.config.mask_token_id
    tv, dv = {"params": target.params}, {"params": drafter.params}
    agree, tf_accept, taus = [], [], []
    for rec in console.progress(
        read_records(FLAGS.regenerated)[-FLAGS.num_records :], desc="records", unit="record"
    ):
        prompt = list(rec["prompt_ids"])
        res = dj.generate(target, drafter, [prompt], FLAGS.max_new_tokens, return_drafts=True)
        out = res.tokens[0]
        seq = jnp.asarray([prompt + out + [0] * bs], jnp.int32)
        _, _, taps = tmod.apply(tv, seq, tap_layers=drafter.config.target_layer_ids)
        ck, cv = dmod.apply(
            dv, taps, jnp.arange(seq.shape[1])[None], method=DFlashDrafter.context_kv
        )
        p = len(prompt)  # the block of step i starts at the last committed token
        for a, drafts in zip(res.acceptance_lengths[0], res.drafts[0]):
            block = jnp.asarray([[int(seq[0, p])] + [mask] * (bs - 1)], jnp.int32)
            h = dmod.apply(
                dv,
                tmod.apply(tv, block, method=dj.Transformer.embed),
                p + jnp.arange(bs)[None],
                ck,
                cv,
                decode_attend(jnp.asarray([p], jnp.int32)),
            )
            tf = np.asarray(jnp.argmax(tmod.apply(tv, h[:, 1:], method=dj.Transformer.logits), -1))[
                0
            ]
            agree.append(float(np.mean(tf == np.asarray(drafts))))
            tf_accept.append(1 + int(np.cumprod(tf == np.asarray(seq[0, p + 1 : p + bs])).sum()))
            p += a
        taus.append(res.tau)
    out = {
        "records": len(taus),
        "draft_agreement": float(np.mean(agree)),
        "tau": float(np.mean(taus)),
        "teacher_forced_accept": float(np.mean(tf_accept)),
    }
    print(
        f"  {out['records']} records: inference drafts = teacher-forced drafts for "
        f"{100 * out['draft_agreement']:.1f}% of positions; tau {out['tau']:.2f}, "
        f"teacher-forced acceptance {out['teacher_forced_accept']:.2f}"
    )
    return out


def main(argv):
    del argv
    import jax

    import dflash_jax as dj
    from dflash_jax.models import hub
    from dflash_jax.support import console

    console.cli_startup()
    target = dj.load_target(hub.resolve_or_exit(FLAGS.target, what="--target"))
    print(f"backend {jax.default_backend()}: token choosers inside a compiled loop")
    result = {"choosers_us": choosers(target.config.vocab_size, FLAGS.iters)}
    result["ratios"] = ratios(result["choosers_us"])
    print(
        "  jax.random.categorical / sampling.sample_categorical: "
        f"{result['ratios']['categorical_over_sample_categorical']:.2f}x"
    )
    if FLAGS.regenerated:
        drafter = dj.load_drafter(
            hub.resolve_or_exit(FLAGS.drafter, what="--drafter"), target=target
        )
        result["consistency"] = draft_consistency(target, drafter)
    if FLAGS.json_out:
        from dflash_jax.support import provenance

        with open(FLAGS.json_out, "w") as f:
            json.dump({**provenance.record(), "target": FLAGS.target, **result}, f, indent=1)
        print(f"wrote {FLAGS.json_out}")
    print(json.dumps(result))


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
