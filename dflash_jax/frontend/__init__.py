"""What the command-line tools are built from: infer.py's run from model directories to the
printed report (`infer_run`), the batch runner (`batch_runner`) and its JSON Lines file
(`records`), the report lines (`report`), text-level generation and the AR comparison
(`textgen`), and infer.py's flag checks (`infer_flags`).

Submodules import on first use (`dflash_jax.frontend.<name>`); importing the package loads nothing."""

from dflash_jax.support import lazy as _lazy  # (stdlib only)


def __getattr__(name):
    return _lazy.attribute(__name__, {}, globals(), name)
