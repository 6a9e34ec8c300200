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

The package, one role a module: `config` (`Eagle3Config`, the published config.json, the
tapped layers, the d2t offsets), `model` (the module, its cache and parameters), `files`
(`Eagle3`, load / save, the check against a target) and `kind` (`KIND`: the registry's EAGLE-3
kind, its drafting in the decode loop). Their names are re-exported here. Training-time test
lives with the trainer (`training/eagle3_ttt.py`); the public sources the layout was checked
against: docs/eagle3.md.
"""

from dflash_jax.drafters.eagle3.config import (  # noqa: F401
    ARCHITECTURES,
    NUM_TAPS,
    DEFAULT_BLOCK_SIZE,
    INITIALIZER_RANGE,
    D2T,
    T2D,
    EMBED,
    default_eagle3_taps,
    Eagle3Config,
    make_eagle3_config,
    draft_to_target_ids,
    t2d_mask,
    full_vocab_logits,
    check_d2t,
)
from dflash_jax.drafters.eagle3.model import (  # noqa: F401
    LMHead,
    Eagle3Layer,
    Eagle3Drafter,
    create_cache,
    write_step_kv,
    init_eagle3_params,
)
from dflash_jax.drafters.eagle3.files import (  # noqa: F401
    Eagle3,
    validate_eagle3_pair,
    load_eagle3,
    _read_vocab,
    save_eagle3,
    is_eagle3_dir,
)
from dflash_jax.drafters.eagle3.kind import (  # noqa: F401
    Eagle3Context,
    Eagle3Kind,
    KIND,
)
