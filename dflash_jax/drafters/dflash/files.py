"""A loaded DFlash drafter (`Drafter`) and its files: z-lab format, read and written."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafters import draft_vocab as dv
from dflash_jax.models import checkpoint, hub
from dflash_jax.models.config import ModelConfig, as_dtype
from dflash_jax.models.safetensors_io import CheckpointError
from dflash_jax.drafters.dflash.config import DrafterConfig, validate_pair
from dflash_jax.drafters.dflash.model import DFlashDrafter, init_drafter_params


@dataclasses.dataclass(eq=False)
class Drafter:
    """A loaded DFlash (or DFlash 2) drafter. `draft_vocab` (int32 [K], optional): the target
    ids its head is restricted to when drafting (`drafters.draft_vocab`)."""

    config: DrafterConfig
    params: dict
    path: Optional[str] = None
    draft_vocab: Optional[np.ndarray] = None

    @property
    def module(self) -> DFlashDrafter:
        return DFlashDrafter(self.config)

    @property
    def decode_params(self) -> dict:
        """What the decode programs take (`Decoder.dparams`): the parameters, and the draft
        vocabulary under `draft_vocab` when it has one."""
        if self.draft_vocab is None:
            return self.params
        return dict(self.params, draft_vocab=jnp.asarray(self.draft_vocab, jnp.int32))


def read_drafter_config(
    path: str,
    target_config: Optional[ModelConfig] = None,
    dtype: str = "float32",
    param_dtype: Optional[str] = None,
) -> DrafterConfig:
    """The drafter config of directory `path` (config.json only, no weights), checked, and
    with `target_config` checked against the target (`validate_pair`): what `load_drafter`
    reads, so that the CLIs can refuse a bad drafter before any model is loaded."""
    hf = checkpoint.read_config(path)
    as_dtype(dtype)
    cfg = DrafterConfig.from_hf(
        hf,
        target_hidden_size=target_config.hidden_size if target_config is not None else None,
        dtype=dtype,
        param_dtype=param_dtype,
        source=os.path.join(path, "config.json"),
    )
    if target_config is not None:
        validate_pair(cfg, target_config)
    return cfg


def load_drafter(
    path: str,
    target=None,
    dtype: Optional[str] = None,
    param_dtype: Optional[str] = None,
    draft_vocab: bool = True,
) -> Drafter:
    """Loads a z-lab DFlash drafter directory (config.json + safetensors), or hub id
    (`z-lab/Qwen3-8B-DFlash-b16`, fetched into the Hugging Face cache by `dflash_jax.models.hub`).

    With `target`, checks that the pair fits (taps, widths, vocabulary, mask token) and
    defaults the compute dtype to the target's. A drafter saved with a draft vocabulary (a
    `draft_vocab` tensor, `drafters.draft_vocab`) drafts over it unless `draft_vocab=False`
    (then over the full vocabulary, as loaders that do not know the tensor do).
    """
    path = hub.local_path(str(path), what="drafter")
    if dtype is None:
        dtype = "float32" if target is None else checkpoint.dtype_name(target.config.dtype)
    cfg = read_drafter_config(
        path, target.config if target is not None else None, dtype=dtype, param_dtype=param_dtype
    )
    abstract = jax.eval_shape(lambda: init_drafter_params(cfg))
    params = checkpoint.load_params(
        path,
        abstract,
        prefix="",
        param_dtype=cfg.body.param_dtype,
        optional=lambda name: name == dv.TENSOR,
    )
    vocab = _read_draft_vocab(path, cfg) if draft_vocab else None
    return Drafter(config=cfg, params=params, path=path, draft_vocab=vocab)


def _read_draft_vocab(path: str, cfg: DrafterConfig):
    """The checked `draft_vocab` tensor of a drafter directory, or None when it has none."""
    from dflash_jax.models.safetensors_io import SafetensorsDir

    size = checkpoint.read_config(path).get("draft_vocab_size")
    store = SafetensorsDir(path)
    try:
        if dv.TENSOR not in store.names():
            if size:
                raise CheckpointError(
                    f"{path}: config.json says draft_vocab_size {size} but no "
                    f"{dv.TENSOR!r} tensor is stored"
                )
            return None
        arr = store.get(dv.TENSOR)
    finally:
        store.close()
    return dv.check(arr, cfg.body.vocab_size, f"{path}: {dv.TENSOR}", size)


def save_drafter(drafter: Drafter, path: str, dtype: Optional[str] = None) -> None:
    """Writes the drafter in the z-lab DFlash format (no embedding, no LM head)."""
    path = str(path)
    dtype = drafter.config.body.param_dtype if dtype is None else as_dtype(dtype)
    os.makedirs(path, exist_ok=True)
    tensors = checkpoint.params_to_hf(drafter.params, prefix="", dtype=dtype)
    from dflash_jax.models.safetensors_io import save_sharded

    hf = drafter.config.to_hf(torch_dtype=checkpoint.dtype_name(dtype))
    if drafter.draft_vocab is not None:  # beside the z-lab tensors: `drafters.draft_vocab`
        vocab = dv.check(drafter.draft_vocab, drafter.config.body.vocab_size)
        tensors[dv.TENSOR] = vocab
        hf["draft_vocab_size"] = int(vocab.shape[0])
    save_sharded(path, tensors)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
