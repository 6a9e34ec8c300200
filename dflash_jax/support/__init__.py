"""Process support, stdlib only (no JAX at import): console output, provenance of figures,
Ctrl-C / SIGTERM handling, lazy package attributes, the command-line error policy (`cli`) and
the value checks every entry point shares (`checks`).

Submodules import on first use (`dflash_jax.support.<name>`); importing the package loads nothing."""

from dflash_jax.support import lazy as _lazy  # (stdlib only)


def __getattr__(name):
    return _lazy.attribute(__name__, {}, globals(), name)
