"""The drafter that losslessness tests use, and the check that it was accepted.

The bundled trained pair (assets/tiny-code) on code prompts: 40 new tokens give tau ~1.8-2.0 at
blocks 8 and 16 with steps committing 4-6 tokens, so "DFlash == autoregressive" exercises the
multi-token commits, their cache writes and roll-backs. A never-accepted drafter commits only
the target's own token per step and passes any such test. The prompts are ragged on purpose (9,
26, 25 and 7 tokens). The fixture is `bundled_pair` in conftest.py.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = os.path.join(ROOT, "assets", "tiny-code")
CODE = (
    "def add(a, b):\n    return",
    'import os\n\n\ndef read_lines(path):\n    """Return the list of lines in the file at *path*."""',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "for i in range(10):",
)


def assert_accepted(result, block_size, min_tau=1.5):
    """The drafter of a losslessness check really was accepted: mean acceptance above `min_tau`
    and some step committing at least min(3, block_size) tokens (several drafts accepted)."""
    assert result.tau > min_tau, result.tau
    longest = max(max(a) for a in result.acceptance_lengths if a)
    assert longest >= min(3, block_size), result.acceptance_lengths


def moe_from_dense(target, num_experts=4, top_k=2, noise=0.2, mlp_only_layers=(2,), seed=0):
    """A Qwen3-MoE Target made from a dense one (the bundled target): each MoE layer's experts
    are copies of its MLP with every weight scaled by (1 + noise * N(0, 1)), its router random,
    the top-k weights normalised (so the block is close to, not equal to, the dense MLP), the
    layers in `mlp_only_layers` left dense. Another model, which the bundled drafter still
    predicts well: DFlash over it is accepted."""
    import dflash_jax as dj
    import jax.numpy as jnp
    import numpy as np

    cfg = target.config.replace(
        arch="qwen3_moe",
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=target.config.intermediate_size,
        norm_topk_prob=True,
        mlp_only_layers=tuple(mlp_only_layers),
    )
    rs = np.random.RandomState(seed)
    params = dict(target.params)

    def stack(w):
        w = np.asarray(w)
        copies = [
            w * (1 + noise * rs.randn(*w.shape)).astype(np.float32) for _ in range(num_experts)
        ]
        return jnp.asarray(np.stack(copies))

    for i in range(cfg.num_layers):
        if cfg.layer_is_moe(i):
            mlp = target.params[f"layers_{i}"]["mlp"]
            router = rs.randn(cfg.hidden_size, num_experts).astype(np.float32)
            # Every expert kernel [E, I, H] (`moe.SparseMoE`): gate / up as [out, in].
            experts = {
                k: {"kernel": stack(mlp[k]["kernel"])}
                for k in ("gate_proj", "up_proj", "down_proj")
            }
            for k in ("gate_proj", "up_proj"):
                experts[k]["kernel"] = jnp.swapaxes(experts[k]["kernel"], 1, 2)
            params[f"layers_{i}"] = {
                **params[f"layers_{i}"],
                "mlp": {"gate": {"kernel": jnp.asarray(router)}, "experts": experts},
            }
    return dj.Target(cfg, params)


def as_kind_method(fn):
    """A drafter kind's method (kind, dec, *args) from a function of the models and the plan
    around the same args, (tmod, tparams, dmod, dparams, *args, plan): how the oracle drafters
    replace `DFlashKind.draft_block`, `draft_logprobs` or `draft_logits` in a test."""
    return lambda kind, dec, *a: fn(dec.tmod, dec.tparams, dec.dmod, dec.dparams, *a, dec.plan)


def oracle_kinds(**methods):
    """(DFlash, DFlash 2) kinds with `methods` (name -> (kind, dec, *args) -> ...) in place of
    theirs: an oracle pass that drafts through `registry.using` (or `use_oracle`)."""
    from dflash_jax.drafters.dflash import DFlash2Kind, DFlashKind

    v2 = type("OracleDFlash2", (DFlash2Kind,), dict(methods))()
    return type("OracleDFlash", (DFlashKind,), dict(methods))(v2), v2


def use_oracle(monkeypatch, **methods):
    """For the rest of the test, DFlash drafters draft through `oracle_kinds(**methods)` (the
    registry's overrides, as `registry.using` puts them)."""
    from dflash_jax.drafters import registry

    monkeypatch.setattr(registry, "OVERRIDES", oracle_kinds(**methods) + registry.OVERRIDES)
