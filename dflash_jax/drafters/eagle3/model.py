"""The EAGLE-3 drafter module (`Eagle3Drafter`: one Llama-style layer over the target's
embedding and a fused feature, its own LM head), its one-layer cache and its parameters."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.drafters import base
from dflash_jax.drafters.eagle3.config import (
    INITIALIZER_RANGE,
    NUM_TAPS,
    Eagle3Config,
    draft_to_target_ids,
)
from dflash_jax.models import attention as attn_lib
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.layers import MLP, QKVProjection, RMSNorm, rope_inv_freq
from dflash_jax.models.transformer import KVCache, flat_heads, write_kv


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

    def unrolled_step(
        self, emb_BSH, feature_BSH, positions_BS, inv_freq, k0, v0, mask_BSS, kj, vj, rule
    ):
        """One training-time-test step over every row at once (`Eagle3Drafter.unrolled`; `rule`:
        its attention, `training.eagle3_ttt.ttt_attention`).
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
            return rule(q, seen["k0"], seen["v0"], mask_BSS, seen["kj"], seen["vj"])

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

    def unrolled(self, taps_BS3F, embs_JBSH, positions_BS, mask_BSS, rule):
        """Training-time test (TTT): J drafting steps from every row of a sequence at once,
        exactly as the decode loop drafts them (`step` over the committed rows' cache).

        Step 0 runs every row p as a committed row: fuse(taps) at p, the embedding of the token
        at p + 1 (embs_JBSH[0]), position p, attention over the rows r with mask_BSS[b, p, r]
        (causal within p's sequence: what a cache filled up to p holds). Step j >= 1 runs row p
        as the j-th draft after p: the feature is row p's own output of step j - 1, the
        embedding is embs_JBSH[j] (the token at p + 1 + j), the position p + j, and it sees the
        step-0 rows as step 0 did plus row p's own steps 1..j (the drafts the cache holds by
        then). Logits [J, B, S, Vd] float32: step j at row p predicts the token at p + 2 + j.
        rule: the attention over the step-0 rows and a row's own steps (the trainer's
        `training.eagle3_ttt.ttt_attention`)."""
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
                kj, vj, rule,
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
    return base.hf_initialized(params, redraw, initializer_range)
