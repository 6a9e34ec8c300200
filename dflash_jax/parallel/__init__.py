"""More than one device or process: the partition rules (`sharding`), process groups and
cross-process collectives (`distributed`), and the local multi-process launcher (`launch`).

Submodules import on first use (`dflash_jax.parallel.<name>`); importing the package loads nothing."""

from dflash_jax.support import lazy as _lazy  # (stdlib only)


def __getattr__(name):
    return _lazy.attribute(__name__, {}, globals(), name)
