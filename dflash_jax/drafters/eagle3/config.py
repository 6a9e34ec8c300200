"""EAGLE-3's config: the published config.json read and written (`Eagle3Config`), its
tapped layers, and the draft vocabulary's offsets (d2t) checked and applied."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax.numpy as jnp
import numpy as np

from dflash_jax.models.config import ModelConfig
from dflash_jax.models.safetensors_io import CheckpointError

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # published, vLLM's
NUM_TAPS = 3
# The verify block when none is asked for: x_last and 7 drafts.
DEFAULT_BLOCK_SIZE = 8
# Hugging Face's Llama `initializer_range` default: the std of new weight matrices.
INITIALIZER_RANGE = 0.02
# Tensors of the published files that are not Flax parameters of `Eagle3Drafter`.
D2T, T2D, EMBED = "d2t", "t2d", "embed_tokens.weight"


def default_eagle3_taps(num_target_layers: int) -> Tuple[int, int, int]:
    """The tapped target layers when the config names none: (1, L//2 - 1, L - 4), outputs of
    those layers (SGLang's and vLLM's default capture points 2, L//2, L - 3, which count the
    input of a layer)."""
    n = num_target_layers
    ids = (1, n // 2 - 1, n - 4)
    if min(ids) < 0 or max(ids) >= n or len(set(ids)) != NUM_TAPS:
        raise ValueError(
            f"the default EAGLE-3 taps {list(ids)} do not fit a {n}-layer target; name three "
            "layers in eagle_config.eagle_aux_hidden_state_layer_ids"
        )
    return ids


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """body: the one layer's hyper-parameters (Llama: no q/k norm; vocab_size = the target's
    vocabulary, the rows of the shared embedding; num_layers = 1).

    draft_vocab_size: rows of the drafter's LM head (<= vocab_size).
    target_hidden_size: width of one tap (the target's hidden size).
    target_layer_ids: the three tapped target layers (outputs of those layers, as `Transformer`
      taps count them); None: `default_eagle3_taps` of the target.
    norm_before_residual: the residual around attention is hidden_norm(feature), not the feature.
    """

    body: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    target_layer_ids: Optional[Tuple[int, ...]] = None
    norm_before_residual: bool = False

    def __post_init__(self):
        b = self.body
        if b.num_layers != 1:
            raise ValueError(
                f"an EAGLE-3 drafter has one layer (midlayer), got num_hidden_layers={b.num_layers}"
            )
        if b.qk_norm:
            raise ValueError("an EAGLE-3 drafter's layer has no q/k norm (a Llama layer)")
        for name in ("draft_vocab_size", "target_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}"[:160])
        if self.draft_vocab_size > b.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} exceeds the target vocabulary "
                f"vocab_size={b.vocab_size}"
            )
        if self.target_layer_ids is not None:
            ids = tuple(self.target_layer_ids)
            object.__setattr__(self, "target_layer_ids", ids)
            if (
                len(ids) != NUM_TAPS
                or len(set(ids)) != NUM_TAPS
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)
            ):
                raise ValueError(
                    f"target_layer_ids must be three distinct layer numbers >= 0, got {ids!r}"[:160]
                )

    @property
    def num_taps(self) -> int:
        return NUM_TAPS

    def tap_layers(self, num_target_layers: int) -> Tuple[int, ...]:
        """The tapped target layers for a target of `num_target_layers` (checked in range)."""
        ids = self.target_layer_ids or default_eagle3_taps(num_target_layers)
        if max(ids) >= num_target_layers:
            raise ValueError(
                f"EAGLE-3 drafter taps target layers {list(ids)}, but the target has "
                f"{num_target_layers} layers"
            )
        return ids

    def replace(self, **kw) -> "Eagle3Config":
        return dataclasses.replace(self, **kw)

    # ---------------------------------------------------------------- config.json

    @classmethod
    def from_hf(
        cls, hf: dict, *, dtype="float32", param_dtype=None, source="config.json"
    ) -> "Eagle3Config":
        """The config of a published `LlamaForCausalLMEagle3` config.json; every field read is
        checked: one `CheckpointError` (a ValueError) line naming `source`."""
        if not isinstance(hf, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(hf).__name__}")
        archs = hf.get("architectures") or []
        if not isinstance(archs, list) or not any(a in ARCHITECTURES for a in archs):
            raise CheckpointError(
                f"{source}: not an EAGLE-3 drafter (architectures={archs!r}, expected "
                "['LlamaForCausalLMEagle3'])"[:200]
            )
        try:
            body = ModelConfig.from_hf_fields(
                hf, arch="llama", dtype=dtype, param_dtype=param_dtype, source=source
            )
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        from dflash_jax.support.checks import int_param

        def whole(key, value, lo=1):
            try:
                return int_param(f"{source}: {key}", value, lo=lo)
            except ValueError as e:
                raise CheckpointError(str(e)) from None

        draft_vocab = hf.get("draft_vocab_size")
        draft_vocab = (
            body.vocab_size if draft_vocab is None else whole("draft_vocab_size", draft_vocab)
        )
        target_hidden = hf.get("target_hidden_size")
        target_hidden = (
            body.hidden_size
            if target_hidden is None
            else whole("target_hidden_size", target_hidden)
        )
        flags = {}
        for key in ("norm_before_residual", "norm_before_fc"):
            value = hf.get(key, False)
            if value is None:
                value = False
            if not isinstance(value, bool):
                raise CheckpointError(f"{source}: {key} must be true or false, got {value!r}"[:200])
            flags[key] = value
        if flags["norm_before_fc"]:
            raise CheckpointError(
                f"{source}: norm_before_fc=true (a norm over the taps before fc) is not supported"
            )
        eagle = hf.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise CheckpointError(
                f"{source}: eagle_config must be an object, got {type(eagle).__name__}"
            )
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise CheckpointError(
                f"{source}: eagle_config.use_aux_hidden_state must be true (an EAGLE-3 drafter "
                "fuses three target layers)"
            )
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None:
            if not isinstance(ids, list):
                raise CheckpointError(
                    f"{source}: eagle_config.eagle_aux_hidden_state_layer_ids must be a list, "
                    f"got {ids!r}"[:200]
                )
            ids = tuple(
                whole(f"eagle_config.eagle_aux_hidden_state_layer_ids[{j}]", i, lo=0)
                for j, i in enumerate(ids)
            )
        try:
            return cls(
                body=body,
                draft_vocab_size=draft_vocab,
                target_hidden_size=target_hidden,
                target_layer_ids=ids,
                norm_before_residual=flags["norm_before_residual"],
            )
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None

    def to_hf(self, torch_dtype="bfloat16") -> dict:
        """The published config.json dict (read back by `from_hf`, vLLM and SGLang)."""
        out = self.body.replace(arch="llama", qk_norm=False).to_hf(torch_dtype)
        out.update(
            {
                "architectures": [ARCHITECTURES[0]],
                "model_type": "llama",
                "draft_vocab_size": self.draft_vocab_size,
                "target_hidden_size": self.target_hidden_size,
                "initializer_range": INITIALIZER_RANGE,
            }
        )
        if self.norm_before_residual:
            out["norm_before_residual"] = True
        if self.target_layer_ids is not None:
            out["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": list(self.target_layer_ids),
                "use_aux_hidden_state": True,
            }
        return out


def make_eagle3_config(
    target_config: ModelConfig,
    *,
    draft_vocab_size: Optional[int] = None,
    target_layer_ids=None,
    **body_overrides,
) -> Eagle3Config:
    """An EAGLE-3 config matched to a target: its width, heads, RoPE and vocabulary by default
    (draft_vocab_size None: the whole vocabulary)."""
    body = target_config.dense().replace(
        num_layers=1,
        arch="llama",
        qk_norm=False,
        tie_word_embeddings=False,
        attention_bias=False,
        quantization=None,
        quantize_lm_head=False,
        **body_overrides,
    )
    return Eagle3Config(
        body=body,
        draft_vocab_size=body.vocab_size if draft_vocab_size is None else draft_vocab_size,
        target_hidden_size=target_config.hidden_size,
        target_layer_ids=None if target_layer_ids is None else tuple(target_layer_ids),
    )


# ---------------------------------------------------------------------------- vocabulary


def draft_to_target_ids(draft_ids, d2t):
    """Target token ids of draft ids (any shape): i -> i + d2t[i]."""
    draft_ids = jnp.asarray(draft_ids)
    return draft_ids + jnp.take(jnp.asarray(d2t), draft_ids, axis=0).astype(draft_ids.dtype)


def t2d_mask(d2t, vocab_size: int) -> np.ndarray:
    """bool [vocab_size]: which target ids the draft vocabulary covers (the files' `t2d`)."""
    d2t = np.asarray(d2t, np.int64)
    mask = np.zeros((vocab_size,), bool)
    mask[np.arange(d2t.shape[0]) + d2t] = True
    return mask


def full_vocab_logits(draft_logits, d2t, vocab_size: int):
    """Draft-vocabulary logits [..., Vd] placed at their target ids in [..., vocab_size], -inf
    at every target id the draft vocabulary lacks (as vLLM's `compute_logits`)."""
    draft_logits = jnp.asarray(draft_logits)
    targets = draft_to_target_ids(jnp.arange(draft_logits.shape[-1]), d2t)
    out = jnp.full(draft_logits.shape[:-1] + (vocab_size,), -jnp.inf, draft_logits.dtype)
    return out.at[..., targets].set(draft_logits)


def check_d2t(d2t, cfg: Eagle3Config, source: str = "d2t") -> np.ndarray:
    """`d2t` as int32 [draft_vocab_size], checked: its target ids i + d2t[i] lie in the
    vocabulary and are distinct. One `CheckpointError` line otherwise."""
    arr = np.asarray(d2t)
    if arr.dtype.kind not in "iu":
        raise CheckpointError(f"{source}: d2t must hold integers, got dtype {arr.dtype}")
    if arr.shape != (cfg.draft_vocab_size,):
        raise CheckpointError(
            f"{source}: d2t has shape {arr.shape}, expected ({cfg.draft_vocab_size},)"
        )
    targets = np.arange(arr.shape[0], dtype=np.int64) + arr.astype(np.int64)
    v = cfg.body.vocab_size
    if targets.size and (targets.min() < 0 or targets.max() >= v):
        raise CheckpointError(
            f"{source}: d2t maps draft ids to target ids outside [0, {v}) "
            f"(range [{targets.min()}, {targets.max()}])"
        )
    if np.unique(targets).size != targets.size:
        raise CheckpointError(f"{source}: d2t maps two draft ids to the same target id")
    return arr.astype(np.int32)
