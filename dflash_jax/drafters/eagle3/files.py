"""A loaded EAGLE-3 drafter (`Eagle3`) and its published files: load, save, the check
against a target."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafters.eagle3.config import (
    ARCHITECTURES,
    D2T,
    EMBED,
    T2D,
    Eagle3Config,
    check_d2t,
    t2d_mask,
)
from dflash_jax.drafters.eagle3.model import Eagle3Drafter, init_eagle3_params
from dflash_jax.models import checkpoint, hub
from dflash_jax.models.config import ModelConfig, as_dtype
from dflash_jax.models.safetensors_io import CheckpointError, SafetensorsDir, save_sharded


@dataclasses.dataclass(eq=False)
class Eagle3:
    """A loaded EAGLE-3 drafter: `config`, `params` (plain pytree), `d2t` (int32 [Vd]),
    `embedding` (the file's own embed_tokens [V, H], or None: the target's is shared), `path`."""

    config: Eagle3Config
    params: dict
    d2t: np.ndarray
    embedding: Optional[jnp.ndarray] = None
    path: Optional[str] = None

    @property
    def module(self) -> Eagle3Drafter:
        return Eagle3Drafter(self.config)

    @property
    def variables(self) -> dict:
        """What `module.apply` takes: the parameters and the `vocab` collection."""
        return {"params": self.params, "vocab": {"d2t": jnp.asarray(self.d2t, jnp.int32)}}

    @property
    def decode_params(self) -> dict:
        """What the decode programs take as the drafter's parameters (`Eagle3Kind`): `variables`, plus the drafter's own embedding under "embedding" when it has
        one (absent: the target's embedding is shared)."""
        out = dict(self.variables)
        if self.embedding is not None:
            out["embedding"] = jnp.asarray(self.embedding)
        return out

    @property
    def t2d(self) -> np.ndarray:
        return t2d_mask(self.d2t, self.config.body.vocab_size)


def validate_eagle3_pair(cfg: Eagle3Config, target_cfg: ModelConfig, own_embedding: bool) -> None:
    """Clear errors for an EAGLE-3 drafter that cannot serve this target."""
    if cfg.target_hidden_size != target_cfg.hidden_size:
        raise ValueError(
            f"EAGLE-3 drafter expects target hidden size {cfg.target_hidden_size}, target has "
            f"{target_cfg.hidden_size}"
        )
    if cfg.body.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"EAGLE-3 drafter vocabulary {cfg.body.vocab_size} differs from the target's "
            f"{target_cfg.vocab_size}"
        )
    if not own_embedding and cfg.body.hidden_size != target_cfg.hidden_size:
        raise ValueError(
            f"EAGLE-3 drafter width {cfg.body.hidden_size} differs from the target's "
            f"{target_cfg.hidden_size} and its file has no embed_tokens of its own"
        )
    cfg.tap_layers(target_cfg.num_layers)


def load_eagle3(
    path: str, target=None, dtype: Optional[str] = None, param_dtype: Optional[str] = None
) -> Eagle3:
    """Loads a published EAGLE-3 drafter directory (config.json + safetensors) or hub id.

    d2t absent: the draft vocabulary must be the whole vocabulary (identity map); t2d, when
    present, must be the mask d2t implies; embed_tokens.weight, when present, is kept as the
    drafter's own embedding. With `target`, checks that the pair fits and defaults the
    compute dtype to the target's."""
    path = hub.local_path(str(path), what="drafter")
    if dtype is None:
        dtype = "float32" if target is None else checkpoint.dtype_name(target.config.dtype)
    hf = checkpoint.read_config(path)
    as_dtype(dtype)
    source = os.path.join(path, "config.json")
    cfg = Eagle3Config.from_hf(hf, dtype=dtype, param_dtype=param_dtype, source=source)
    extras = (D2T, T2D, EMBED)
    abstract = jax.eval_shape(lambda: init_eagle3_params(cfg))
    params = checkpoint.load_params(
        path, abstract, prefix="", param_dtype=cfg.body.param_dtype, optional=extras.__contains__
    )
    store = SafetensorsDir(path)
    try:
        d2t, embedding = _read_vocab(store, cfg), None
        if EMBED in store:
            want = (cfg.body.vocab_size, cfg.body.hidden_size)
            code, shape = store.info(EMBED)
            if tuple(shape) != want:
                raise CheckpointError(
                    f"{store.file_of(EMBED)}: tensor {EMBED!r} has shape {tuple(shape)}, "
                    f"expected {want}"
                )
            embedding = jnp.asarray(np.asarray(store.get(EMBED), dtype=cfg.body.param_dtype))
    finally:
        store.close()
    if target is not None:
        validate_eagle3_pair(cfg, target.config, embedding is not None)
    return Eagle3(config=cfg, params=params, d2t=d2t, embedding=embedding, path=path)


def _read_vocab(store: SafetensorsDir, cfg: Eagle3Config) -> np.ndarray:
    """The checked d2t of a drafter directory (t2d, when there, checked against it)."""
    if D2T not in store:
        if cfg.draft_vocab_size != cfg.body.vocab_size:
            raise CheckpointError(
                f"{store.directory}: missing tensor 'd2t' (a draft vocabulary of "
                f"{cfg.draft_vocab_size} < {cfg.body.vocab_size} needs it)"
            )
        d2t = np.zeros((cfg.draft_vocab_size,), np.int32)
    else:
        d2t = check_d2t(store.get(D2T), cfg, source=f"{store.file_of(D2T)}: tensor 'd2t'")
    if T2D in store:
        where = store.file_of(T2D)
        t2d = store.get(T2D)
        if t2d.shape != (cfg.body.vocab_size,) or t2d.dtype.kind not in "biu":
            raise CheckpointError(
                f"{where}: tensor 't2d' has shape {t2d.shape} and dtype {t2d.dtype}, expected "
                f"bool ({cfg.body.vocab_size},)"
            )
        if not np.array_equal(t2d.astype(bool), t2d_mask(d2t, cfg.body.vocab_size)):
            raise CheckpointError(f"{where}: tensor 't2d' disagrees with 'd2t'")
    return d2t


def save_eagle3(drafter: Eagle3, path: str, dtype: Optional[str] = None) -> None:
    """Writes the drafter in the published layout: config.json and model.safetensors with the
    parameters, d2t (int64), t2d (bool) and, when it has one, its own embed_tokens."""
    path = str(path)
    cfg = drafter.config
    dtype = cfg.body.param_dtype if dtype is None else as_dtype(dtype)
    d2t = check_d2t(drafter.d2t, cfg)
    os.makedirs(path, exist_ok=True)
    tensors = checkpoint.params_to_hf(drafter.params, prefix="", dtype=dtype)
    tensors[D2T] = d2t.astype(np.int64)
    tensors[T2D] = t2d_mask(d2t, cfg.body.vocab_size)
    if drafter.embedding is not None:
        emb = {"embed_tokens": {"embedding": drafter.embedding}}
        tensors.update(checkpoint.params_to_hf(emb, prefix="", dtype=dtype))
    save_sharded(path, tensors)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(torch_dtype=checkpoint.dtype_name(dtype)), f, indent=2)


def is_eagle3_dir(path) -> bool:
    """Directory or hub id `path` holds an EAGLE-3 drafter (its config.json's architectures)."""
    try:
        archs = checkpoint.read_config(path).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False  # the DFlash path reports what is wrong with it
    return isinstance(archs, list) and any(a in ARCHITECTURES for a in archs)
