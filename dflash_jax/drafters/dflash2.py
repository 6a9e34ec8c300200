"""DFlash 2's additions to the DFlash drafter (facts: ../shared/docs/dflash.md, "DFlash 2"):

  convolution  every layer wraps attention and the MLP in a grouped dynamic causal convolution
               over the block: per channel c of group g = c // group_size and tap offset o,
                 out[t, c] = sum_o (base[o, c] + dynamic[t, o, g]) * x[t - o, c]
               (x[t - o] = 0 before the block's first position); `kernel_projection` of the
               sublayer's normed input gives two sets of dynamic taps [2, taps, groups]: the
               first (with base_kernel[0]) convolves that input, the second (with
               base_kernel[1]) the sublayer's output.
  logits       LM head x output_multiplier, then cap * tanh(logits / cap).
  selector     per drafted slot the top-K logits are the candidates; a candidate c after the
               previous token p scores  logit[c] + sum_r pred[p, r] * proj(h)[r] * succ[c, r];
               the slots are walked left to right from the anchor (x_last): argmax at T = 0,
               a sample of softmax(scores / T) over the K candidates at T > 0.

The parameters keep the published names: layers.i.{attention,mlp}_conv.{base_kernel,
kernel_projection.weight}, candidate_selector.{hidden_projection.weight, predecessor_codebook,
successor_codebook} (the codebooks without `.weight`).
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp


def causal_shift(x_BNLH, offset: int):
    """x shifted right by `offset` along the block axis (axis 2), zeros entering."""
    if offset == 0:
        return x_BNLH
    length = x_BNLH.shape[2]
    if offset >= length:
        return jnp.zeros_like(x_BNLH)
    pad = [(0, 0), (0, 0), (offset, 0), (0, 0)]
    return jnp.pad(x_BNLH[:, :, : length - offset], pad)


def grouped_causal_conv(x_BTH, dynamic_BTOG, base_OH, block_len: int):
    """out[t, c] = sum_o (base[o, c] + dynamic[t, o, c // group]) * x[t - o, c], separately in
    every block of `block_len` consecutive positions (T = N * block_len)."""
    b, t, h = x_BTH.shape
    taps, groups = dynamic_BTOG.shape[2:]
    n = t // block_len
    x = x_BTH.reshape(b, n, block_len, h)
    dyn = dynamic_BTOG.reshape(b, n, block_len, taps, groups)
    out = jnp.zeros(x.shape, jnp.float32)
    for o in range(taps):
        w = base_OH[o].astype(jnp.float32)[None, None, None] + jnp.repeat(
            dyn[:, :, :, o].astype(jnp.float32), h // groups, axis=-1
        )
        out = out + w * causal_shift(x, o).astype(jnp.float32)
    return out.reshape(b, t, h).astype(x_BTH.dtype)


class GroupedDynamicCausalConv(nn.Module):
    """The convolution around one sublayer: `prepare(x)` convolves the sublayer's input and
    returns the dynamic taps that `finish(y, taps)` applies to its output."""

    hidden_size: int
    kernel_size: int
    group_size: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        groups = self.hidden_size // self.group_size

        def identity(key, shape, dtype):  # a new layer starts as the identity (offset 0: 1)
            return jnp.zeros(shape, dtype).at[:, 0].set(1.0)

        self.base_kernel = self.param(
            "base_kernel", identity, (2, self.kernel_size, self.hidden_size), self.param_dtype
        )
        self.kernel_projection = nn.Dense(
            2 * self.kernel_size * groups,
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=nn.initializers.zeros,
        )

    def prepare(self, x_BTH, block_len: int):
        b, t, _ = x_BTH.shape
        groups = self.hidden_size // self.group_size
        dyn = self.kernel_projection(x_BTH).reshape(b, t, 2, self.kernel_size, groups)
        y = grouped_causal_conv(x_BTH, dyn[:, :, 0], self.base_kernel[0], block_len)
        return y, dyn[:, :, 1]

    def finish(self, y_BTH, dynamic_BTOG, block_len: int):
        return grouped_causal_conv(y_BTH, dynamic_BTOG, self.base_kernel[1], block_len)

    def __call__(self, x_BTH, block_len: int):  # used by init only
        y, dyn = self.prepare(x_BTH, block_len)
        return self.finish(y, dyn, block_len)


def adjust_logits(logits, output_multiplier: float, softcap: Optional[float]):
    """Logits x output_multiplier, soft-capped at `softcap` (None or <= 0: not capped)."""
    logits = logits.astype(jnp.float32)
    if output_multiplier != 1.0:
        logits = logits * output_multiplier
    if softcap is not None and softcap > 0:
        logits = softcap * jnp.tanh(logits / softcap)
    return logits


# Vocabulary blocks of the selector's top-K: a tensor-parallel LM head leaves the logits split
# over the vocabulary in contiguous shards, and a top-K per block (each inside one shard when
# the shard count divides this) followed by a top-K of the blocks' candidates gathers
# TOPK_BLOCKS x K values instead of the whole logits row.
TOPK_BLOCKS = 16


def blocked_top_k(x, k: int, blocks: int = TOPK_BLOCKS):
    """(values, ids) of the k largest entries of x [..., V], descending: the top-k of each of
    `blocks` contiguous vocabulary blocks, then the top-k of those (the same k entries as
    `lax.top_k`: each of them is among its block's k largest). One block when `blocks` does
    not divide V or a block would hold fewer than k entries."""
    v = x.shape[-1]
    if blocks <= 1 or v % blocks or v // blocks < k:
        return jax.lax.top_k(x, k)
    width = v // blocks
    vals, ids = jax.lax.top_k(x.reshape(x.shape[:-1] + (blocks, width)), k)
    ids = ids + (jnp.arange(blocks, dtype=ids.dtype) * width)[:, None]
    vals = vals.reshape(x.shape[:-1] + (blocks * k,))
    ids = ids.reshape(x.shape[:-1] + (blocks * k,))
    top, where = jax.lax.top_k(vals, k)
    return top, jnp.take_along_axis(ids, where, axis=-1)


class CandidateSelector(nn.Module):
    """The selector's parameters and its walk (`select`)."""

    hidden_size: int
    vocab_size: int
    rank: int
    top_k: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        init = nn.initializers.normal(0.02)
        self.hidden_projection = nn.Dense(
            self.rank, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype
        )
        shape = (self.vocab_size, self.rank)
        self.predecessor_codebook = self.param(
            "predecessor_codebook", init, shape, self.param_dtype
        )
        self.successor_codebook = self.param("successor_codebook", init, shape, self.param_dtype)

    def __call__(self, hidden_BTH):  # used by init only
        return self.hidden_projection(hidden_BTH)

    def select(self, hidden_BTH, logits_BTV, x_last_B, temperature: float = 0.0, key=None):
        """Walks the T slots from x_last (`walk`). Returns (tokens [B, T], candidates [B, T, K],
        q [B, T, K]: the probability of each candidate given the slot's chosen predecessor,
        one-hot on the argmax at temperature 0)."""
        unary, cand = blocked_top_k(logits_BTV.astype(jnp.float32), self.top_k)
        proj = self.hidden_projection(hidden_BTH).astype(jnp.float32)
        return walk(
            unary,
            cand,
            proj,
            self.predecessor_codebook,
            self.successor_codebook,
            x_last_B,
            temperature,
            key,
        )


def walk(unary_BTK, cand_BTK, proj_BTR, pred_VR, succ_VR, x_last_B, temperature, key):
    """The selector's left-to-right walk as a `lax.scan` over the T slots (K candidates a slot,
    never a vocabulary-wide op): slot t scores its candidates c by
    unary[c] + <pred[prev] * proj[t], succ[c]> and takes the argmax (temperature 0) or a sample
    of softmax(scores / temperature); prev starts at x_last."""
    b, t, k = unary_BTK.shape
    keys = (
        jnp.zeros((t, 2), jnp.uint32)
        if key is None or temperature <= 0
        else jax.random.split(key, t)
    )
    succ = jnp.take(succ_VR, cand_BTK, axis=0).astype(jnp.float32)  # [B, T, K, R]

    def slot(prev, xs):
        un, cd, pj, sc, sk = xs  # [B,K], [B,K], [B,R], [B,K,R], key
        ctx = jnp.take(pred_VR, prev, axis=0).astype(jnp.float32) * pj  # [B, R]
        scores = un + jnp.einsum("br,bkr->bk", ctx, sc)
        if temperature > 0:
            q = jax.nn.softmax(scores / temperature, axis=-1)
            idx = jax.random.categorical(sk, scores / temperature, axis=-1)
        else:
            idx = jnp.argmax(scores, axis=-1)
            q = jax.nn.one_hot(idx, k, dtype=jnp.float32)
        tok = jnp.take_along_axis(cd, idx[:, None], axis=1)[:, 0]
        return tok, (tok, q)

    xs = (
        jnp.moveaxis(unary_BTK, 1, 0),
        jnp.moveaxis(cand_BTK, 1, 0),
        jnp.moveaxis(proj_BTR, 1, 0),
        jnp.moveaxis(succ, 1, 0),
        keys,
    )
    _, (toks, qs) = jax.lax.scan(slot, x_last_B.astype(jnp.int32), xs)
    return jnp.moveaxis(toks, 0, 1), cand_BTK, jnp.moveaxis(qs, 0, 1)
