"""The drafters: `dflash` (the DFlash block-diffusion drafter, z-lab format). New drafter
families land here beside it.

Submodules import on first use (`dflash_jax.drafters.<name>`); importing the package loads nothing."""

from dflash_jax.support import lazy as _lazy  # (stdlib only)


def __getattr__(name):
    return _lazy.attribute(__name__, {}, globals(), name)
