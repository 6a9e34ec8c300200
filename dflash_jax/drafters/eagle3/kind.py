"""The registry's EAGLE-3 kind: its proposal in the decode loop (K = block_size - 1 drafting
steps over its own cache), its context, and its host side."""

from __future__ import annotations

import os
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafters import base
from dflash_jax.drafters.eagle3.config import (
    DEFAULT_BLOCK_SIZE,
    Eagle3Config,
    default_eagle3_taps,
    make_eagle3_config,
)
from dflash_jax.drafters.eagle3.files import (
    Eagle3,
    is_eagle3_dir,
    load_eagle3,
    save_eagle3,
    validate_eagle3_pair,
)
from dflash_jax.drafters.eagle3.model import (
    Eagle3Drafter,
    create_cache,
    init_eagle3_params,
    write_step_kv,
)
from dflash_jax.models import checkpoint
from dflash_jax.models.transformer import KVCache


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
    # The published EAGLE-3 drafters of Qwen3 / Llama 3.1 targets draft over 32,000 tokens.
    draft_vocab_default = 32000

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

    def head_dim(self, config) -> int:
        return config.body.head_dim

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
