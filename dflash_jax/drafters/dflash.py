"""The DFlash drafter: a few Qwen3-style layers conditioned on target taps by KV injection.

Forward (see ../shared/docs/dflash.md):
  context features  c = hidden_norm(fc(concat(taps)))             [B, C, H]
  block input       x = target_embed([x_last, MASK, ..., MASK])   [B, T, H]
  every layer:      q from the block; k, v from [c ; block] through the layer's own
                    k_proj / v_proj, k_norm on all keys, RoPE at absolute positions;
                    attention is non-causal over [context ; block].
  output            norm(x), then the target's LM head; position k >= 1 drafts token start+k.

The drafter owns no embedding and no LM head: it borrows the target's (never copied).
At decode time the per-layer K/V of the context features live in `ContextCache` (slot = absolute
position, valid below `lengths`), exactly like the target cache; the block's own K/V are never
kept.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafters import base
from dflash_jax.drafters import draft_vocab as dv
from dflash_jax.drafters.tree import build_tree
from dflash_jax.drafters.dflash2 import (
    CandidateSelector,
    GroupedDynamicCausalConv,
    adjust_logits,
    blocked_top_k,
)
from dflash_jax.models import attention as attn_lib
from dflash_jax.models import checkpoint, hub
from dflash_jax.models.config import ModelConfig, as_dtype
from dflash_jax.models.layers import MLP, QKVProjection, RMSNorm, rope_inv_freq
from dflash_jax.models.safetensors_io import CheckpointError
from dflash_jax.models.transformer import KVCache


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
            body = ModelConfig._from_hf_fields(
                hf, arch="qwen3", dtype=dtype, param_dtype=param_dtype, source=source
            )
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        from dflash_jax.support.checks import int_param

        def check(fn, *args, **kw):
            try:
                return fn(*args, **kw)
            except ValueError as e:
                raise CheckpointError(str(e)) from None

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
            # The reference's default: as many taps as drafter layers.
            ids = check(default_target_layer_ids, num_target_layers, body.num_layers)
        name = where("target_layer_ids")
        if not isinstance(ids, (list, tuple)) or not ids:
            raise CheckpointError(
                f"{source}: {name} must be a non-empty list of layer numbers, got {ids!r}"[:200]
            )
        ids = tuple(check(int_param, f"{source}: {name}[{j}]", i, lo=0) for j, i in enumerate(ids))
        if num_target_layers is None:
            num_target_layers = max(ids) + 1
        # Sliding-window layers (the DFlash 2 and Qwen3.6 drafters): `layer_types`, or, as
        # Qwen3's config has it, use_sliding_window with layers >= max_window_layers sliding.
        layer_types = hf.get("layer_types")
        window = hf.get("sliding_window")
        if layer_types is None and hf.get("use_sliding_window") is True:
            first = hf.get("max_window_layers", body.num_layers)
            first = check(int_param, f"{source}: max_window_layers", first, lo=0)
            layer_types = [
                "sliding_attention" if i >= first else "full_attention"
                for i in range(body.num_layers)
            ]
        if layer_types is not None:
            if not isinstance(layer_types, list):
                raise CheckpointError(
                    f"{source}: layer_types must be a list, got {type(layer_types).__name__}"
                )
            layer_types = tuple(layer_types)
            if "sliding_attention" not in layer_types:
                window = None  # stored for the readers' sake, unused
        else:  # as transformers reads a Qwen3 config: no layer slides
            window = None
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


# The drafter's per-layer context K/V: the target's cache type (`model.KVCache`, k / v L-tuples
# of [B, S, K*D], slot = absolute position, valid below `lengths`), created from a DrafterConfig.
ContextCache = KVCache


# attend(q [B,T,N,D], k_blk [B,T,K,D], v_blk [B,T,K,D], ctx_k [B,C,K*D], ctx_v, window)
# -> [B,T,N,D]; window: the layer's sliding window (None: full attention).
AttendFn = Callable[..., jnp.ndarray]


class DrafterLayer(nn.Module):
    cfg: ModelConfig
    window: Optional[int] = None  # sliding_attention: |query - key position| < window
    causal: bool = False  # the block attends causally within itself (DFlash 2's is_causal)
    conv: Optional[Tuple[int, int]] = None  # DFlash 2: (conv_kernel_size, conv_group_size)

    def setup(self):
        c = self.cfg
        self.self_attn = QKVProjection(c)
        self.input_layernorm = RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype)
        self.mlp = MLP(c)
        if self.conv is not None:
            conv = lambda: GroupedDynamicCausalConv(
                c.hidden_size, self.conv[0], self.conv[1], c.dtype, c.param_dtype
            )
            self.attention_conv, self.mlp_conv = conv(), conv()

    def context_kv(self, ctx_BCH, positions_BC, inv_freq):
        """K/V of context features (no input norm: hidden_norm already normalized them)."""
        return self.self_attn.keys_values(ctx_BCH, positions_BC, inv_freq)

    def __call__(self, x_BTH, positions_BT, inv_freq, ctx_k, ctx_v, attend: AttendFn, block_len):
        h = self.input_layernorm(x_BTH)
        if self.conv is not None:
            h, post = self.attention_conv.prepare(h, block_len)
        q = self.self_attn.queries(h, positions_BT, inv_freq)
        k, v = self.self_attn.keys_values(h, positions_BT, inv_freq)
        kw = dict(causal=True) if self.causal else {}
        a = self.self_attn.output(attend(q, k, v, ctx_k, ctx_v, self.window, **kw))
        if self.conv is not None:
            a = self.attention_conv.finish(a, post, block_len)
        x_BTH = x_BTH + a
        h = self.post_attention_layernorm(x_BTH)
        if self.conv is None:
            return x_BTH + self.mlp(h)
        h, post = self.mlp_conv.prepare(h, block_len)
        return x_BTH + self.mlp_conv.finish(self.mlp(h), post, block_len)


class DFlashDrafter(nn.Module):
    """Parameters: fc, hidden_norm, layers_{i}/..., norm (the z-lab names, Flax layout)."""

    cfg: DrafterConfig

    def setup(self):
        b = self.cfg.body
        self.fc = nn.Dense(b.hidden_size, use_bias=False, dtype=b.dtype, param_dtype=b.param_dtype)
        self.hidden_norm = RMSNorm(b.rms_norm_eps, b.dtype, b.param_dtype)
        c = self.cfg
        conv = (c.conv_kernel_size, c.conv_group_size) if c.dflash2 else None
        self.layers = [
            DrafterLayer(b, w, causal, conv, name=f"layers_{i}")
            for i, (w, causal) in enumerate(zip(c.layer_windows, c.layer_causal))
        ]
        self.norm = RMSNorm(b.rms_norm_eps, b.dtype, b.param_dtype)
        if c.dflash2:
            self.candidate_selector = CandidateSelector(
                b.hidden_size,
                b.vocab_size,
                c.selector_rank,
                c.selector_top_k,
                b.dtype,
                b.param_dtype,
            )

    def context_features(self, taps_BCF):
        """hidden_norm(fc(taps)): [B, C, n*H_target] -> [B, C, H]."""
        return self.hidden_norm(self.fc(taps_BCF.astype(self.cfg.body.dtype)))

    def context_kv(self, taps_BCF, positions_BC):
        """Per-layer context K/V: two L-tuples of [B, C, K, D]."""
        feats = self.context_features(taps_BCF)
        inv_freq = rope_inv_freq(self.cfg.body)
        kvs = [layer.context_kv(feats, positions_BC, inv_freq) for layer in self.layers]
        return tuple(k for k, _ in kvs), tuple(v for _, v in kvs)

    def __call__(self, block_emb_BTH, positions_BT, ctx_k, ctx_v, attend: AttendFn, block_len=None):
        """Final-normed hidden states [B, T, H] of the T block positions: one block, or (in
        training) T / block_len blocks side by side (DFlash 2's convolutions stay inside
        each)."""
        inv_freq = rope_inv_freq(self.cfg.body)
        x = block_emb_BTH.astype(self.cfg.body.dtype)
        if self.cfg.input_embedding_scale != 1.0:
            x = x * jnp.asarray(self.cfg.input_embedding_scale, x.dtype)
        block_len = x.shape[1] if block_len is None else block_len
        for i, layer in enumerate(self.layers):
            x = layer(x, positions_BT, inv_freq, ctx_k[i], ctx_v[i], attend, block_len)
        return self.norm(x)

    def selector_terms(self, hidden, logits, labels, prev):
        """DFlash 2's selector objective at block positions (any leading shape, [..., H] /
        [..., V] / [...]): the K candidates are the top-K of the (drafter's) logits; with the
        true previous token `prev` as predecessor, the cross-entropy of softmax(scores) over
        them at the label where the label is a candidate ("covered"; 0 elsewhere). Trains the
        selector alone (its inputs are stopped). Returns (ce, correct, covered)."""
        sel = self.candidate_selector
        unary, cand = blocked_top_k(jax.lax.stop_gradient(logits).astype(jnp.float32), sel.top_k)
        proj = sel.hidden_projection(jax.lax.stop_gradient(hidden)).astype(jnp.float32)
        pred = jnp.take(sel.predecessor_codebook, prev, axis=0).astype(jnp.float32)
        succ = jnp.take(sel.successor_codebook, cand, axis=0).astype(jnp.float32)
        scores = unary + jnp.einsum("...r,...kr->...k", pred * proj, succ)
        hit = cand == labels[..., None]
        covered = jnp.any(hit, axis=-1)
        logq = jax.nn.log_softmax(scores, axis=-1)
        ce = -jnp.sum(jnp.where(hit, logq, 0.0), axis=-1)
        correct = covered & (jnp.argmax(scores, axis=-1) == jnp.argmax(hit, axis=-1))
        return ce, correct, covered

    def select(self, hidden_BTH, logits_BTV, x_last_B, temperature: float = 0.0, key=None):
        """DFlash 2's candidate selector over the drafted slots (`dflash2.CandidateSelector`)."""
        return self.candidate_selector.select(hidden_BTH, logits_BTV, x_last_B, temperature, key)

    def init_all(self, taps_BCF, block_emb_BTH):
        """Touches every parameter (used by `init`)."""
        b, c = taps_BCF.shape[:2]
        t = block_emb_BTH.shape[1]
        ctx_pos = jnp.broadcast_to(jnp.arange(c), (b, c))
        ck, cv = self.context_kv(taps_BCF, ctx_pos)
        if self.cfg.dflash2:
            self.candidate_selector(block_emb_BTH)
        return self(
            block_emb_BTH,
            c + jnp.broadcast_to(jnp.arange(t), (b, t)),
            ck,
            cv,
            decode_attend(jnp.full((b,), c, jnp.int32)),
        )


def drafter_logits(cfg: DrafterConfig, logits):
    """The LM head's logits as this drafter scores them: x output_multiplier, soft-capped at
    final_logit_softcapping (DFlash 2 always in float32; DFlash 1 as they are when neither
    field changes them)."""
    if not cfg.dflash2 and not cfg.scales_logits:
        return logits
    return adjust_logits(logits, cfg.output_multiplier, cfg.final_logit_softcapping)


def decode_attend(ctx_len_B, impl: str = "xla") -> AttendFn:
    """Decode-time attention: the committed context (positions j < ctx_len) plus the whole
    block at positions ctx_len .. ctx_len + T - 1, non-causal; a sliding layer's within its
    window, from a context cache that may be a ring (`attention.draft_attention`)."""

    def attend(q, k, v, ctx_k, ctx_v, window=None, causal=False):
        return attn_lib.draft_attention(
            q, ctx_k, ctx_v, ctx_len_B, k, v, impl=impl, window=window, causal=causal
        )

    return attend


# Hugging Face's Qwen3 `initializer_range` default: the std of new weight matrices.
INITIALIZER_RANGE = 0.02


def init_drafter_params(
    cfg: DrafterConfig, seed: int = 0, initializer_range: float = INITIALIZER_RANGE
):
    """New drafter parameters, initialised as Hugging Face's Qwen3 does (`_init_weights`):
    every weight matrix ~ N(0, initializer_range), biases 0, RMSNorm scales 1."""
    model = DFlashDrafter(cfg)
    taps = jnp.zeros((1, 2, cfg.num_taps * cfg.target_hidden_size), cfg.body.dtype)
    emb = jnp.zeros((1, cfg.block_size, cfg.body.hidden_size), cfg.body.dtype)
    key, redraw = jax.random.split(jax.random.PRNGKey(seed))
    params = model.init(key, taps, emb, method=DFlashDrafter.init_all)["params"]

    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(redraw, len(leaves))
    out = []
    for k, (path, x) in zip(keys, leaves):
        name = getattr(path[-1], "key", None)
        if name == "kernel":
            x = (initializer_range * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
        elif name == "bias":
            x = jnp.zeros_like(x)
        out.append(x)  # RMSNorm scales stay ones (their initializer)
    return jax.tree_util.tree_unflatten(tree, out)


def widen_taps(cfg: DrafterConfig, params, target_layer_ids: Sequence[int]):
    """A drafter (config, params) continued with more taps: `target_layer_ids` must hold the
    old ones; fc's input rows of an old tap are kept, those of a new tap start at zero, so the
    widened drafter computes what the old one did (a warm start for training the new rows)."""
    old_ids, new_ids = list(cfg.target_layer_ids), [int(i) for i in target_layer_ids]
    if not set(old_ids) <= set(new_ids) or len(set(new_ids)) != len(new_ids):
        raise ValueError(
            f"widen_taps: the taps {new_ids} must be distinct and hold the drafter's {old_ids}"
        )
    h = cfg.target_hidden_size
    w = params["fc"]["kernel"]  # [n_taps * H, width]
    rows = [
        w[old_ids.index(i) * h : (old_ids.index(i) + 1) * h]
        if i in old_ids
        else jnp.zeros((h, w.shape[1]), w.dtype)
        for i in new_ids
    ]
    params = dict(params, fc=dict(params["fc"], kernel=jnp.concatenate(rows, axis=0)))
    return cfg.replace(target_layer_ids=tuple(new_ids)), params


def upgrade_to_dflash2(cfg: DrafterConfig, params, seed: int = 0, **fields):
    """A DFlash drafter (config, params) continued as DFlash 2: `fields` (conv_kernel_size > 0,
    conv_group_size, selector_rank, selector_top_k, output_multiplier,
    final_logit_softcapping) set on the config, every parameter the two share kept, the new
    ones initialised as `init_drafter_params` does, except that the convolutions' dynamic-tap
    projections start at zero. The convolutions then start as the identity (their base kernel's
    offset-0 taps are 1), so with output_multiplier 1 and no cap the upgraded drafter's logits
    are the DFlash drafter's, and the selector's codebooks start small (N(0, 0.02)): a warm
    start for training, never a change of what the old parameters compute."""
    if cfg.dflash2:
        raise ValueError("upgrade_to_dflash2: the drafter is already DFlash 2")
    new_cfg = cfg.replace(**fields)
    if not new_cfg.dflash2:
        raise ValueError("upgrade_to_dflash2: conv_kernel_size must be > 0")
    fresh = init_drafter_params(new_cfg, seed=seed)
    old = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    leaves, tree = jax.tree_util.tree_flatten_with_path(fresh)
    out, kept = [], 0
    for path, x in leaves:
        key = jax.tree_util.keystr(path)
        if key in old:
            if old[key].shape != x.shape:
                raise ValueError(f"upgrade_to_dflash2: {key} is {old[key].shape}, not {x.shape}")
            x, kept = old[key], kept + 1
        elif "kernel_projection" in key:
            x = jnp.zeros_like(x)
        out.append(x)
    if kept != len(old):
        raise ValueError(f"upgrade_to_dflash2: {len(old) - kept} parameters have no place")
    return new_cfg, jax.tree_util.tree_unflatten(tree, out)


def silence_selector(params):
    """DFlash 2 params with the candidate selector's codebooks zeroed: every candidate's pair
    score is then 0, so the selector's walk takes each slot's largest logit (the drafter's own
    argmax chain, as a DFlash drafter drafts). Beside the trained drafter it measures what the
    selector adds. ValueError for params without a selector."""
    if "candidate_selector" not in params:
        raise ValueError("not a DFlash 2 drafter (it has no candidate selector)")
    params = dict(params)
    sel = dict(params["candidate_selector"])
    for name in ("predecessor_codebook", "successor_codebook"):
        sel[name] = jax.tree_util.tree_map(jnp.zeros_like, sel[name])
    params["candidate_selector"] = sel
    return params


# ---------------------------------------------------------------------------- user object


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


def read_drafter_config(
    path: str,
    target_config: Optional[ModelConfig] = None,
    dtype: str = "float32",
    param_dtype: Optional[str] = None,
) -> DrafterConfig:
    """The drafter config of directory `path` (config.json only, no weights), checked, and
    with `target_config` checked against the target (`validate_pair`): what `load_drafter`
    reads, so that the CLIs can refuse a bad drafter before any model is loaded."""
    hf = checkpoint._read_config(path)
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

    with open(os.path.join(path, "config.json")) as f:
        size = json.load(f).get("draft_vocab_size")
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


# ---------------------------------------------------------------------------- the kind


class DFlashKind(base.DrafterKind):
    """DFlash (z-lab format, with its sliding-window variant): per-layer K/V of the tapped
    features as its context (`Decoder.write_context`, a ring when every layer slides), one
    block per pass: a chain, a tree, or K denoising passes over the same pass's
    log-probabilities (the pass itself: `Decoder.draft_block` / `draft_logprobs` /
    `sample_block`). DFlash 2 drafters (`config.dflash2`) draft in the loop as `DFlash2Kind`."""

    name = "dflash"
    default_draft_sampling = "sample"
    config_type = (DrafterConfig,)
    drafter_type = (Drafter,)
    module_type = (DFlashDrafter,)

    # ---- host side
    def claims(self, spec) -> bool:
        return bool(spec)  # any other directory or hub id: a z-lab drafter, checked on reading

    def read_config(self, spec, target_config, dtype: str = "float32"):
        return read_drafter_config(spec, target_config, dtype=dtype)

    def check_pair(self, config, target_config) -> None:
        validate_pair(config, target_config)

    def limits(self, config) -> base.Limits:
        return base.Limits(
            default_block_size=config.block_size,
            trained_block_size=config.block_size,
            chain_only=(
                "DFlash 2 drafters yet (its candidate selector drafts one chain in one pass)"
                if config.dflash2
                else None
            ),
        )

    def load(self, spec, target):
        return load_drafter(spec, target=target)

    def save(self, drafter, path: str, dtype: Optional[str] = None) -> None:
        save_drafter(drafter, path, dtype)

    def tap_layers(self, config, num_target_layers: int):
        return config.target_layer_ids

    def from_trained(self, config, params, vocab=None):
        return Drafter(config, params, draft_vocab=vocab)

    def decode_params(self, drafter):
        return drafter.decode_params

    def for_target(self, target_config, block_size: int = 16, **options):
        return make_drafter_config(target_config, block_size=block_size, **options)

    def module(self, config):
        return DFlashDrafter(config)

    def abstract_params(self, config):
        return jax.eval_shape(lambda: init_drafter_params(config))

    def passes(self, config, block_size: int, denoise_steps: int = 1):
        return denoise_steps, None  # the target's LM head once per pass

    def variant(self, config, dflash2_fields=None, window=None):
        """`config` as DFlash 2 (with `dflash2_fields`: its convolutions and selector sizes)
        and / or with every layer sliding with `window` (bidirectional inside the block for
        DFlash; DFlash 2: the reference's default, causal)."""
        if dflash2_fields:
            config = config.replace(**dflash2_fields)
        if window:
            causal = None if config.dflash2 else False
            config = config.replace(**sliding_layers(config.body.num_layers, window, causal))
        return config

    def loop(self, config) -> base.DrafterKind:
        return DFLASH2 if config.dflash2 else self

    # ---- the decode loop
    def init_context(self, dec, b, capacity):
        cfg = dec.dmod.cfg
        return KVCache.create(cfg, b, cfg.context_capacity(capacity))

    def write_context(self, dec, ctx, taps, ids, positions, lengths, starts=None):
        return dec.write_context(ctx, taps, positions, lengths, starts)

    def samples_drafts(self, dec) -> bool:
        """T > 0 with draft_sampling "sample", on a chain of one pass (a tree and the
        denoising passes draft from the argmax)."""
        plan = dec.plan
        return (
            plan.temperature > 0
            and base.draft_sampling(dec) == "sample"
            and not plan.tree_budget
            and plan.denoise_steps == 1
        )

    def chain(self, dec, ctx, x_last, start, key):
        """(drafts [B, bs-1], confidence [B, bs-1], q_ids, q_probs): a greedy chain, verified
        as one-hot proposals (q None), or drafts sampled from the drafter's adjusted
        distribution q over the vocabulary (`Decoder.sample_block`; q_ids None)."""
        if self.samples_drafts(dec):
            drafts, conf, q = dec.sample_block(ctx, x_last, start, key)
            return drafts, conf, None, q
        drafts, conf = dec.draft_block(ctx, x_last, start)
        return drafts, conf, None, None

    def propose(self, dec, state, x_last, start, key=None):
        if dec.plan.tree_budget:
            logp = dec.draft_logprobs(state.ctx, x_last, start)
            tree = build_tree(x_last, logp, dec.plan.tree_budget)
            return base.Proposal(tokens=tree.tokens, depths=tree.depths, tree=tree)
        drafts, conf, q_ids, q_probs = self.chain(dec, state.ctx, x_last, start, key)
        return base.chain_proposal(x_last, drafts, conf, q_ids, q_probs)


class DFlash2Kind(DFlashKind):
    """DFlash 2 in the loop: the DFlash context and pass, then the candidate selector's walk:
    greedy at T = 0; at T > 0 sampled, with its proposal q for rejection sampling
    (draft_sampling "sample", its default; "argmax": the greedy walk, verified as one-hot
    proposals)."""

    name = "dflash2"

    def samples_drafts(self, dec) -> bool:
        return dec.plan.temperature > 0 and base.draft_sampling(dec) == "sample"

    def chain(self, dec, ctx, x_last, start, key):
        if not self.samples_drafts(dec):
            drafts, conf = dec.draft_block(ctx, x_last, start)
            return drafts, conf, None, None
        return dec.select_block(ctx, x_last, start, key)


KIND, DFLASH2 = DFlashKind(), DFlash2Kind()
