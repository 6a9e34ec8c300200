"""`python -m dflash_jax.launch`: the local multi-process launcher's command
(`dflash_jax.parallel.launch`, whose docstring gives the flags)."""

import sys

from dflash_jax.parallel.launch import main

if __name__ == "__main__":
    sys.exit(main())
