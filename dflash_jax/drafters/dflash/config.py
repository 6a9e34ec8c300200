"""The DFlash drafter's config: `DrafterConfig` (with its z-lab / Hugging Face conversion),
one matched to a target (`make_drafter_config`), and the pair's checks (`validate_pair`)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple


from dflash_jax.models.config import ModelConfig
from dflash_jax.models.safetensors_io import CheckpointError


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> Tuple[int, ...]:
    """Evenly spread tap layers: [L//2] for one tap, else round(1 + i*(L-4)/(n-1))."""
    if num_taps == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    ids = tuple(int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps))
    if min(ids) < 0 or max(ids) >= num_target_layers:
        raise ValueError(
            f"the default spread of {num_taps} taps gives layers {list(ids)}, outside a "
            f"{num_target_layers}-layer target; pass target_layer_ids"
        )
    return ids


LAYER_TYPES = ("full_attention", "sliding_attention")
# DFlash 2's dflash_config keys (read there first, then at the top level, as the reference does).
DFLASH2_FIELDS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
    "input_embedding_scale",
)
# The scalars the reference applies to every drafter, DFlash 1 included (docs/dflash_config.md),
# with the value that leaves the drafter as it is.
SCALAR_DEFAULTS = {
    "input_embedding_scale": 1.0,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
}
# block_size when neither dflash_config nor the top level names one (the reference's default).
DEFAULT_BLOCK_SIZE = 16
# The reference initializer's standard deviation (written to config.json as initializer_range).
INITIALIZER_RANGE = 0.02


def _as_checkpoint_error(fn, *args, **kw):
    """fn(*args, **kw), its ValueError a CheckpointError (the config.json is at fault)."""
    try:
        return fn(*args, **kw)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _taps(hf: dict, dcfg: dict, num_layers: int, source: str):
    """(target_layer_ids, num_target_layers) of a drafter config.json, checked: the ids from
    dflash_config or the top level, else the reference's default (as many taps as drafter
    layers) of num_target_layers."""
    from dflash_jax.support.checks import int_param

    check = _as_checkpoint_error
    num_target_layers = hf.get("num_target_layers")
    if num_target_layers is not None:
        num_target_layers = check(
            int_param, f"{source}: num_target_layers", num_target_layers, lo=1
        )
    ids = _field(hf, dcfg, "target_layer_ids")
    if ids is None:
        if num_target_layers is None:
            raise CheckpointError(
                f"{source}: needs 'target_layer_ids' (dflash_config or the top level) or "
                "'num_target_layers'"
            )
        ids = check(default_target_layer_ids, num_target_layers, num_layers)
    name = "dflash_config.target_layer_ids" if "target_layer_ids" in dcfg else "target_layer_ids"
    if not isinstance(ids, (list, tuple)) or not ids:
        raise CheckpointError(
            f"{source}: {name} must be a non-empty list of layer numbers, got {ids!r}"[:200]
        )
    ids = tuple(check(int_param, f"{source}: {name}[{j}]", i, lo=0) for j, i in enumerate(ids))
    if num_target_layers is None:
        num_target_layers = max(ids) + 1
    return ids, num_target_layers


def _layer_types(hf: dict, num_layers: int, source: str):
    """(layer_types or None, sliding_window or None) of a drafter config.json: the sliding-window
    layers of the DFlash 2 and Qwen3.6 drafters, from `layer_types` or, as Qwen3's config has
    it, use_sliding_window with layers >= max_window_layers sliding; a window no layer uses is
    dropped (stored for the readers' sake)."""
    from dflash_jax.support.checks import int_param

    layer_types = hf.get("layer_types")
    window = hf.get("sliding_window")
    if layer_types is None and hf.get("use_sliding_window") is True:
        first = hf.get("max_window_layers", num_layers)
        first = _as_checkpoint_error(int_param, f"{source}: max_window_layers", first, lo=0)
        layer_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    if layer_types is None:  # as transformers reads a Qwen3 config: no layer slides
        return None, None
    if not isinstance(layer_types, list):
        raise CheckpointError(
            f"{source}: layer_types must be a list, got {type(layer_types).__name__}"
        )
    layer_types = tuple(layer_types)
    return layer_types, window if "sliding_attention" in layer_types else None


def _field(hf: dict, dcfg: dict, key: str, default=None):
    """A drafter field as the reference package reads it: dflash_config first, then the top
    level of config.json, then `default`."""
    if key in dcfg:
        return dcfg[key]
    return hf.get(key, default)


def _dflash2_fields(hf: dict, dcfg: dict, source: str) -> dict:
    """The DFlash 2 structure fields of a config.json (one-line CheckpointError for a missing
    required key)."""
    out = {}
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        value = _field(hf, dcfg, key)
        if value is None:
            raise CheckpointError(f"{source}: a DFlash 2 drafter needs {key!r}")
        out[key] = value
    return out


