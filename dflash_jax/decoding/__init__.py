"""Speculative decoding: the propose / verify / accept / commit step and the programs that
run it (`speculative`, whose `generate` is `dflash_jax.generate`), sampling rules, draft trees,
and the request checks and result type (`request`).

Submodules import on first use (`dflash_jax.decoding.<name>`); importing the package loads nothing."""

from dflash_jax.support import lazy as _lazy  # (stdlib only)


def __getattr__(name):
    return _lazy.attribute(__name__, {}, globals(), name)
