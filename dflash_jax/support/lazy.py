"""Lazy package attributes (PEP 562), for packages whose import must not load JAX: a command-line
tool imports them to arm its Ctrl-C handling (`dflash_jax.support.interrupts`) before JAX starts."""

from __future__ import annotations

import importlib


def attribute(package: str, exports: dict, namespace: dict, name: str):
    """What `package.name` is: `exports[name]`'s module's attribute of that name, or the
    submodule `package.name`; stored in `namespace` (the package's globals) once imported."""
    if name in exports:
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":  # the module exists; an import inside it failed
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    namespace[name] = value
    return value
