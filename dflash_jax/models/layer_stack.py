"""The stacked layout of a target's decoder layers (MaxText's `scan_layers`).

Checkpoints, the GGUF reader and the loaders name each layer's parameters `layers_{i}/...`
(the Hugging Face `model.layers.i....` tensors). A config with `scans_layers` runs its layers
as one `lax.scan` over the same parameters stacked on a leading layer axis under the single key
`layers`:

  looped:   layers_0/self_attn/q_proj/kernel [H, N*D], ..., layers_{L-1}/...
  stacked:  layers/self_attn/q_proj/kernel   [L, H, N*D]

so a program traces, lowers and compiles one layer body whatever the depth. A hybrid target
whose layers repeat a pattern of `period` layers (Qwen3.5 / 3.6: three Gated DeltaNet layers
and one attention layer, `ModelConfig.layer_period`) stacks each slot of the pattern over the
groups and scans one group:

  grouped:  layers/slot_{j}/...                 [G, ...]   layer g * period + j

The layouts hold the same numbers; `stack_layers` and `unstack_layers` convert (bit for bit,
on host or device arrays), and the loaders and savers call them, so files keep their
per-layer names. The KV cache is stacked the same way: k, v [L, B, S, K*D]
(`transformer.KVCache`); a hybrid target's per kind, in layer order (`hybrid.HybridCache`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

STACKED = "layers"


def layer_key(i: int) -> str:
    return f"layers_{i}"


def is_stacked(params) -> bool:
    return isinstance(params, dict) and STACKED in params


def slot_key(j: int) -> str:
    return f"slot_{j}"


def _stack(*leaves):
    if all(isinstance(x, np.ndarray) for x in leaves):
        return np.stack(leaves)
    return jnp.stack(leaves)


def stack_layers(params: dict, num_layers: int, period: int = 1) -> dict:
    """`layers_0 .. layers_{L-1}` -> one `layers` subtree with a leading axis on every leaf
    (NumPy leaves stay NumPy: a checkpoint is stacked on host before it is placed): [L, ...]
    for `period` 1, else `layers/slot_{j}` [L / period, ...] holding layers j, j + period, ....
    The layers stacked together must share one structure and shapes: a ValueError names the
    first that does not."""
    if is_stacked(params):
        return params
    if period < 1 or num_layers % period:
        raise ValueError(f"stack_layers: {num_layers} layers do not split in groups of {period}")
    keys = [layer_key(i) for i in range(num_layers)]
    missing = [k for k in keys if k not in params]
    if missing:
        raise ValueError(f"stack_layers: no parameters for {missing[0]} (of {num_layers} layers)")

    def group(members):
        first = jax.tree_util.tree_structure(params[members[0]])
        shapes = [np.shape(x) for x in jax.tree_util.tree_leaves(params[members[0]])]
        for k in members[1:]:
            if jax.tree_util.tree_structure(params[k]) != first or shapes != [
                np.shape(x) for x in jax.tree_util.tree_leaves(params[k])
            ]:
                raise ValueError(
                    f"stack_layers: {k} differs in parameters or shapes from {members[0]}; a "
                    "stacked group needs identical layers"
                )
        return jax.tree_util.tree_map(_stack, *[params[k] for k in members])

    out = {k: v for k, v in params.items() if k not in keys}
    if period == 1:
        out[STACKED] = group(keys)
    else:
        out[STACKED] = {slot_key(j): group(keys[j::period]) for j in range(period)}
    return out


def stacked_period(stacked: dict) -> int:
    """The period of a `layers` subtree: the number of its `slot_{j}` keys, 1 when it is one
    layer's parameters stacked."""
    slots = [k for k in stacked if k.startswith("slot_")]
    return len(slots) if slots and len(slots) == len(stacked) else 1


def unstack_layers(params: dict) -> dict:
    """The inverse of `stack_layers`: `layers` -> `layers_0 .. layers_{L-1}`."""
    if not is_stacked(params):
        return params
    stacked = params[STACKED]
    period = stacked_period(stacked)
    slots = [stacked] if period == 1 else [stacked[slot_key(j)] for j in range(period)]
    groups = jax.tree_util.tree_leaves(slots[0])[0].shape[0]
    out = {k: v for k, v in params.items() if k != STACKED}
    for g in range(groups):
        for j, slot in enumerate(slots):
            out[layer_key(g * period + j)] = jax.tree_util.tree_map(lambda x, g=g: x[g], slot)
    return out


def to_layout(params: dict, cfg) -> dict:
    """`params` in the layout `cfg` runs: stacked when `cfg.scans_layers`, else looped."""
    if cfg.scans_layers:
        return stack_layers(params, cfg.num_layers, cfg.layer_period)
    return unstack_layers(params)
