"""What the tap cache (`--config.data.cache_taps=True`) buys a drafter's training: the same
config trained twice in one process, with and without the cache (both `data.allow_split=False`,
so both read the same rows), and the trainer's own throughput compared over the steps after
the first epoch (the cache is filled in the first; the compile and the first epoch are left
out of both).

  head -48 runs/smollm2/responses.jsonl > /tmp/resp48.jsonl     # a few steps an epoch
  python benchmarks/experiments/tap_store/tap_cache.py --config=configs/smollm2/drafter.py \\
      --config.regen.output=/tmp/resp48.jsonl --steps=14 \\
      --json_out=benchmarks/results/smollm2/tap_cache.json

What not splitting documents costs in padding, on a regenerated-responses file (no training):

  python benchmarks/experiments/tap_store/tap_cache.py \\
      --padding_of=runs/smollm2/responses.jsonl --seq_len=512

Prints the tokens/s of each run's steps past the first epoch (median of the logged windows),
their ratio and the losses (they must agree: the cache changes where the taps come from, not
what they are).
"""

import json
import os
import shutil
import tempfile

import numpy as np
from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "The training config (as train.py's).")
flags.DEFINE_integer("steps", 14, "Steps of each run (past the first epoch's).")
flags.DEFINE_string("workdir", None, "Where the two runs go (default: a temp dir, removed).")
flags.DEFINE_string("json_out", None, "Write the figures as JSON here.")
flags.DEFINE_string("padding_of", None, "Only count rows with and without splits of this JSONL.")
flags.DEFINE_integer("seq_len", 512, "Row length for --padding_of.")


def padding(path, seq_len):
    """(rows with splits, rows without) of the file's records (input_ids + eos), in its order:
    `packing.rows_for`, the packer's rule."""
    from dflash_jax.data.packing import rows_for

    with open(path) as f:
        lengths = [len(json.loads(line)["input_ids"]) + 1 for line in f if line.strip()]
    return len(lengths), sum(lengths), rows_for(lengths, seq_len), rows_for(lengths, seq_len, False)


def _epoch_batches(config, workdir):
    """Batches of the first epoch (padded rows included), counted on the training stream."""
    from dflash_jax.training import experiment

    it = experiment.build_experiment(config, workdir).train_iter
    n = 0
    while it.epoch == 0:
        next(it)
        n += 1
    return n


def main(argv):
    del argv
    from dflash_jax.support import provenance
    from dflash_jax.training import trainer

    if FLAGS.padding_of:
        n, tokens, split, whole = padding(FLAGS.padding_of, FLAGS.seq_len)
        print(
            f"{n} records, {tokens} tokens: {split} rows of {FLAGS.seq_len} with splits, "
            f"{whole} without ({1 - split / whole:.0%} of them padding)"
        )
        return
    base = FLAGS.config
    if base is None:
        raise app.UsageError("--config is required")
    base.data.allow_split = False
    base.eval_every = 0
    base.log_every = 1
    base.checkpoint_every = 10**6
    root = FLAGS.workdir or tempfile.mkdtemp(prefix="tap-cache-bench-")
    try:
        first = _epoch_batches(base, os.path.join(root, "probe"))
        if FLAGS.steps <= first + 2:
            raise app.UsageError(
                f"--steps {FLAGS.steps}: the first epoch is {first} steps; give more than "
                f"{first + 2} (fewer conversations in regen.output make epochs shorter)"
            )
        base.num_train_steps = FLAGS.steps
        runs = {}
        for name, cached in (("plain", False), ("cached", True)):
            cfg = base.copy_and_resolve_references()
            cfg.data.cache_taps = cached
            wd = os.path.join(root, name)
            out = trainer.train_and_evaluate(cfg, wd)
            recs = [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]
            rates = [r["tokens_per_s"] for r in recs if r.get("split") == "train"]
            steps = [r["step"] for r in recs if r.get("split") == "train"]
            after = [x for s, x in zip(steps, rates) if s > first + 1]  # its first hit is +1
            runs[name] = dict(
                tokens_per_s=float(np.median(after)),
                windows=len(after),
                losses=[float(l) for _, l in out["losses"]],
            )
            print(f"{name}: {runs[name]['tokens_per_s']:.1f} tokens/s over {len(after)} steps")
    finally:
        if FLAGS.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    ratio = runs["cached"]["tokens_per_s"] / runs["plain"]["tokens_per_s"]
    dl = np.max(np.abs(np.subtract(runs["cached"]["losses"], runs["plain"]["losses"])))
    print(
        f"first epoch {first} steps; cached / plain throughput {ratio:.2f}x; max |loss diff| {dl:.2e}"
    )
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(
                dict(
                    first_epoch_steps=first,
                    steps=FLAGS.steps,
                    ratio=ratio,
                    max_loss_diff=float(dl),
                    runs=runs,
                    **provenance.record(),
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    from dflash_jax.support import cli

    cli.run(main)  # bad input: one line, `error: ...`, exit status 2
