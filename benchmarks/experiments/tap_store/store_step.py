"""What a drafter's training step costs with the target's pass replaced by a tap store and the
head restricted to a draft vocabulary: the same rows and anchors (the trainer's batches and
keys, one seed), each variant in a process of its own (its peak memory is its own), the first
step (the compile) left out, measured one after another on this machine.

  python benchmarks/experiments/tap_store/store_step.py --config=configs/smollm2/drafter.py \\
      --config.regen.output=runs/smollm2/responses6.jsonl \\
      --config.drafter.init_path=assets/smollm2-135m-instruct/drafter \\
      --store=runs/smollm2/store6 --steps=4 \\
      --json_out=benchmarks/results/smollm2/store_step.json

Variants (--variants, comma-separated):
  target      the stage-5 step: the target's tap pass every step, the full 49,152-row head
  store       taps read from the store, full head
  store_kK    taps from the store, the head's K most frequent answer tokens (e.g. store_k16384)
  store_kK_kl the same with the top-k KL loss (soft labels from the store)
Prints tokens/s (rows x seq_len per second of step, the store's reads included), the speedup
over the first variant, the host seconds spent reading the store, and each process's peak RSS.
"""

import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

from absl import flags
from ml_collections import config_flags

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "The training config (as train.py's).")
flags.DEFINE_string("store", "", "The tap store of the config's data (regen.output).")
flags.DEFINE_string("variants", "target,store,store_k16384,store_k8192,store_k16384_kl", "")
flags.DEFINE_integer("steps", 4, "Timed steps per variant (after one compile step).")
flags.DEFINE_string("json_out", "", "Write the figures here.")
flags.DEFINE_string("child", "", "(internal) run this one variant, print its JSON.")

VARIANT = re.compile(r"^(target|store)(?:_k(\d+))?(_kl)?$")


def parse_variant(name: str):
    """(uses the store, draft vocabulary size or 0, loss) of a variant name; ValueError else."""
    m = VARIANT.match(name)
    if not m or (m.group(1) == "target" and (m.group(2) or m.group(3))):
        raise ValueError(
            f"variant {name!r}: expected target, store, store_kK or store_kK_kl (K an integer)"
        )
    return m.group(1) == "store", int(m.group(2) or 0), "topk_kl" if m.group(3) else "ce"


def run_variant(config, store: str, name: str, steps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from dflash_jax.training import experiment, tap_store
    from dflash_jax.training.step import TrainState, make_optimizer, make_train_step

    use_store, k, loss = parse_variant(name)
    config.data.allow_split = False
    config.loss = loss
    config.drafter.draft_vocab_size = k
    config.data.tap_store = store if use_store else ""
    import tempfile

    exp = experiment.build_experiment(config, tempfile.mkdtemp(prefix="store-step-"))
    optimizer, _ = make_optimizer(config, 1000)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=exp.init_params,
        opt_state=optimizer.init(exp.init_params),
        rng=jax.random.PRNGKey(config.seed),
    )
    step = make_train_step(exp.loss_fn, optimizer, donate=True)
    source = None
    if use_store:
        source = tap_store.StoreSource(tap_store.TapStore(store), exp.tap_layers)
    times, read_s, losses = [], [], []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        raw = next(exp.train_iter)
        batch = {key: raw[key] for key in ("input_ids", "loss_mask", "segment_ids")}
        r0 = source.read_s if source else 0.0
        if source is not None:
            got = source(raw)
            batch["taps"] = got["taps"]
            if loss == "topk_kl":
                batch.update(topk_ids=got["topk_ids"], topk_logp=got["topk_logp"])
        state, metrics = step(state, exp.frozen, batch)
        losses.append(float(metrics["loss"]))  # waits for the step
        if i:  # the first step compiles
            times.append(time.perf_counter() - t0)
            read_s.append((source.read_s - r0) if source else 0.0)
    b, s = config.data.batch_size, config.data.seq_len
    med = statistics.median(times)
    return dict(
        variant=name,
        step_s=med,
        step_s_all=times,
        tokens_per_s=b * s / med,
        store_read_s=statistics.median(read_s),
        losses=losses,
        peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        draft_vocab_size=k,
        loss=loss,
    )


def main(argv):
    from dflash_jax.support import provenance

    names = [v for v in FLAGS.variants.split(",") if v]
    for name in names:
        parse_variant(name)
    if FLAGS.config is None:
        raise ValueError("--config is required")
    if FLAGS.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {FLAGS.steps}")
    if any(parse_variant(n)[0] for n in names + [FLAGS.child] if n) and not os.path.isfile(
        os.path.join(FLAGS.store, "manifest.json")
    ):
        raise ValueError(f"--store {FLAGS.store!r}: not a tap store (no manifest.json)")
    if FLAGS.child:
        out = run_variant(FLAGS.config, FLAGS.store, FLAGS.child, FLAGS.steps)
        print("RESULT " + json.dumps(out), flush=True)
        return
    args = [a for a in sys.argv[1:] if not a.startswith(("--child", "--json_out", "--variants"))]
    rows = []
    for name in names:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), f"--child={name}", *args],
            capture_output=True,
            text=True,
        )
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.stderr.write(proc.stderr[-3000:])
            raise RuntimeError(f"variant {name} failed (exit {proc.returncode})")
        rows.append(json.loads(line[0][len("RESULT ") :]))
        r = rows[-1]
        print(
            f"{name:>18}: {r['tokens_per_s']:7.1f} tokens/s ({r['step_s']:.2f} s a step, "
            f"{r['store_read_s']:.2f} s reading the store), x{r['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}, "
            f"peak RSS {r['peak_rss_gib']:.2f} GiB",
            flush=True,
        )
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(dict(rows=rows, steps=FLAGS.steps, **provenance.record()), f, indent=1)


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)
