"""Train a DFlash drafter or a small target.

    python train.py --config=configs/tiny_code_target.py --workdir=/tmp/tiny_target
    python train.py --config=configs/tiny_code_drafter.py --workdir=/tmp/tiny_drafter \
        --config.target_path=/tmp/tiny_target/export/target
"""

import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from dflash_jax.training import train_and_evaluate

config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
flags.DEFINE_string("workdir", None, "checkpoints, metrics and exports", required=True)
flags.DEFINE_string("profile_dir", None, "write a jax.profiler trace here (config.profile_dir)")
flags.DEFINE_string("profile_steps", None, "START:COUNT steps to trace (default 5:3)")


def main(argv):
    del argv
    config = flags.FLAGS.config
    if flags.FLAGS.profile_dir:
        config.profile_dir = flags.FLAGS.profile_dir
    if flags.FLAGS.profile_steps:
        config.profile_start_step, config.profile_num_steps = map(
            int, flags.FLAGS.profile_steps.split(":"))
    logging.info("JAX process %d/%d, local devices %s", jax.process_index(),
                 jax.process_count(), jax.local_devices())
    summary = train_and_evaluate(config, flags.FLAGS.workdir)
    sys.exit(1 if summary["status"] == "nan" else 0)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main)