def _scalar_fields(hf: dict, dcfg: dict) -> dict:
    """input_embedding_scale, output_multiplier and final_logit_softcapping (dflash_config,
    then the top level), for any DFlash drafter; absent ones keep their defaults."""
    return {k: _field(hf, dcfg, k) for k in SCALAR_DEFAULTS if k in dcfg or k in hf}


def _is_causal(hf: dict, dcfg: dict, source: str):
    """The top-level is_causal (the only place the reference reads it; None when absent). An
    is_causal inside dflash_config that says otherwise is refused: the reference would ignore
    it, so two readers would draft differently from one file."""
    causal = hf.get("is_causal")
    if causal is not None and not isinstance(causal, bool):
        raise CheckpointError(f"{source}: is_causal must be true or false, got {causal!r}"[:200])
    if "is_causal" in dcfg and dcfg["is_causal"] != causal:
        raise CheckpointError(
            f"{source}: dflash_config.is_causal {dcfg['is_causal']!r} is not read (is_causal "
            f"is read at the top level, where it is {causal!r}): put it at the top level"[:300]
        )
    return causal


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """body: the drafter's transformer hyper-parameters (vocab = the target's vocabulary).

    block_size: tokens per drafted block (x_last + block_size - 1 drafts).
    mask_token_id: id whose target embedding fills masked block positions.
    target_layer_ids: 0-based target layers whose outputs are tapped.
    target_hidden_size: width of one tap (the target's hidden size).
    num_target_layers: layer count of the target the drafter was trained for.
    """

    body: ModelConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: Tuple[int, ...]
    target_hidden_size: int
    num_target_layers: int
    # Per layer "full_attention" or "sliding_attention" (None: all full); a sliding layer's
    # queries at position p see keys at positions j with |p - j| < sliding_window.
    layer_types: Optional[Tuple[str, ...]] = None
    sliding_window: Optional[int] = None
    # DFlash 2 (`DFlash2DraftModel`, `drafters.dflash2`): conv_kernel_size > 0 taps of the
    # grouped dynamic causal convolutions (channels in groups of conv_group_size) and the
    # candidate selector (selector_rank, selector_top_k). 0: DFlash 1.
    conv_kernel_size: int = 0
    conv_group_size: int = 16
    selector_rank: int = 0
    selector_top_k: int = 0
    # Any drafter, as the reference applies them (docs/dflash_config.md): logits x
    # output_multiplier then soft-capped at final_logit_softcapping (None or <= 0: not), block
    # embeddings x input_embedding_scale, and is_causal: the block attends causally within
    # itself in every layer (True) or in none (False); None: in the sliding layers only.
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    input_embedding_scale: float = 1.0
    is_causal: Optional[bool] = None

    def __post_init__(self):
        types = self.layer_types
        if types is not None:
            types = tuple(types)
            object.__setattr__(self, "layer_types", types)
        self._check_layers(self.body, types, self.sliding_window)
        if types is None or "sliding_attention" not in types:  # all full: one spelling
            object.__setattr__(self, "layer_types", None)
            object.__setattr__(self, "sliding_window", None)
            if self.is_causal is False:  # no layer slides: False and None read alike
                object.__setattr__(self, "is_causal", None)
        self._check_scalars()
        if self.dflash2:
            self._check_dflash2()

    @property
    def dflash2(self) -> bool:
        return self.conv_kernel_size > 0

    def _check_dflash2(self):
        h, v = self.body.hidden_size, self.body.vocab_size
        for name, lo in (("conv_kernel_size", 1), ("conv_group_size", 1), ("selector_rank", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}"[:160])
        if h % self.conv_group_size:
            raise ValueError(
                f"conv_group_size {self.conv_group_size} does not divide the hidden size {h}"
            )
        k = self.selector_top_k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= v:
            raise ValueError(f"selector_top_k must be an integer in [1, {v}], got {k!r}"[:160])

    def _check_scalars(self):
        for name in ("output_multiplier", "input_embedding_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}"[:160])
        cap = self.final_logit_softcapping
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))):
            raise ValueError(f"final_logit_softcapping must be a number, got {cap!r}"[:160])
        causal = self.is_causal
        if causal is not None and not isinstance(causal, bool):
            raise ValueError(f"is_causal must be true, false or None, got {causal!r}"[:160])

    @property
    def scales_logits(self) -> bool:
        """Whether output_multiplier or final_logit_softcapping change the LM head's logits."""
        cap = self.final_logit_softcapping
        return self.output_multiplier != 1.0 or (cap is not None and cap > 0)

    @property
    def layer_causal(self) -> Tuple[bool, ...]:
        """Per layer: whether the block attends causally within itself, as the reference
        reads is_causal for DFlash and DFlash 2 alike: True or False, every layer; None, the
        sliding layers (docs/dflash_config.md)."""
        if self.is_causal is not None:
            return (bool(self.is_causal),) * self.body.num_layers
        return tuple(w is not None for w in self.layer_windows)

    @staticmethod
    def _check_layers(body, layer_types, sliding_window):
        """One-line ValueError for layer types or a window that cannot be run."""
        if layer_types is not None:
            if len(layer_types) != body.num_layers:
                raise ValueError(
                    f"layer_types has {len(layer_types)} entries for "
                    f"num_hidden_layers={body.num_layers}"
                )
            for j, kind in enumerate(layer_types):
                if kind not in LAYER_TYPES:
                    raise ValueError(
                        f"layer_types[{j}] is {repr(kind)[:60]}; expected one of "
                        f"{list(LAYER_TYPES)}"
                    )
        if (
            layer_types is not None
            and "sliding_attention" in layer_types
            and (
                isinstance(sliding_window, bool)
                or not isinstance(sliding_window, int)
                or sliding_window < 1
            )
        ):
            raise ValueError(
                "sliding_window must be a positive integer for sliding_attention layers, got "
                f"{sliding_window!r}"[:160]
            )

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def layer_windows(self) -> Tuple[Optional[int], ...]:
        """Per layer: its attention window (None: full attention)."""
        types = self.layer_types or ("full_attention",) * self.body.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in types)

    @property
    def context_window(self) -> Optional[int]:
        """The context every layer needs when all of them slide (the largest window; the
        context cache is then a ring of that many slots), else None (the whole context)."""
        w = self.layer_windows
        return None if any(x is None for x in w) else max(w)

    def context_capacity(self, capacity: int) -> int:
        """Slots of the drafter's context cache for a decode of `capacity` positions: bounded
        by `context_window` (a ring: position j in slot j % slots)."""
        w = self.context_window
        return capacity if w is None else min(capacity, w)

    def replace(self, **kw) -> "DrafterConfig":
        return dataclasses.replace(self, **kw)

    # ---------------------------------------------------------------- z-lab config.json

    @classmethod
    def from_hf(
        cls,
        hf: dict,
        *,
        target_hidden_size: Optional[int] = None,
        dtype="float32",
        param_dtype=None,
        source="config.json",
    ) -> "DrafterConfig":
        archs = hf.get("architectures") or []
        if "DFlashDraftModel" not in archs and "DFlash2DraftModel" not in archs:
            raise CheckpointError(
                f"{source}: not a DFlash drafter (architectures={archs!r}, expected "
                "['DFlashDraftModel'] or ['DFlash2DraftModel'])"
            )
        try:
            body = ModelConfig.from_hf_fields(
                hf, arch="qwen3", dtype=dtype, param_dtype=param_dtype, source=source
            )
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        from dflash_jax.support.checks import int_param

        check = _as_checkpoint_error
        dcfg = hf.get("dflash_config") or {}
        if not isinstance(dcfg, dict):
            raise CheckpointError(
                f"{source}: dflash_config must be an object, got {type(dcfg).__name__}"
            )
        # Fields as the reference reads them: dflash_config first, then the top level, then
        # its default (docs/dflash_config.md).
        where = lambda key: f"dflash_config.{key}" if key in dcfg else key
        block_size = _field(hf, dcfg, "block_size", DEFAULT_BLOCK_SIZE)
        block_size = check(int_param, f"{source}: {where('block_size')}", block_size, lo=2)
        mask = _field(hf, dcfg, "mask_token_id")
        if mask is None:
            raise CheckpointError(
                f"{source}: missing 'mask_token_id' (dflash_config or the top level)"
            )
        mask = check(int_param, f"{source}: {where('mask_token_id')}", mask)
        if mask < 0:
            raise CheckpointError(f"{source}: {where('mask_token_id')} must be >= 0, got {mask}")
        ids, num_target_layers = _taps(hf, dcfg, body.num_layers, source)
        layer_types, window = _layer_types(hf, body.num_layers, source)
        typed = dict(layer_types=layer_types, sliding_window=window)
        try:
            cls._check_layers(body, **typed)
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None
        if "DFlash2DraftModel" in archs:
            typed.update(_dflash2_fields(hf, dcfg, source))
        typed.update(_scalar_fields(hf, dcfg), is_causal=_is_causal(hf, dcfg, source))
        try:
            return cls(
                body=body,
                block_size=block_size,
                mask_token_id=mask,
                target_layer_ids=ids,
                target_hidden_size=int(target_hidden_size or body.hidden_size),
                num_target_layers=num_target_layers,
                **typed,
            )
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None

    def to_hf(self, torch_dtype="bfloat16") -> dict:
        out = self.body.replace(arch="qwen3", qk_norm=True).to_hf(torch_dtype)
        arch = "DFlash2DraftModel" if self.dflash2 else "DFlashDraftModel"
        out.update(
            {
                "architectures": [arch],
                "auto_map": {"AutoModel": f"dflash.{arch}"},
                # The published files' spelling (transformers >= 4.56); torch_dtype stays
                # for older readers.
                "dtype": torch_dtype,
                "initializer_range": INITIALIZER_RANGE,
                "block_size": self.block_size,
                "num_target_layers": self.num_target_layers,
                "layer_types": [
                    "sliding_attention" if w else "full_attention" for w in self.layer_windows
                ],
                "dflash_config": {
                    "mask_token_id": self.mask_token_id,
                    "target_layer_ids": list(self.target_layer_ids),
                    "block_size": self.block_size,
                },
            }
        )
        if self.layer_types is not None:
            out.update(use_sliding_window=True, sliding_window=self.sliding_window)
        if self.dflash2:
            out["dflash_config"].update({k: getattr(self, k) for k in DFLASH2_FIELDS})
        else:  # the scalars that change this drafter (a reader of the default needs none)
            out["dflash_config"].update(
                {k: getattr(self, k) for k, d in SCALAR_DEFAULTS.items() if getattr(self, k) != d}
            )
        if self.is_causal is not None:  # at the top level, where the reference reads it
            out["is_causal"] = self.is_causal
        return out


