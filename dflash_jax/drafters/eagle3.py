"""The EAGLE-3 drafter (`LlamaForCausalLMEagle3`): one Llama-style layer over the target's
embedding and a fused feature, drafting one token per step over its own reduced vocabulary.

Forward of one step at the rows `t` (shapes [B, T, .]):
  feature   f = fc(concat(tap_a, tap_b, tap_c))  [3 * H_target -> H]   (target features), or
            f = the drafter's own hidden state of the step before (pre-norm, already H wide)
  inputs    e = input_layernorm(embedding(token)),  g = hidden_norm(f)
  attention q, k, v from concat(e, g) (2H wide, the embedding first), RoPE at the row's
            position; causal over the drafter's own cache (slots j < cache_lengths) and
            the new rows (row t sees rows r <= t); h = r + o_proj(attention), where the residual
            r = f (r = g when the config says `norm_before_residual`)
  MLP       out = h + mlp(post_attention_layernorm(h))        (out: the next step's feature)
  logits    lm_head(norm(out))  over the draft vocabulary [Vd]; draft id i is target id
            i + d2t[i]

Row pairing (vLLM's proposer): the row at position p carries the target's feature of position
p and the embedding of the token at p + 1, and its logits predict the token at p + 2. A chain
of K drafts is K steps, each one row at the next position fed the step before's `out` and
the embedding of the token it drafted.

Facts and sources (public code read with the search tools; nothing copied):
  - sgl-project/SpecForge specforge/modeling/draft/llama3_eagle.py (`LlamaForCausalLMEagle3`):
    parameter names `fc` (no bias, input 3 * target_hidden_size, or 3 * hidden_size when
    the config has no target_hidden_size), `midlayer.{input_layernorm, hidden_norm,
    post_attention_layernorm}`, `midlayer.self_attn.{q,k,v}_proj` with input 2 * hidden_size
    and `o_proj`, `midlayer.mlp.{gate,up,down}_proj` (SwiGLU), `norm`, `lm_head` [draft_vocab,
    H] (no bias), buffers `d2t` int64 [draft_vocab] and `t2d` bool [vocab], its own
    `embed_tokens` [vocab, H]; the layer saves the un-normed feature as the residual, norms
    the embedding with input_layernorm and the feature with hidden_norm, concatenates them
    embedding first, and adds the attention output to the saved feature; RMSNorm as Llama's
    (float32 statistics, cast back, then the weight). RoPE from the config's rope_theta and
    rope_scaling (llama3 / linear) in its newer versions; an older version built RoPE with
    base 10000 and no llama3 scaling whatever the config said (serving, and this code, follow
    the config).
  - vllm-project/vllm vllm/model_executor/models/llama_eagle3.py: the same layer, with
    `norm_before_residual` (when true the residual is hidden_norm(feature)); `midlayer.` read
    as the first layer; `t2d` skipped, `d2t` kept as the draft-to-target offsets (target id =
    draft id + d2t, scattered into full-vocabulary logits with -inf elsewhere);
    `draft_vocab_size` defaults to `vocab_size` when absent; `embed_tokens` optional in the
    file (absent: the target's embedding is shared; vLLM's proposer also shares it when it is
    equal to the target's). The model returns the final-normed state for the logits and the
    pre-norm sum, which is the next step's feature. The proposer shifts the token ids by one
    against the target's positions and features (the row pairing above).
  - sgl-project/sglang python/sglang/srt/models/llama_eagle3.py: the same forward (fc applied
    when the incoming hidden state is not H wide, i.e. to the target's three taps); the
    `d2t` offsets become the "hot" token ids; a config's `eagle_config.
    eagle_aux_hidden_state_layer_ids` names the tapped layers by the output of layer i (this
    code's tap convention), default (1, L//2 - 1, L - 4) in those terms (vLLM's capture
    indices 2, L//2, L - 3 count the input of the layer).
  - vllm-project/tpu-inference tpu_inference/models/jax/llama_eagle3.py (JAX): the same names
    and residual rule (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`; `embed_tokens` excluded,
    shared with the target).
  - sgl-project/SpecForge configs/qwen3-4b-eagle3.json: a published-style config.json
    (`architectures: ["LlamaForCausalLMEagle3"]`, `model_type: llama`, `num_hidden_layers: 1`,
    `head_dim`, `rope_theta`, `rope_scaling`, `draft_vocab_size`, `tie_word_embeddings`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional, Tuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafters import base
from dflash_jax.models import attention as attn_lib
from dflash_jax.models import checkpoint, hub
from dflash_jax.models.config import ModelConfig, as_dtype
from dflash_jax.models.layers import MLP, QKVProjection, RMSNorm, rope_inv_freq
from dflash_jax.models.safetensors_io import CheckpointError, SafetensorsDir, save_sharded
from dflash_jax.models.transformer import KVCache, flat_heads, write_kv

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # published, vLLM's
NUM_TAPS = 3
# The verify block when none is asked for: x_last and 7 drafts.
DEFAULT_BLOCK_SIZE = 8
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
            body = ModelConfig._from_hf_fields(
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


def ttt_attention(q_BSND, k0_BSKD, v0_BSKD, mask_BSS, kj_BSJKD, vj_BSJKD):
    """Attention of training-time test: query row p over the keys r of k0 / v0 with
    mask_BSS[b, p, r] and over row p's own J keys kj / vj [B, S, J, K, D] (its own drafting
    steps), one float32 softmax over both; grouped query heads (N = K x group). [B, S, N, D]
    in q's dtype."""
    b, s, n, d = q_BSND.shape
    kh = k0_BSKD.shape[2]
    f32 = jnp.float32
    q = q_BSND.reshape(b, s, kh, n // kh, d).astype(f32) * d**-0.5
    hi = jax.lax.Precision.HIGHEST
    main = jnp.einsum("bskgd,brkd->bkgsr", q, k0_BSKD.astype(f32), precision=hi)
    main = jnp.where(mask_BSS[:, None, None], main, -jnp.inf)
    own = jnp.einsum("bskgd,bsjkd->bkgsj", q, kj_BSJKD.astype(f32), precision=hi)
    p = jax.nn.softmax(jnp.concatenate([main, own], axis=-1), axis=-1)
    out = jnp.einsum("bkgsr,brkd->bskgd", p[..., :s], v0_BSKD.astype(f32), precision=hi)
    out = out + jnp.einsum("bkgsj,bsjkd->bskgd", p[..., s:], vj_BSJKD.astype(f32), precision=hi)
    return out.reshape(b, s, n, d).astype(q_BSND.dtype)


# ---------------------------------------------------------------------------- model


class LMHead(nn.Module):
    """The drafter's own LM head, [H] -> float32 logits [Vd] (kernel [H, Vd], no bias)."""

    features: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        kernel = self.param(
            "kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features), self.param_dtype
        )
        return jnp.einsum(
            "...h,hv->...v",
            x.astype(self.dtype),
            kernel.astype(self.dtype),
            preferred_element_type=jnp.float32,
        )


class Eagle3Layer(nn.Module):
    """`midlayer`: attention over [input_layernorm(embedding) ; hidden_norm(feature)], the
    residual around it the feature (hidden_norm(feature) with norm_before_residual), then a
    pre-norm SwiGLU MLP."""

    cfg: ModelConfig
    norm_before_residual: bool = False

    def setup(self):
        c = self.cfg
        self.input_layernorm = RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype)
        self.hidden_norm = RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype)
        self.self_attn = QKVProjection(c)  # q/k/v read 2H (Dense takes the input's width)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype)
        self.mlp = MLP(c)

    def _layer(self, emb_BTH, feature_BTH, positions_BT, inv_freq, attend):
        """The layer around an attention rule `attend(q, k, v) -> [B, T, N, D]` given the rows'
        queries and their own new K/V: (out [B, T, H] pre-norm, k, v [B, T, K, D])."""
        g = self.hidden_norm(feature_BTH)
        x = jnp.concatenate([self.input_layernorm(emb_BTH), g], axis=-1)
        q = self.self_attn.queries(x, positions_BT, inv_freq)
        k, v = self.self_attn.keys_values(x, positions_BT, inv_freq)
        a = attend(q, k, v)
        h = (g if self.norm_before_residual else feature_BTH) + self.self_attn.output(a)
        return h + self.mlp(self.post_attention_layernorm(h)), k, v

    def __call__(self, emb_BTH, feature_BTH, positions_BT, inv_freq, cache_k, cache_v, lengths_B):
        """(out [B, T, H] pre-norm, new k, new v [B, T, K, D]): the new rows over the cache's
        slots < lengths_B and, causally, each other."""
        attend = lambda q, k, v: attn_lib.draft_attention(
            q, cache_k, cache_v, lengths_B, k, v, causal=True
        )
        return self._layer(emb_BTH, feature_BTH, positions_BT, inv_freq, attend)

    def unrolled_step(self, emb_BSH, feature_BSH, positions_BS, inv_freq, k0, v0, mask_BSS, kj, vj):
        """One training-time-test step over every row at once (`Eagle3Drafter.unrolled`).
        k0, v0 None (the first step): the rows' own K/V are the first step's, row p seeing row r
        where mask_BSS [B, S, S] allows. Later steps: row p sees the first step's k0, v0
        [B, S, K, D] under the mask, its own earlier steps' kj, vj [B, S, j, K, D] and its own
        new K/V. Returns (out [B, S, H] pre-norm, k0, v0, kj, vj): the keys and values the
        next step sees (this step's appended to kj / vj, or k0 / v0 at the first step)."""
        seen = {}

        def attend(q, k, v):
            if k0 is None:
                seen.update(k0=k, v0=v, kj=kj, vj=vj)
            else:
                seen.update(
                    k0=k0,
                    v0=v0,
                    kj=jnp.concatenate([kj, k[:, :, None]], axis=2),
                    vj=jnp.concatenate([vj, v[:, :, None]], axis=2),
                )
            return ttt_attention(q, seen["k0"], seen["v0"], mask_BSS, seen["kj"], seen["vj"])

        out, _, _ = self._layer(emb_BSH, feature_BSH, positions_BS, inv_freq, attend)
        return out, seen["k0"], seen["v0"], seen["kj"], seen["vj"]

    def keys_values(self, emb_BTH, feature_BTH, positions_BT, inv_freq):
        """The rows' K/V alone (what `__call__` writes to the cache), no attention or MLP."""
        x = jnp.concatenate([self.input_layernorm(emb_BTH), self.hidden_norm(feature_BTH)], axis=-1)
        return self.self_attn.keys_values(x, positions_BT, inv_freq)


