"""The drafters, each kind a `base.DrafterKind` defined beside it and listed in `registry`
(what the rest of the library asks instead of importing a drafter): `dflash` (the DFlash
block-diffusion drafter, z-lab format, with its sliding window variant), `dflash2` (DFlash 2's
convolutions, logit rule and candidate selector on top of it), `eagle3` (EAGLE-3),
`prompt_lookup` (n-gram drafting from the context, no weights); `tree` (draft trees) and
`draft_vocab` (a drafter's reduced output vocabulary).

Submodules import on first use (`dflash_jax.drafters.<name>`); importing the package loads nothing."""

from dflash_jax.support import lazy as _lazy  # (stdlib only)


def __getattr__(name):
    return _lazy.attribute(__name__, {}, globals(), name)