def make_drafter_config(
    target_config: ModelConfig,
    *,
    num_layers: int = 5,
    num_taps: int = 5,
    block_size: int = 16,
    mask_token_id: Optional[int] = None,
    target_layer_ids: Optional[Sequence[int]] = None,
    sliding_window: Optional[int] = None,
    **body_overrides,
) -> DrafterConfig:
    """A drafter config matched to a target: same width, heads and vocabulary by default.
    sliding_window: every layer slides with this window (None: full attention), bidirectional
    inside the block (`sliding_layers`: is_causal False)."""
    body = target_config.dense().replace(  # a MoE target's drafter is dense
        num_layers=num_layers,
        arch="qwen3",
        qk_norm=True,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_scaling=None,
        quantization=None,  # the drafter's own layers stay in the parameter dtype
        quantize_lm_head=False,
        **body_overrides,
    )
    ids = (
        tuple(target_layer_ids)
        if target_layer_ids is not None
        else default_target_layer_ids(target_config.num_layers, num_taps)
    )
    return DrafterConfig(
        body=body,
        block_size=block_size,
        mask_token_id=(target_config.vocab_size - 1 if mask_token_id is None else mask_token_id),
        target_layer_ids=ids,
        target_hidden_size=target_config.hidden_size,
        num_target_layers=target_config.num_layers,
        **sliding_layers(num_layers, sliding_window),
    )


