"""The kinds of drafter there are, and how the library finds the kind of a thing it holds.

Adding a drafter: a module that defines its `KIND` (a `base.DrafterKind`) and one line in
`KIND_MODULES` (training it: a `DrafterTraining` in `dflash_jax/training/drafter_setup.py`).
Nothing outside `dflash_jax/drafters/` imports a concrete drafter's module or tests for a kind
(tests/test_layering.py); it asks:

  for_spec(spec)   the kind of infer.py's --drafter (a directory, hub id or name)
  of(x)            the kind of a drafter config, user object or decode module
  loop_of(dmod)    the kind drafting in the loop for a decode module (None: autoregressive)
  named(name)      a kind by its name (configs, the dry run's --drafter)

`using(*kinds)` puts kinds before the registered ones while a block runs: how tests draft with
an oracle in a kind's place (a subclass of the kind with a pass replaced).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Tuple

from dflash_jax.drafters.base import AUTOREGRESSIVE, DrafterKind

# In the order a --drafter spec is offered to them: by its name, by what its config.json
# says, and DFlash (z-lab format) for any other directory or hub id, last.
KIND_MODULES = (
    "dflash_jax.drafters.prompt_lookup",
    "dflash_jax.drafters.eagle3",
    "dflash_jax.drafters.dflash",
)


# Kinds consulted before the registered ones by `of` / `loop_of` (`using`).
OVERRIDES: Tuple[DrafterKind, ...] = ()


@contextlib.contextmanager
def using(*kinds: DrafterKind):
    """While the block runs, `of` answers with the first of `kinds` whose types match, before
    the registered kinds (the decode programs compiled meanwhile are their own: the loop's kind
    is part of `generate`'s program key)."""
    global OVERRIDES
    before = OVERRIDES
    OVERRIDES = tuple(kinds) + before
    try:
        yield
    finally:
        OVERRIDES = before


def kinds() -> Tuple[DrafterKind, ...]:
    """Every registered kind, in `KIND_MODULES` order."""
    return tuple(importlib.import_module(m).KIND for m in KIND_MODULES)


def names() -> Tuple[str, ...]:
    return tuple(k.name for k in kinds())


def named(name: str) -> DrafterKind:
    for kind in kinds():
        if kind.name == name:
            return kind
    raise ValueError(f"no drafter kind {name!r} (one of {', '.join(map(repr, names()))})")


def for_spec(spec) -> DrafterKind:
    """The kind of drafter `spec` names (None or "": no drafter, `AUTOREGRESSIVE`)."""
    if not spec:
        return AUTOREGRESSIVE
    for kind in kinds():
        if kind.claims(spec):
            return kind
    raise ValueError(f"--drafter={spec!r} names no kind of drafter")


def of(x) -> DrafterKind:
    """The kind of a drafter config, user object or decode module (None: `AUTOREGRESSIVE`)."""
    if x is None:
        return AUTOREGRESSIVE
    for kind in OVERRIDES + kinds():
        if isinstance(x, kind.config_type + kind.drafter_type + kind.module_type):
            return kind
    raise TypeError(f"not a drafter of any registered kind: {type(x).__name__}")


def loop_of(dmod) -> DrafterKind:
    """The kind that drafts in the decode loop for drafter module `dmod` (its config's
    variant: DFlash 2 drafts with its selector)."""
    if dmod is None:
        return AUTOREGRESSIVE
    return of(dmod).loop(dmod.cfg)
