"""A drafter kind from outside the library, plugged in by one registry line
(tests/test_drafter_registry.py): it drafts from a table of known continuations (its
"parameters": the target's own greedy output per sequence), every third step with one draft
changed, so that steps accept all, some and none of the block."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafters import base


@dataclasses.dataclass(frozen=True)
class OracleConfig:
    block_size: int = 4


@dataclasses.dataclass(frozen=True)
class OracleModule:  # the decode programs' handle (hashable: part of their jit key)
    cfg: OracleConfig


@dataclasses.dataclass(eq=False)
class Oracle:
    config: OracleConfig
    params: np.ndarray  # [B, R] the continuation of each sequence, from its first new token
    path: None = None

    @property
    def module(self) -> OracleModule:
        return OracleModule(self.config)


SPEC = "oracle"


class OracleKind(base.DrafterKind):
    name = "oracle"
    config_type = (OracleConfig,)
    drafter_type = (Oracle,)
    module_type = (OracleModule,)
    reads_files = False

    def claims(self, spec) -> bool:
        return spec == SPEC

    def read_config(self, spec, target_config, dtype="float32"):
        return OracleConfig()

    def limits(self, config) -> base.Limits:
        return base.Limits(default_block_size=config.block_size, chain_only="the oracle")

    def new_config(self, target_config, block_size=4):
        return OracleConfig(block_size=block_size)

    def module(self, config):
        return OracleModule(config)

    def abstract_params(self, config):  # the dry run's table: one sequence, 64 tokens
        return jax.ShapeDtypeStruct((1, 64), jnp.int32)

    def decode_params(self, drafter):
        return jnp.asarray(drafter.params, jnp.int32)

    def propose(self, dec, state, x_last, start, key=None):
        table = dec.dparams
        k = dec.plan.block_size - 1
        index = state.num_out[:, None] + jnp.arange(k, dtype=jnp.int32)[None]
        drafts = jnp.take_along_axis(table, jnp.clip(index, 0, table.shape[1] - 1), axis=1)
        wrong = (drafts[:, 1] + 1) % dec.tmod.cfg.vocab_size
        drafts = drafts.at[:, 1].set(jnp.where(state.step % 3 == 2, wrong, drafts[:, 1]))
        return base.chain_proposal(x_last, drafts, jnp.ones(drafts.shape, jnp.float32))


KIND = OracleKind()
