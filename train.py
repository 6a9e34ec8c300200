"""Train a DFlash drafter or a small target.

    python train.py --config=configs/tiny_code_target.py --workdir=/tmp/tiny_target
    python train.py --config=configs/tiny_code_drafter.py --workdir=/tmp/tiny_drafter \
        --config.target_path=/tmp/tiny_target/export/target
"""

import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from dflash_jax import distributed
from dflash_jax.training import train_and_evaluate

config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
flags.DEFINE_string("workdir", None, "checkpoints, metrics and exports (required unless --dry_run)")
flags.DEFINE_string("profile_dir", None, "write a jax.profiler trace here (config.profile_dir)")
flags.DEFINE_string("profile_steps", None, "START:COUNT steps to trace (default 5:3)")
flags.DEFINE_bool("dry_run", False, "Compile the training step for an 8B-sized target and its "
                  "drafter from abstract params on a fake 8-device mesh; print per-device memory "
                  "and FLOPs (batch, length and anchors from the config).")
flags.DEFINE_string("dry_run_model", "qwen3_8b", "Dry run: qwen3_8b, qwen3_4b, llama31_8b, small.")
flags.DEFINE_string("mesh", None, "Dry run: ';'-separated meshes, e.g. 'fsdp=8;fsdp=4,tensor=2'.")
flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() (TPU pod / SLURM / "
                  "multi-node: it finds the coordinator itself). Under `python -m "
                  "dflash_jax.launch` this happens without the flag.")


def main(argv):
    del argv
    config = flags.FLAGS.config
    if flags.FLAGS.dry_run:
        from dflash_jax import dry_run

        dry_run.ensure_cpu_devices(8)  # before JAX initializes its backends
        dry_run.run(models=flags.FLAGS.dry_run_model.split(","), mode="train",
                    meshes=flags.FLAGS.mesh.split(";") if flags.FLAGS.mesh else None,
                    batch=config.data.batch_size, seq_len=config.data.seq_len,
                    num_anchors=config.num_anchors,
                    loss_chunk_anchors=config.get("loss_chunk_anchors", 0))
        return
    distributed.initialize(flags.FLAGS.distributed)  # before any other JAX call
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
