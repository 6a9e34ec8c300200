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

The package, one role a module: `config` (DrafterConfig and its z-lab / Hugging Face
conversion, `make_drafter_config`, `validate_pair`), `model` (the module, its logit rule and
parameters), `files` (`Drafter`, read / load / save) and `kind` (`KIND`: the registry's DFlash
kind, its drafting in the decode loop). Their names are re-exported here.
"""

from dflash_jax.drafters.dflash.config import (  # noqa: F401
    default_target_layer_ids,
    LAYER_TYPES,
    DFLASH2_FIELDS,
    SCALAR_DEFAULTS,
    DEFAULT_BLOCK_SIZE,
    INITIALIZER_RANGE,
    DrafterConfig,
    make_drafter_config,
    sliding_layers,
    validate_pair,
)
from dflash_jax.drafters.dflash.model import (  # noqa: F401
    ContextCache,
    AttendFn,
    DrafterLayer,
    DFlashDrafter,
    drafter_logits,
    decode_attend,
    init_drafter_params,
    widen_taps,
    upgrade_to_dflash2,
    silence_selector,
)
from dflash_jax.drafters.dflash.files import (  # noqa: F401
    Drafter,
    read_drafter_config,
    load_drafter,
    _read_draft_vocab,
    save_drafter,
)
from dflash_jax.drafters.dflash.kind import (  # noqa: F401
    DFlashKind,
    DFlash2Kind,
    KIND,
    DFLASH2,
)
