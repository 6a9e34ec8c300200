"""Speculative decoding: the API (`generation.generate`, which is `dflash_jax.generate`), the
propose / verify / accept / commit step as a frozen `Decoder` (`step`), the compiled programs
that run it (`programs`), sampling rules, draft trees, and the request checks and result type
(`request`).

Submodules import on first use (`dflash_jax.decoding.<name>`); importing the package loads nothing."""

from dflash_jax.support import lazy as _lazy  # (stdlib only)


def __getattr__(name):
    return _lazy.attribute(__name__, {}, globals(), name)
