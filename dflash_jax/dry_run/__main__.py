"""`python -m dflash_jax.dry_run ...`: see the package docstring."""

from dflash_jax.dry_run.cli import main

if __name__ == "__main__":
    main()
