"""Sequence-level unlikelihood on a toy target: the share of greedy continuation tokens inside
a repeated 4-gram after 100 steps of next-token training on random-token documents, with the
unlikelihood term (weight 1) and without (weight 0): same data, seed and steps. The setting of
`tests/test_training.py::test_unlikelihood_training_lowers_greedy_repetition` (which asserts
only the direction: with < 0.6x without), here with its figures written down.

    python benchmarks/experiments/unlikelihood/unlikelihood_toy.py \\
        --json_out=benchmarks/results/toy/unlikelihood.json

CPU, about a minute per run on a 2-core machine.
"""

import json
import os
import tempfile

import numpy as np
from absl import flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("json_out", None, "Write the result here.")


def toy_config(weight):
    """configs/tiny_test.py as a 100-step target run on synthetic documents (the test's)."""
    from configs import tiny_test

    c = tiny_test.get_config()
    c.mode = "target"
    c.data.update(kind="synthetic", seq_len=64, batch_size=8, num_docs=256, doc_len=64)
    c.unlikelihood.update(
        weight=weight,
        batch_size=8,
        prompt_len=16,
        max_new_tokens=32,
        prompt_source="docs",
        num_prompts=256,
    )
    c.update(
        num_train_steps=100, eval_every=0, log_every=50, learning_rate=3e-3, checkpoint_every=100000
    )
    return c


def repeated_share(weight, workdir):
    """Train, then the share of greedy tokens (32 fresh prompts, 32 new tokens each) inside a
    4-gram the continuation already produced."""
    import dflash_jax as dj
    from dflash_jax.training import trainer
    from dflash_jax.training import unlikelihood as ul

    out = trainer.train_and_evaluate(toy_config(weight), workdir)
    if out["status"] != "done":
        raise RuntimeError(f"training stopped: {out['status']}")
    target = dj.load_target(out["export"])
    prompts = np.random.RandomState(5).randint(2, 64, (32, 16)).tolist()
    res = dj.generate(target, None, prompts, 32)
    return float(ul.build_batch(prompts, res.tokens, 48, 4)[1])


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments (flags only): {' '.join(argv[1:])}")
    from dflash_jax.support import console

    console.cli_startup()
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        for weight in (0.0, 1.0):
            rates[str(weight)] = repeated_share(weight, os.path.join(tmp, str(weight)))
            print(f"unlikelihood weight {weight}: repeated 4-gram share {rates[str(weight)]:.3f}")
    if FLAGS.json_out:
        from dflash_jax.support import provenance

        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(
                {
                    **provenance.record(),
                    "config": "configs/tiny_test.py, mode=target, synthetic documents, 100 steps",
                    "repeated_4gram_share_by_weight": rates,
                },
                f,
                indent=1,
            )
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    from dflash_jax.support import cli

    define_flags()
    cli.run(main)
