"""The DFlash drafter's module (`DFlashDrafter`: the forward of the package docstring), its
logit rule, the decode-time attention, and its parameters (init, wider taps, DFlash 2)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.drafters import base
from dflash_jax.drafters.dflash2 import (
    CandidateSelector,
    GroupedDynamicCausalConv,
    adjust_logits,
    blocked_top_k,
)
from dflash_jax.models import attention as attn_lib
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.layers import MLP, QKVProjection, RMSNorm, rope_inv_freq
from dflash_jax.models.transformer import KVCache
from dflash_jax.drafters.dflash.config import INITIALIZER_RANGE, DrafterConfig


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


def decode_attend(ctx_len_B, impl: str = "xla", seq_split: bool = False) -> AttendFn:
    """Decode-time attention: the committed context (positions j < ctx_len) plus the whole
    block at positions ctx_len .. ctx_len + T - 1, non-causal; a sliding layer's within its
    window, from a context cache that may be a ring (`attention.draft_attention`; seq_split:
    the cache's `KVCache.seq_split`)."""

    def attend(q, k, v, ctx_k, ctx_v, window=None, causal=False):
        return attn_lib.draft_attention(
            q, ctx_k, ctx_v, ctx_len_B, k, v, impl=impl, window=window, causal=causal,
            seq_split=seq_split,
        )  # fmt: skip

    return attend


# Hugging Face's Qwen3 `initializer_range` default: the std of new weight matrices.


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

    return base.hf_initialized(params, redraw, initializer_range)


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
