"""Train a DFlash drafter or a small target.

    python train.py --config=configs/tiny_code/target.py --workdir=/tmp/tiny_target
    python train.py --config=configs/tiny_code/drafter.py --workdir=/tmp/tiny_drafter \
        --config.target_path=/tmp/tiny_target/export/target    # or a hub id: Qwen/Qwen3-8B

Prints one line per log step, evaluations, checkpoints and the export; library log lines
(Orbax, JAX) go to WORKDIR/train.log, and to stderr too with --verbose (or --verbosity=0).

Exit codes: 0 done; 1 non-finite loss (last good checkpoint kept) or a bug; 2 bad input (one
line on stderr); 3 stopped by SIGTERM/SIGINT after saving a checkpoint (rerun to resume).
"""

import os
import sys

from dflash_jax.support import interrupts, locks

# Ctrl-C / SIGTERM before the first training step: one line and exit 130 / 143 (no traceback,
# no crash mid-compile); from the first step on, a checkpoint and exit 3 (the trainer's flag).
interrupts.guard("interrupted before the first training step: this run saved no checkpoint")

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from dflash_jax.parallel import distributed
from dflash_jax.support import checks, cli
from dflash_jax.training import config_checks, train_and_evaluate

config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
flags.DEFINE_string("workdir", None, "checkpoints, metrics and exports (required unless --dry_run)")
flags.DEFINE_string("profile_dir", None, "write a jax.profiler trace here (config.profile_dir)")
flags.DEFINE_string("profile_steps", None, "START:COUNT steps to trace (default 5:3)")
flags.DEFINE_bool(
    "dry_run",
    False,
    "Compile the trainer's step for an 8B-sized target and its "
    "drafter for a TPU topology from abstract params (libtpu, no TPU needed); print "
    "per-device HBM, FLOPs and collectives (batch, length, anchors from the config).",
)
flags.DEFINE_string("topology", "v5p:2x2x1", "Dry run: v5p:2x2x1, v4:2x2x1, v5e:2x4, ... or cpu:8.")
flags.DEFINE_string("dry_run_model", "qwen3_8b", "Dry run: qwen3_8b, qwen3_4b, llama31_8b, small.")
flags.DEFINE_string("mesh", None, "Dry run: ';'-separated meshes, e.g. 'fsdp=8;fsdp=4,tensor=2'.")
flags.DEFINE_bool("verbose", False, "Show library log lines (Orbax, JAX) on stderr too.")
flags.DEFINE_bool(
    "distributed",
    False,
    "Call jax.distributed.initialize() (TPU pod / SLURM / "
    "multi-node: it finds the coordinator itself). Under `python -m "
    "dflash_jax.launch` this happens without the flag.",
)
flags.DEFINE_string("json_out", None, "Dry run: write the result(s) as JSON here.")


def _profile_steps(spec):
    """--profile_steps START:COUNT as (start, count); None when not given."""
    if not spec:
        return None
    start, sep, count = spec.partition(":")
    try:
        start, count = int(start), int(count)
    except ValueError:
        start = count = None
    if not sep or start is None or start < 0 or count < 1:
        raise ValueError(
            "--profile_steps must be START:COUNT, the first step to trace (>= 0) and how "
            f"many steps (>= 1), e.g. --profile_steps=5:3; got {spec!r}"
        )
    return start, count


def main(argv):
    del argv
    config = flags.FLAGS.config
    if flags.FLAGS.dry_run:
        from dflash_jax import dry_run

        f = flags.FLAGS
        try:  # the trainer's step with this config's recipe, batch and length
            n_cpu = dry_run.topology.cpu_device_count(f.topology)
            if n_cpu is not None:
                dry_run.ensure_cpu_devices(n_cpu)
            dry_run.run(
                f.topology,
                f.dry_run_model.split(","),
                "train",
                f.mesh.split(";") if f.mesh else None,
                f.json_out,
                config=config,
            )
        except dry_run.UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        return
    # Flags and config values, the workdir, the data files, the mesh against the devices and
    # the drafter's taps against the target: all checked before anything is built, computed
    # or written (a bad run leaves no file behind; regeneration takes hours on an 8B target).
    if not flags.FLAGS.workdir:
        raise app.UsageError("--workdir is required (checkpoints, metrics and exports go there)")
    profile_steps = _profile_steps(flags.FLAGS.profile_steps)
    config_checks.check_train_config(config)
    checks.writable_dir(flags.FLAGS.workdir, "--workdir")
    if flags.FLAGS.profile_dir:
        checks.profile_dir(flags.FLAGS.profile_dir, "--profile_dir")
    # One run per workdir (a second one is refused in one line naming the first); with
    # --distributed the primary process takes it once the process group is known.
    if not flags.FLAGS.distributed:
        locks.acquire(flags.FLAGS.workdir, "--workdir", directory=True)
    # Then model locations (directories or hub ids): a bad one is one line, exit 2.
    from dflash_jax.models import hub
    from dflash_jax.support import console

    if config.target_path:
        config.target_path = hub.resolve_or_exit(config.target_path, what="--config.target_path")
    if config.drafter.init_path:
        config.drafter.init_path = hub.resolve_or_exit(
            config.drafter.init_path, what="--config.drafter.init_path"
        )
    if hub.looks_like_repo_id(config.tokenizer_dir) and not os.path.exists(config.tokenizer_dir):
        config.tokenizer_dir = hub.resolve_or_exit(
            config.tokenizer_dir, what="--config.tokenizer_dir"
        )
    console.quiet_startup()  # before JAX starts: no TPU probe (and its log lines) on CPU hosts
    distributed.initialize(flags.FLAGS.distributed)  # before any other JAX call
    if flags.FLAGS.distributed and distributed.is_primary():
        locks.acquire(flags.FLAGS.workdir, "--workdir", directory=True)
    from dflash_jax.training import trainer

    checked = trainer.check_run(config, flags.FLAGS.workdir)  # the devices are known here
    workdir = trainer.make_workdir(flags.FLAGS.workdir)
    log_file = os.path.join(workdir, "train.log") if distributed.is_primary() else None
    fresh_log = log_file is not None and not os.path.exists(log_file)
    present = set(os.listdir(workdir)) | {"train.log", locks.DIR_LOCK}
    console.configure_logging(flags.FLAGS.verbose, log_file=log_file)
    if flags.FLAGS.profile_dir:
        config.profile_dir = flags.FLAGS.profile_dir
    if profile_steps:
        config.profile_start_step, config.profile_num_steps = profile_steps
    logging.info(
        "JAX process %d/%d, local devices %s",
        jax.process_index(),
        jax.process_count(),
        jax.local_devices(),
    )
    try:
        summary = train_and_evaluate(config, workdir, checked)  # not checked again
    except cli.expected_errors():
        # Refused (a model, data or checkpoint found unfit once read): a run that wrote nothing
        # else leaves no train.log either (nor the workdir it created: `locks`).
        if fresh_log and set(os.listdir(workdir)) <= present:
            console.close_log_file()
            os.remove(log_file)
        raise
    if summary["status"] == "preempted":  # saved; a scheduler must not read this as success
        sys.exit(cli.EXIT_PREEMPTED)
    sys.exit(1 if summary["status"] == "nan" else 0)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    cli.run(
        main
    )  # user errors: one line on stderr, exit 2; see dflash_jax/support/cli.py for codes
