"""Compiles the real programs for a TPU topology on this machine (libtpu; no TPU needed).

    python -m dflash_jax.dry_run --topology=v5e:2x4 --model=qwen3_8b --mode=infer [flags]
    python -m dflash_jax.dry_run --topology=v5p:2x2x1 --model=qwen3_8b --mode=train --mesh=fsdp=4

See the package docstring (dflash_jax/dry_run/__init__.py) and docs/tpu_dry_run.md. Bad input:
one line `error: ...` on stderr, exit status 2 (dflash_jax/support/cli.py).
"""

from dflash_jax.support import interrupts

if (
    __name__ == "__main__"
):  # Ctrl-C mid-compile: one line, exit 130 (dflash_jax/support/interrupts.py)
    interrupts.guard("interrupted: nothing was written")

from absl import flags

from dflash_jax.dry_run import cli as dry_run_cli
from dflash_jax.support import cli

if __name__ == "__main__":
    dry_run_cli.define_flags()
    flags.adopt_module_key_flags(dry_run_cli)  # --help lists them (defined in cli.py)
    cli.run(dry_run_cli.command_line)
