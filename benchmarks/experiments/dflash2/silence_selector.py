"""A DFlash 2 drafter with its candidate selector silenced: the codebooks zeroed, so the
selector's walk takes each slot's largest logit (the drafter's own argmax chain, as a DFlash
drafter drafts). Beside the drafter as trained, it tells what the selector adds to tau.

  python benchmarks/experiments/dflash2/silence_selector.py \
      --drafter=assets/smollm2-135m-instruct/drafter_dflash2 --target=smollm2-135m-instruct \
      --out=runs/smollm2/drafter_dflash2_silenced
"""

import os
import sys

from absl import flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, ROOT)

FLAGS = flags.FLAGS


def define_flags():
    """The flags (defined when run as a script, so tests can import this module)."""
    flags.DEFINE_string("drafter", None, "A DFlash 2 drafter directory.")
    flags.DEFINE_string("target", "smollm2-135m-instruct", "Its target (directory, GGUF or name).")
    flags.DEFINE_string("out", None, "Where to write the silenced drafter (a new directory).")


def main(argv):
    del argv
    if not FLAGS.drafter or not FLAGS.out:
        raise ValueError("--drafter and --out are required")
    if os.path.exists(FLAGS.out):
        raise ValueError(f"--out {FLAGS.out} exists; choose a new directory")
    import dflash_jax as dj

    from dflash_jax.drafters.dflash import silence_selector

    target = dj.load_target(FLAGS.target)
    drafter = dj.load_drafter(FLAGS.drafter, target=target)
    if not drafter.config.dflash2:
        raise ValueError("--drafter: not a DFlash 2 drafter (it has no candidate selector)")
    quiet = dj.Drafter(drafter.config, silence_selector(drafter.params))
    dj.save_drafter(quiet, FLAGS.out, dtype="bfloat16")
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    from dflash_jax.support import cli

    define_flags()
    cli.run(main)