class Eagle3Drafter(nn.Module):
    """Parameters: fc, midlayer/..., norm, lm_head (the published names, Flax layout). The
    draft-to-target offsets live apart from the parameters, in the `vocab` collection
    (`{"vocab": {"d2t": int32 [Vd]}}`, read by `to_target_ids` only)."""

    cfg: Eagle3Config

    def setup(self):
        b = self.cfg.body
        self.fc = nn.Dense(b.hidden_size, use_bias=False, dtype=b.dtype, param_dtype=b.param_dtype)
        self.midlayer = Eagle3Layer(b, self.cfg.norm_before_residual)
        self.norm = RMSNorm(b.rms_norm_eps, b.dtype, b.param_dtype)
        self.lm_head = LMHead(self.cfg.draft_vocab_size, b.dtype, b.param_dtype)

    def fuse(self, taps_BT3F):
        """The first step's feature: fc(concat of the three taps) [B, T, 3*H_target] -> [B, T, H]."""
        return self.fc(taps_BT3F.astype(self.cfg.body.dtype))

    def logits(self, hidden_BTH):
        """Float32 logits over the draft vocabulary [B, T, Vd] of pre-norm hidden states."""
        return self.lm_head(self.norm(hidden_BTH))

    def step(self, emb_BTH, feature_BTH, positions_BT, cache_k, cache_v, cache_lengths):
        """One pass over T new rows (at positions_BT, the row pairing of the module doc).

        emb_BTH: the (shared) embeddings of the rows' tokens; feature_BTH: `fuse` of the
        target's taps, or the step before's hidden output. cache_k / cache_v: [B, S, K*D] (or
        [B, S, K, D]) the drafter's own K/V, slots j < cache_lengths [B] valid; each new row t
        sees those and the new rows r <= t. Returns (hidden [B, T, H] pre-norm: the next
        feature, logits [B, T, Vd] float32, k, v [B, T, K, D]: the new rows' K/V, RoPE'd, for
        the caller to write (`write_step_kv`)."""
        dt = self.cfg.body.dtype
        out, k, v = self.midlayer(
            emb_BTH.astype(dt),
            feature_BTH.astype(dt),
            positions_BT,
            rope_inv_freq(self.cfg.body),
            cache_k,
            cache_v,
            cache_lengths,
        )
        return out, self.logits(out), k, v

    def row_kv(self, emb_BTH, feature_BTH, positions_BT):
        """The K/V [B, T, K, D] of rows whose output is not needed (committed rows: the decode
        loop writes them into the cache and drafts from the last one only): `step`'s k, v
        without its attention, MLP and logits."""
        dt = self.cfg.body.dtype
        return self.midlayer.keys_values(
            emb_BTH.astype(dt), feature_BTH.astype(dt), positions_BT, rope_inv_freq(self.cfg.body)
        )

    def unrolled(self, taps_BS3F, embs_JBSH, positions_BS, mask_BSS):
        """Training-time test (TTT): J drafting steps from every row of a sequence at once,
        exactly as the decode loop drafts them (`step` over the committed rows' cache).

        Step 0 runs every row p as a committed row: fuse(taps) at p, the embedding of the token
        at p + 1 (embs_JBSH[0]), position p, attention over the rows r with mask_BSS[b, p, r]
        (causal within p's sequence: what a cache filled up to p holds). Step j >= 1 runs row p
        as the j-th draft after p: the feature is row p's own output of step j - 1, the
        embedding is embs_JBSH[j] (the token at p + 1 + j), the position p + j, and it sees the
        step-0 rows as step 0 did plus row p's own steps 1..j (the drafts the cache holds by
        then). Logits [J, B, S, Vd] float32: step j at row p predicts the token at p + 2 + j."""
        c = self.cfg.body
        dt, inv_freq = c.dtype, rope_inv_freq(c)
        b, s = positions_BS.shape
        feature = self.fuse(taps_BS3F).astype(dt)
        k0 = v0 = None
        kj = vj = jnp.zeros((b, s, 0, c.num_kv_heads, c.head_dim), dt)
        logits = []
        for j in range(embs_JBSH.shape[0]):
            feature, k0, v0, kj, vj = self.midlayer.unrolled_step(
                embs_JBSH[j].astype(dt), feature, positions_BS + j, inv_freq, k0, v0, mask_BSS,
                kj, vj,
            )  # fmt: skip
            logits.append(self.logits(feature))
        return jnp.stack(logits)

    def to_target_ids(self, draft_ids):
        """Target token ids of draft ids: i -> i + d2t[i], d2t read from the `vocab` collection
        (absent: the identity, allowed only when the draft vocabulary is the whole one)."""
        d2t = self.get_variable("vocab", "d2t")
        if d2t is None:
            if self.cfg.draft_vocab_size != self.cfg.body.vocab_size:
                raise ValueError(
                    "to_target_ids needs the d2t offsets: apply with {'vocab': {'d2t': ...}} "
                    "(`Eagle3.variables`)"
                )
            return jnp.asarray(draft_ids)
        return draft_to_target_ids(draft_ids, d2t)

    def init_all(self, taps_BT3F, emb_BTH):
        """Touches every parameter (used by `init`)."""
        b, t = emb_BTH.shape[:2]
        cache = jnp.zeros(
            (b, 1, self.cfg.body.num_kv_heads * self.cfg.body.head_dim), emb_BTH.dtype
        )
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        lengths = jnp.zeros((b,), jnp.int32)
        return self.step(emb_BTH, self.fuse(taps_BT3F), positions, cache, cache, lengths)