def sliding_layers(num_layers: int, window: Optional[int], is_causal: Optional[bool] = False):
    """DrafterConfig fields for `num_layers` layers that all slide with `window` (None: the
    fields of full attention, is_causal left as it is). The window is bidirectional inside the
    block unless `is_causal` says otherwise (None: the reference's default for sliding layers,
    causal): this project's DFlash drafters draft bidirectionally, and the saved config says so
    (`is_causal: false`), so the reference reads them as they were trained."""
    if window is None:
        return dict(layer_types=None, sliding_window=None)
    return dict(
        layer_types=("sliding_attention",) * num_layers, sliding_window=window, is_causal=is_causal
    )


def validate_pair(drafter_cfg: DrafterConfig, target_cfg: ModelConfig) -> None:
    """Clear errors for a drafter that cannot serve this target."""
    ids = drafter_cfg.target_layer_ids
    if not ids or min(ids) < 0 or max(ids) >= target_cfg.num_layers:
        raise ValueError(
            f"drafter taps target layers {list(ids)}, but the target has "
            f"{target_cfg.num_layers} layers (valid ids 0..{target_cfg.num_layers - 1})"
        )
    if drafter_cfg.target_hidden_size != target_cfg.hidden_size:
        raise ValueError(
            f"drafter expects target hidden size {drafter_cfg.target_hidden_size}, "
            f"target has {target_cfg.hidden_size}"
        )
    if drafter_cfg.body.hidden_size != target_cfg.hidden_size:
        raise ValueError(
            f"drafter width {drafter_cfg.body.hidden_size} differs from the target's "
            f"{target_cfg.hidden_size}: it cannot share the target's embedding and LM head"
        )
    if drafter_cfg.body.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"drafter vocabulary {drafter_cfg.body.vocab_size} differs from the "
            f"target's {target_cfg.vocab_size}"
        )
    if not 0 <= drafter_cfg.mask_token_id < target_cfg.vocab_size:
        raise ValueError(
            f"mask_token_id {drafter_cfg.mask_token_id} is outside the target's "
            f"embedding table (0..{target_cfg.vocab_size - 1})"
        )
