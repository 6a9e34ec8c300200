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
flags.DEFINE_string("workdir", None, "checkpoints, metrics and exports (required unless --dry_run)")
flags.DEFINE_string("profile_dir", None, "write a jax.profiler trace here (config.profile_dir)")
flags.DEFINE_string("profile_steps", None, "START:COUNT steps to trace (default 5:3)")
flags.DEFINE_bool("dry_run", False, "Compile the trainer's step for an 8B-sized target and its "
                  "drafter for a TPU topology from abstract params (libtpu, no TPU needed); print "
                  "per-device HBM, FLOPs and collectives (batch, length, anchors from the config).")
flags.DEFINE_string("topology", "v5p:2x2x1", "Dry run: v5p:2x2x1, v4:2x2x1, v5e:2x4, ... or cpu:8.")
flags.DEFINE_string("dry_run_model", "qwen3_8b", "Dry run: qwen3_8b, qwen3_4b, llama31_8b, small.")
flags.DEFINE_string("mesh", None, "Dry run: ';'-separated meshes, e.g. 'fsdp=8;fsdp=4,tensor=2'.")
flags.DEFINE_string("json_out", None, "Dry run: write the result(s) as JSON here.")


def main(argv):
    del argv
    config = flags.FLAGS.config
    if flags.FLAGS.dry_run:
        from dflash_jax import dry_run

        f = flags.FLAGS
        if f.topology.startswith("cpu"):
            dry_run.ensure_cpu_devices(int(f.topology.partition(":")[2] or 8))
        try:  # the trainer's step with this config's recipe, batch and length
            dry_run.run(f.topology, f.dry_run_model.split(","), "train",
                        f.mesh.split(";") if f.mesh else None, f.json_out, config=config)
        except dry_run.UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        return
    if not flags.FLAGS.workdir:
        raise app.UsageError("--workdir is required (checkpoints, metrics and exports go there)")
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