def create_cache(cfg: Eagle3Config, batch: int, capacity: int, dtype=None) -> KVCache:
    """The drafter's own KV cache: one layer of [B, capacity, K*D] (slot = position), empty."""
    return KVCache.create(cfg.body, batch, capacity, dtype)


def write_step_kv(cache: KVCache, k_BTKD, v_BTKD, positions_BT, lengths_B) -> KVCache:
    """`cache` with a step's new K/V written at slot = position (slots outside the capacity
    dropped) and `lengths_B` as its committed length (what the caller keeps of the rows)."""
    return cache.replace(
        k=(write_kv(cache.k[0], flat_heads(k_BTKD), positions_BT),),
        v=(write_kv(cache.v[0], flat_heads(v_BTKD), positions_BT),),
        lengths=jnp.asarray(lengths_B, jnp.int32),
    )


# Hugging Face's Llama `initializer_range` default: the std of new weight matrices.
INITIALIZER_RANGE = 0.02


def init_eagle3_params(
    cfg: Eagle3Config, seed: int = 0, initializer_range: float = INITIALIZER_RANGE
):
    """New drafter parameters as Hugging Face's Llama initialises them: every weight matrix
    ~ N(0, initializer_range), RMSNorm scales 1. (The d2t offsets are not parameters: the
    identity map is `np.zeros(draft_vocab_size)`.)"""
    b = cfg.body
    model = Eagle3Drafter(cfg)
    taps = jnp.zeros((1, 2, NUM_TAPS * cfg.target_hidden_size), b.dtype)
    emb = jnp.zeros((1, 2, b.hidden_size), b.dtype)
    key, redraw = jax.random.split(jax.random.PRNGKey(seed))
    params = model.init(key, taps, emb, method=Eagle3Drafter.init_all)["params"]
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(redraw, len(leaves))
    out = []
    for k, (path, x) in zip(keys, leaves):
        name = getattr(path[-1], "key", None)
        if name == "kernel":
            x = (initializer_range * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
        elif name == "bias":
            x = jnp.zeros_like(x)
        out.append(x)
    return jax.tree_util.tree_unflatten(tree, out)


# ---------------------------------------------------------------------------- user object


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


# ---------------------------------------------------------------------------- the kind


@flax.struct.dataclass
class Eagle3Context:
    """An EAGLE-3 drafter's context in the decode loop: its own one-layer K/V cache (slot =
    position; rows at positions < cache.lengths = committed length - 1 hold the committed
    rows) and `pending` [B, H], the fused target feature of the last committed position, whose
    row waits for the token after it."""

    cache: KVCache
    pending: jnp.ndarray


class Eagle3Kind(base.DrafterKind):
    """EAGLE-3: one drafter layer over its own cache, K = block_size - 1 steps per proposal.

    Rows. The row at position p pairs a feature of position p with the embedding of the token
    at p + 1; its logits predict the token at p + 2. With L committed positions (0 .. L-1 in
    the target cache, x_last at L = start not yet through the target), the cache holds the
    committed rows 0 .. L-2, built from the target's features fc(taps); the feature of L-1
    is `pending`.

    propose: step i = 1 .. K is one row at position start - 2 + i: step 1 = (pending,
    embedding(x_last)) at start - 1, step i > 1 = (step i-1's pre-norm hidden output,
    embedding(d_{i-1})); step i's logits give d_i, the token at start + i. Each step's K/V go
    to its slot without advancing the committed length (commit overwrites them).

    write_context (commit: positions start .. start+n-1 with taps, ids[0] = x_last; prefill:
    a prompt chunk): rows start-1 .. start+n-2, row start-1+j = (feature j, embedding(ids[j]))
    with feature 0 = pending and feature j = fc(taps[j-1]); their K/V only (no attention:
    a committed row's output is never read); the feature of the new last position
    start+n-1 becomes pending.

    Parameters (`Decoder.dparams`): `Eagle3.decode_params` of the user object, {"params",
    "vocab": {"d2t"}} and optionally "embedding" (the drafter's own; absent: the target's)."""

    name = "eagle3"
    default_draft_sampling = "sample"
    config_type = (Eagle3Config,)
    drafter_type = (Eagle3,)
    module_type = (Eagle3Drafter,)

    # ---- host side
    def claims(self, spec) -> bool:
        return is_eagle3_dir(spec)

    def read_config(self, spec, target_config, dtype: str = "float32"):
        return Eagle3Config.from_hf(
            checkpoint.read_config(spec), dtype=dtype, source=os.path.join(spec, "config.json")
        )

    def check_pair(self, config, target_config) -> None:
        # (its width against the target's: `check_loaded`, which sees its embedding)
        validate_eagle3_pair(config, target_config, own_embedding=True)

    def check_loaded(self, drafter, target_config) -> None:
        validate_eagle3_pair(drafter.config, target_config, drafter.embedding is not None)

    def limits(self, config) -> base.Limits:
        return base.Limits(
            default_block_size=DEFAULT_BLOCK_SIZE,
            chain_only="EAGLE-3 drafters (one chain, drafted token by token)",
        )

    def load(self, spec, target, **options):
        return load_eagle3(spec, target=target, **options)

    def save(self, drafter, path: str, dtype: Optional[str] = None) -> None:
        save_eagle3(drafter, path, dtype)

    def tap_layers(self, config, num_target_layers: int):
        return config.tap_layers(num_target_layers)

    def from_trained(self, config, params, vocab=None):
        """vocab: d2t, the draft-to-target offsets (None: the whole vocabulary)."""
        d2t = np.zeros((config.draft_vocab_size,), np.int64) if vocab is None else vocab
        return Eagle3(config, params, d2t)

    def decode_params(self, drafter):
        return drafter.decode_params

    def new_config(self, target_config, **options):
        return make_eagle3_config(target_config, **options)

    def init_params(self, config, seed: int = 0):
        return init_eagle3_params(config, seed=seed)

    def for_target(self, target_config, block_size: int, draft_vocab_size=None, **options):
        """One Llama layer at the target's width over its default taps (first, middle and last
        on a target too shallow for them), the target's embedding shared, its own LM head over
        `draft_vocab_size` tokens (at most the vocabulary; None: all of it)."""
        n = target_config.num_layers
        try:
            taps = default_eagle3_taps(n)
        except ValueError:  # a target too shallow for the default (test shapes)
            taps = (0, n // 2, n - 1)
        vd = min(draft_vocab_size or target_config.vocab_size, target_config.vocab_size)
        return self.new_config(target_config, draft_vocab_size=vd, target_layer_ids=taps, **options)

    def module(self, config):
        return Eagle3Drafter(config)

    def abstract_params(self, config):
        params = jax.eval_shape(lambda: init_eagle3_params(config))
        d2t = jax.ShapeDtypeStruct((config.draft_vocab_size,), jnp.int32)
        return {"params": params, "vocab": {"d2t": d2t}}

    def passes(self, config, block_size: int, denoise_steps: int = 1):
        return block_size - 1, 0  # a step per draft, over its own head

    # ---- the decode loop
    def variables(self, dec):
        return {"params": dec.dparams["params"], "vocab": dec.dparams["vocab"]}

    def embed(self, dec, ids):
        """Embeddings of token ids (any shape): the drafter's own table, else the target's."""
        own = dec.dparams.get("embedding")
        if own is None:
            return dec.embed(ids)
        return jnp.take(own, ids, axis=0)

    def init_context(self, dec, b, capacity):
        body = dec.dmod.cfg.body
        return Eagle3Context(
            cache=create_cache(dec.dmod.cfg, b, capacity),
            pending=jnp.zeros((b, body.hidden_size), body.dtype),
        )

    def write_context(self, dec, ctx, taps, ids, positions, lengths, starts=None):
        b, t = ids.shape
        if starts is None:
            starts = positions[:, 0]
        mod = dec.dmod
        fused = mod.apply(self.variables(dec), taps, method=Eagle3Drafter.fuse)
        feats = jnp.concatenate([ctx.pending[:, None].astype(fused.dtype), fused[:, :-1]], 1)
        rows = starts[:, None] - 1 + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
        k, v = mod.apply(
            self.variables(dec),
            self.embed(dec, ids),
            feats,
            jnp.maximum(rows, 0),
            method=Eagle3Drafter.row_kv,
        )
        keep = (rows >= 0) & (rows < lengths[:, None] - 1)
        slots = jnp.where(keep, rows, ctx.cache.capacity)  # capacity: dropped
        cache = write_step_kv(ctx.cache, k, v, slots, jnp.maximum(lengths - 1, 0))
        last = lengths - 1 - starts  # index of the last committed position in this write
        here = last >= 0
        new = fused[jnp.arange(b), jnp.clip(last, 0, t - 1)]
        pending = jnp.where(here[:, None], new.astype(ctx.pending.dtype), ctx.pending)
        return Eagle3Context(cache=cache, pending=pending)

    def samples_drafts(self, dec) -> bool:
        return dec.plan.temperature > 0 and base.draft_sampling(dec) == "sample"

    def draft_step(self, dec, state, cache, feature, token, position, chain, i):
        """One drafting step: the row (feature [B, H], embedding of token [B]) at position [B]
        against the cache (slots < cache.lengths) -> (hidden [B, H], logits [B, Vd] float32
        over the draft vocabulary, the cache with the row's K/V in its slot, length kept).
        state (the decode state), chain [B, bs] (x_last, the drafts so far, zeros after) and
        i (this step's 1-based index) are unused here: what an oracle that tests put in its
        place may read."""
        del state, chain, i
        hidden, logits, k, v = dec.dmod.apply(
            self.variables(dec),
            self.embed(dec, token)[:, None],
            feature[:, None],
            position[:, None],
            cache.k[0],
            cache.v[0],
            cache.lengths,
            method=Eagle3Drafter.step,
        )
        cache = write_step_kv(cache, k, v, position[:, None], cache.lengths)
        return hidden[:, 0], logits[:, 0], cache

    def propose(self, dec, state, x_last, start, key=None):
        b = x_last.shape[0]
        bs = dec.plan.block_size
        k_steps = bs - 1
        sampled = self.samples_drafts(dec)
        vd = dec.dmod.cfg.draft_vocab_size
        targets = dec.dmod.apply(
            self.variables(dec),
            jnp.arange(vd, dtype=jnp.int32),
            method=Eagle3Drafter.to_target_ids,
        ).astype(jnp.int32)  # [Vd]: the target id of each draft id
        keys = jax.random.split(key, k_steps) if sampled else jnp.zeros((k_steps, 2), jnp.uint32)
        chain0 = jnp.zeros((b, bs), jnp.int32).at[:, 0].set(x_last)
        ctx = state.ctx
        # The steps attend to the committed rows and to the steps before (length + i - 1).
        cache0 = ctx.cache.replace(lengths=start - 1)

        def one(carry, xs):
            cache, feature, token, chain = carry
            i, step_key = xs
            position = start - 2 + i
            lengths = cache.lengths
            hidden, logits, cache = self.draft_step(
                dec, state, cache, feature, token, position, chain, i
            )
            cache = cache.replace(lengths=lengths + 1)
            logits = logits.astype(jnp.float32)
            p = jax.nn.softmax(logits, axis=-1)
            if sampled:
                q = jax.nn.softmax(logits / dec.plan.temperature, axis=-1)
                d = jax.random.categorical(step_key, logits / dec.plan.temperature, axis=-1)
            else:
                q = None
                d = jnp.argmax(logits, axis=-1)
            d = d.astype(jnp.int32)
            conf = jnp.take_along_axis(p, d[:, None], axis=-1)[:, 0]
            draft = targets[d]
            chain = chain.at[:, i].set(draft)
            out = (draft, conf) + ((q,) if sampled else ())
            return (cache, hidden.astype(feature.dtype), draft, chain), out

        carry = (cache0, ctx.pending, x_last, chain0)
        steps = jnp.arange(1, bs, dtype=jnp.int32)
        _, outs = jax.lax.scan(one, carry, (steps, keys))
        drafts = outs[0].T  # [B, K]
        conf = outs[1].T
        q_ids = q_probs = None
        if sampled:
            q_probs = jnp.transpose(outs[2], (1, 0, 2))  # [B, K, Vd]
            q_ids = jnp.broadcast_to(targets[None, None], q_probs.shape)
        return base.chain_proposal(x_last, drafts, conf, q_ids, q_probs)


KIND = Eagle3Kind()
