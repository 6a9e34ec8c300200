"""The DFlash kind of drafter (`drafters.base.DrafterKind`): its host side and its drafting
in the decode loop; DFlash 2's candidate selector drafts as `DFlash2Kind`."""

from __future__ import annotations

from typing import Optional

import jax

import jax.numpy as jnp

from dflash_jax.drafters import base
from dflash_jax.drafters.tree import build_tree
from dflash_jax.models.transformer import KVCache
from dflash_jax.drafters.dflash.config import (
    DrafterConfig,
    make_drafter_config,
    sliding_layers,
    validate_pair,
)
from dflash_jax.drafters.dflash.files import (
    Drafter,
    _read_draft_vocab,
    load_drafter,
    read_drafter_config,
    save_drafter,
)
from dflash_jax.drafters.dflash.model import (
    DFlashDrafter,
    decode_attend,
    drafter_logits,
    init_drafter_params,
    upgrade_to_dflash2,
    widen_taps,
)
from dflash_jax.drafters.draft_vocab import full_logits
from dflash_jax.models import attention as attn_lib
from dflash_jax.models.sampling import adjusted_logits, greedy_argmax, sample_categorical
from dflash_jax.models.transformer import flat_heads, write_kv


class DFlashKind(base.DrafterKind):
    """DFlash (z-lab format, with its sliding-window variant): per-layer K/V of the tapped
    features as its context (`write_context`, a ring when every layer slides), one block per
    pass (`draft_logits`): a chain (`draft_block`, `sample_block`), a tree (`draft_logprobs`),
    or K denoising passes (`denoise`). DFlash 2 drafters (`config.dflash2`) draft in the loop
    as `DFlash2Kind` (`select_block`: its candidate selector). Tests put an oracle in place of
    a pass with `registry.using(...)`."""

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

    def load(self, spec, target, **options):
        return load_drafter(spec, target=target, **options)

    def save(self, drafter, path: str, dtype: Optional[str] = None) -> None:
        save_drafter(drafter, path, dtype)

    def tap_layers(self, config, num_target_layers: int):
        return config.target_layer_ids

    def from_trained(self, config, params, vocab=None):
        return Drafter(config, params, draft_vocab=vocab)

    def decode_params(self, drafter):
        return drafter.decode_params

    def new_config(self, target_config, **options):
        return make_drafter_config(target_config, **options)

    def init_params(self, config, seed: int = 0):
        return init_drafter_params(config, seed=seed)

    def read_draft_vocab(self, path: str, target_config):
        """The draft vocabulary (int32 [K]) saved with the drafter in `path`, or None."""
        return _read_draft_vocab(path, read_drafter_config(path, target_config))

    def widen_taps(self, config, params, target_layer_ids, target_config):
        """(config, params) reading `target_layer_ids` (new fc rows at zero), checked against
        the target."""
        config, params = widen_taps(config, params, target_layer_ids)
        validate_pair(config, target_config)
        return config, params

    def upgrade(self, config, params, seed: int = 0, **dflash2_fields):
        """(config, params) of the drafter continued as DFlash 2 (`upgrade_to_dflash2`)."""
        return upgrade_to_dflash2(config, params, seed=seed, **dflash2_fields)

    def logits(self, config, logits):
        """The drafter's logit rule over the target head's logits (DFlash 2's scale, cap)."""
        return drafter_logits(config, logits)

    def module(self, config):
        return DFlashDrafter(config)

    def head_dim(self, config) -> int:
        return config.body.head_dim

    def abstract_params(self, config):
        return jax.eval_shape(lambda: init_drafter_params(config))

    def passes(self, config, block_size: int, denoise_steps: int = 1):
        return denoise_steps, None  # the target's LM head once per pass

    def variant(self, config, dflash2_fields=None, window=None, causal="default"):
        """`config` as DFlash 2 (with `dflash2_fields`: its convolutions and selector sizes)
        and / or with every layer sliding with `window`, `causal` inside the block ("default":
        bidirectional for DFlash, DFlash 2 the reference's default, causal)."""
        if dflash2_fields:
            config = config.replace(**dflash2_fields)
        if window:
            if causal == "default":
                causal = None if config.dflash2 else False
            config = config.replace(**sliding_layers(config.body.num_layers, window, causal))
        return config

    def __init__(self, v2: Optional["DFlash2Kind"] = None):
        self.v2 = v2  # the kind drafting for DFlash 2 configs (None: `DFLASH2`)

    def loop(self, config) -> base.DrafterKind:
        return (self.v2 or DFLASH2) if config.dflash2 else self

    # ---- the decode loop
    def init_context(self, dec, b, capacity):
        cfg = dec.dmod.cfg
        ctx = KVCache.create(cfg, b, cfg.context_capacity(capacity))
        # Split by sequence where the mesh cannot split its heads; a ring (sliding) is not.
        return ctx.replace(seq_split=cfg.context_window is None)

    def draft_vocab(self, dec):
        """A DFlash drafter's draft vocabulary (int32 [K]) when its parameters carry one."""
        d = dec.dparams
        return d.get("draft_vocab") if isinstance(d, dict) else None

    def dvars(self, dec):
        """The DFlash drafter's variables for `dmod.apply` (its parameters, without the draft
        vocabulary)."""
        d = dec.dparams
        if isinstance(d, dict) and "draft_vocab" in d:
            d = {k: v for k, v in d.items() if k != "draft_vocab"}
        return {"params": d}

    def write_context(self, dec, ctx: KVCache, taps, ids, positions, lengths, starts=None):
        """Projects taps [B,T,F] to per-layer context K/V and stores them at `positions`; with
        `starts` [B] (positions = starts[b] + arange(T)) through `attention.write_block` (the
        Pallas DMA kernel under a TPU Pallas attention implementation)."""
        ck, cv = dec.dmod.apply(self.dvars(dec), taps, positions, method=DFlashDrafter.context_kv)
        if dec.dmod.cfg.context_window is not None:
            # A ring (every layer slides): position j in slot j % slots, written only when it
            # is among the last `slots` committed positions (so no write lands on a slot that a
            # later position of the same write, or a position still in the window, holds).
            slots = ctx.capacity
            keep = (positions < lengths[:, None]) & (positions >= lengths[:, None] - slots)
            ring = jnp.where(keep, jnp.mod(positions, slots), slots)  # `slots`: dropped
            write = lambda old, new: write_kv(old, flat_heads(new), ring)
        elif starts is None:
            write = lambda old, new: write_kv(old, flat_heads(new), positions)
        else:
            write = lambda old, new: attn_lib.write_block(
                old, flat_heads(new), starts, dec.plan.attention_impl, ctx.head_dim,
                seq_split=ctx.seq_split,
            )  # fmt: skip
        k = tuple(write(old, new) for old, new in zip(ctx.k, ck))
        v = tuple(write(old, new) for old, new in zip(ctx.v, cv))
        return ctx.replace(k=k, v=v, lengths=lengths)

    def draft_logits(self, dec, ctx: KVCache, x_last, tokens, start, with_hidden: bool = False):
        """One drafter pass over [x_last, tokens] (tokens [B, bs-1]: MASK where not yet drafted) at
        positions start + arange(bs): the logits [B, bs-1, V] of the block positions after x_last
        (as the drafter scores them: DFlash 2's scaled and capped), with their hidden states
        [B, bs-1, H] when `with_hidden`."""
        positions = start[:, None] + jnp.arange(dec.plan.block_size, dtype=jnp.int32)[None]
        attend = decode_attend(ctx.lengths, dec.plan.attention_impl, ctx.seq_split)
        block = jnp.concatenate([x_last[:, None], tokens], axis=1)
        hidden = dec.dmod.apply(self.dvars(dec), dec.embed(block), positions, ctx.k, ctx.v, attend)
        vocab = self.draft_vocab(dec)
        if vocab is None:
            logits = drafter_logits(dec.dmod.cfg, dec.lm_logits(hidden[:, 1:]))
        else:  # the head's draft-vocabulary rows only, -inf elsewhere (`drafters.draft_vocab`)
            logits = drafter_logits(
                dec.dmod.cfg,
                dec.tmod.apply({"params": dec.tparams}, hidden[:, 1:], vocab, method="logits"),
            )
            logits = full_logits(logits, vocab, dec.tmod.cfg.vocab_size)
        return (logits, hidden[:, 1:]) if with_hidden else logits

    def select_block(self, dec, ctx: KVCache, x_last, start, key=None):
        """DFlash 2: one drafter pass, then the candidate selector's walk over the bs-1 slots
        from x_last: greedy at temperature 0 or without a key, sampled from
        softmax(scores / T) over each slot's candidates at T > 0. Returns (drafts [B, bs-1], confidence [B, bs-1]: the
        drafter's probability of each draft, candidates [B, bs-1, K], q [B, bs-1, K]: each
        slot's proposal distribution given the drafts before it)."""
        b = x_last.shape[0]
        masks = jnp.full((b, dec.plan.block_size - 1), dec.dmod.cfg.mask_token_id, jnp.int32)
        logits, hidden = self.draft_logits(dec, ctx, x_last, masks, start, with_hidden=True)
        tokens, cand, q = dec.dmod.apply(
            self.dvars(dec),
            hidden,
            logits,
            x_last,
            dec.plan.temperature if key is not None else 0.0,  # no key: the greedy walk
            key,
            method=DFlashDrafter.select,
        )
        p = jax.nn.softmax(logits, axis=-1)
        return tokens, jnp.take_along_axis(p, tokens[..., None], axis=-1)[..., 0], cand, q

    def sample_block(self, dec, ctx: KVCache, x_last, start, key):
        """DFlash at T > 0 with draft_sampling "sample" (the reference's rule): one drafter
        pass, each of the bs-1 drafts sampled from q, the drafter's distribution under the
        plan's temperature, top-k and top-p (`sampling.adjusted_logits`, as the target's
        samples are adjusted). The drafts of one pass are independent given the context, so q
        at a slot is also its distribution given the drafts before it. Returns (drafts
        [B, bs-1], confidence [B, bs-1]: the drafter's unadjusted probability of each draft,
        q [B, bs-1, V])."""
        b = x_last.shape[0]
        masks = jnp.full((b, dec.plan.block_size - 1), dec.dmod.cfg.mask_token_id, jnp.int32)
        logits = self.draft_logits(dec, ctx, x_last, masks, start)
        plan = dec.plan
        adjusted = adjusted_logits(logits, plan.temperature, plan.top_k, plan.top_p)
        drafts = sample_categorical(key, adjusted)
        p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        conf = jnp.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
        return drafts, conf, jax.nn.softmax(adjusted, axis=-1)

    def denoise(self, dec, ctx: KVCache, x_last, start, logp=False):
        """The K = `dec.plan.denoise_steps` drafter passes over one block: (drafts [B, bs-1],
        confidence [B, bs-1], log-probs [B, bs-1, V] or None).

        After pass j < K, n_j = round((bs-1) j / K) positions hold a drafted token (its MASK
        embedding replaced by the token's) and the rest stay MASK for the next pass; the last pass
        fills every position still masked. Which positions are fixed (`dec.plan.denoise_schedule`):
          "confidence": the n_j - n_{j-1} most confident (max probability) still-masked ones;
          "fixed": the first n_j, left to right (a fixed count per pass, whatever the confidence).
        `dec.plan.remask` ("confidence" only): after pass j < K the n_j kept are the most confident of
        all positions, the fixed tokens scored by the confidence they were drafted with and the
        masked ones by this pass's, so a fixed token that later predictions outrank is masked again
        and predicted again in a later pass (it never changes a committed token: only drafts).
        Each position's confidence and log-probs are those of the pass that drafted its final
        token (the last pass for the positions it fills): what a draft tree is built from.
        """
        bs = dec.plan.block_size
        b = x_last.shape[0]
        mask_id = jnp.int32(dec.dmod.cfg.mask_token_id)
        tokens = jnp.full((b, bs - 1), mask_id, jnp.int32)
        fixed = jnp.zeros((b, bs - 1), bool)
        conf = jnp.zeros((b, bs - 1), jnp.float32)
        out_lp = None
        steps = dec.plan.denoise_steps
        need_conf = steps > 1 or dec.plan.confidence_threshold is not None
        for j in range(1, steps + 1):
            logits = self.draft_logits(dec, ctx, x_last, tokens, start)
            pred = greedy_argmax(logits)
            lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1) if logp else None
            if lp is not None and need_conf:
                p_max = jnp.exp(jnp.max(lp, axis=-1))
            elif need_conf:
                p_max = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
            else:
                p_max = jnp.ones(pred.shape, jnp.float32)  # confidence unused: skip the softmax
            n_j = int(round((bs - 1) * j / steps))
            keep = None
            if j == steps:
                newly = ~fixed
            elif dec.plan.denoise_schedule == "fixed":
                newly = (jnp.arange(bs - 1)[None] < n_j) & ~fixed
            elif dec.plan.remask:
                score = jnp.where(fixed, conf, p_max)
                top = jax.lax.top_k(score, max(n_j, 1))[1]
                keep = jnp.zeros_like(fixed).at[jnp.arange(b)[:, None], top].set(n_j > 0)
                newly = keep & ~fixed
            else:
                m = n_j - int(round((bs - 1) * (j - 1) / steps))
                score = jnp.where(fixed, -jnp.inf, p_max)
                top = jax.lax.top_k(score, max(m, 1))[1]
                newly = jnp.zeros_like(fixed).at[jnp.arange(b)[:, None], top].set(m > 0)
            tokens = jnp.where(newly, pred, tokens)
            conf = jnp.where(newly, p_max, conf)
            if lp is not None:
                out_lp = lp if out_lp is None else jnp.where(newly[..., None], lp, out_lp)
            fixed = fixed | newly
            if keep is not None:  # remasked: back to MASK, predicted again by a later pass
                tokens = jnp.where(keep, tokens, mask_id)
                fixed = keep
        return tokens, conf, out_lp

    def draft_block(self, dec, ctx: KVCache, x_last, start):
        """Drafts bs-1 tokens after x_last. Returns (drafts [B, bs-1], confidence [B, bs-1]).

        denoise_steps = 1: DFlash's single pass. K > 1: K masked-diffusion passes (`denoise`: the
        positions fixed after each pass by confidence or left to right, optionally remasked).
        DFlash 2: its single pass and candidate selector (`select_block`).
        """
        if dec.dmod.cfg.dflash2:
            return self.select_block(dec, ctx, x_last, start)[:2]
        tokens, conf, _ = self.denoise(dec, ctx, x_last, start)
        return tokens, conf

    def draft_logprobs(self, dec, ctx: KVCache, x_last, start):
        """The drafter's log-probabilities [B, bs-1, V] at the block positions after x_last: what a
        draft tree is built from. One pass over [x_last, MASK * (bs-1)], or with denoise_steps K > 1
        the K passes of `denoise`, each position's log-probs from the pass that drafted it (the
        last pass for the positions still masked before it)."""
        if dec.plan.denoise_steps == 1:
            masks = jnp.full(
                (x_last.shape[0], dec.plan.block_size - 1), dec.dmod.cfg.mask_token_id, jnp.int32
            )
            logits = self.draft_logits(dec, ctx, x_last, masks, start)
            return jax.nn.log_softmax(logits, axis=-1)
        return self.denoise(dec, ctx, x_last, start, logp=True)[2]

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
        distribution q over the vocabulary (`sample_block`; q_ids None)."""
        if self.samples_drafts(dec):
            drafts, conf, q = self.sample_block(dec, ctx, x_last, start, key)
            return drafts, conf, None, q
        drafts, conf = self.draft_block(dec, ctx, x_last, start)
        return drafts, conf, None, None

    def propose(self, dec, state, x_last, start, key=None):
        if dec.plan.tree_budget:
            logp = self.draft_logprobs(dec, state.ctx, x_last, start)
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

    def loop(self, config) -> base.DrafterKind:
        return self

    def samples_drafts(self, dec) -> bool:
        return dec.plan.temperature > 0 and base.draft_sampling(dec) == "sample"

    def chain(self, dec, ctx, x_last, start, key):
        if not self.samples_drafts(dec):
            drafts, conf = self.draft_block(dec, ctx, x_last, start)
            return drafts, conf, None, None
        return self.select_block(dec, ctx, x_last, start, key)


KIND, DFLASH2 = DFlashKind(), DFlash2Kind()
