"""The stacked layout of a target's decoder layers (MaxText's `scan_layers`).

Checkpoints, the GGUF reader and the loaders name each layer's parameters `layers_{i}/...`
(the Hugging Face `model.layers.i....` tensors). A config with `scans_layers` runs its layers
as one `lax.scan` over the same parameters stacked on a leading layer axis under the single key
`layers`:

  looped:   layers_0/self_attn/q_proj/kernel [H, N*D], ..., layers_{L-1}/...
  stacked:  layers/self_attn/q_proj/kernel   [L, H, N*D]

so a program traces, lowers and compiles one layer body whatever the depth. The two layouts
hold the same numbers; `stack_layers` and `unstack_layers` convert (bit for bit, on host or
device arrays), and the loaders and savers call them, so files keep their per-layer names.
Its KV cache is stacked the same way: k, v [L, B, S, K*D] (`transformer.KVCache`).
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


def stack_layers(params: dict, num_layers: int) -> dict:
    """`layers_0 .. layers_{L-1}` -> one `layers` subtree with a leading [L] axis on every
    leaf (NumPy leaves stay NumPy: a checkpoint is stacked on host before it is placed). The
    layers must share one structure and shapes: a ValueError names the first that does not."""
    if is_stacked(params):
        return params
    keys = [layer_key(i) for i in range(num_layers)]
    missing = [k for k in keys if k not in params]
    if missing:
        raise ValueError(f"stack_layers: no parameters for {missing[0]} (of {num_layers} layers)")
    first = jax.tree_util.tree_structure(params[keys[0]])
    shapes = [np.shape(x) for x in jax.tree_util.tree_leaves(params[keys[0]])]
    for k in keys[1:]:
        if jax.tree_util.tree_structure(params[k]) != first or shapes != [
            np.shape(x) for x in jax.tree_util.tree_leaves(params[k])
        ]:
            raise ValueError(
                f"stack_layers: {k} differs in parameters or shapes from {keys[0]}; a stacked "
                "group needs identical layers"
            )

    def stack(*leaves):
        if all(isinstance(x, np.ndarray) for x in leaves):
            return np.stack(leaves)
        return jnp.stack(leaves)

    out = {k: v for k, v in params.items() if k not in keys}
    out[STACKED] = jax.tree_util.tree_map(stack, *[params[k] for k in keys])
    return out


def unstack_layers(params: dict) -> dict:
    """The inverse of `stack_layers`: `layers` [L, ...] -> `layers_0 .. layers_{L-1}`."""
    if not is_stacked(params):
        return params
    stacked = params[STACKED]
    n = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    out = {k: v for k, v in params.items() if k != STACKED}
    for i in range(n):
        out[layer_key(i)] = jax.tree_util.tree_map(lambda x, i=i: x[i], stacked)
    return out


def to_layout(params: dict, cfg) -> dict:
    """`params` in the layout `cfg` runs: stacked when `cfg.scans_layers`, else looped."""
    if cfg.scans_layers:
        return stack_layers(params, cfg.num_layers)
    return unstack_layers(params)
