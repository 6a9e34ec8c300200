"""Data parallelism: one training step over 8 (fake CPU) devices equals the 1-device step.

JAX fixes its device count at start-up, so the check runs in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
assert len(jax.devices()) == 8, jax.devices()
from configs import tiny_test
from dflash_jax.training import trainer

cfg = tiny_test.get_config()
cfg.target_model.update(init_std=0.0, attn_out_scale=1.0)  # default init: moderate logits
cfg.data.update(kind="synthetic", num_docs=64, doc_len=40, seq_len=64, batch_size=8)
exp = trainer.build_experiment(cfg, WORKDIR)
opt, _ = trainer.make_optimizer(cfg, 10)
state0 = trainer.TrainState(step=jnp.zeros((), jnp.int32), params=exp.init_params,
                            opt_state=opt.init(exp.init_params), rng=jax.random.PRNGKey(0))
batches = [next(exp.train_iter) for _ in range(2)]
results = []
for devices in (jax.devices()[:1], jax.devices()):
    mesh = Mesh(np.asarray(devices), ("data",))
    step = trainer.make_train_step(exp.loss_fn, opt, mesh)
    state = jax.device_put(state0, NamedSharding(mesh, P()))
    losses = []
    for b in batches:
        b = jax.device_put(b, NamedSharding(mesh, P("data")))
        if len(devices) == 8:
            assert len(b["input_ids"].sharding.device_set) == 8
        state, m = step(state, exp.target_params, b)
        losses.append(float(m["loss"]))
    results.append((losses, jax.device_get(state.params)))
(l1, p1), (l8, p8) = results
print("losses", l1, l8)
# Float32 sums are ordered differently per shard: equal to ~1e-6 relative, not bitwise.
assert np.allclose(l1, l8, atol=0, rtol=1e-5), (l1, l8)
for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p8)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
print("OK")
"""


def _run_on_eight_devices(script: str, workdir, timeout: int):
    """Runs `script` (ROOT and WORKDIR defined) in a fresh 8-fake-device CPU process; it must
    print OK."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    code = f"ROOT = {ROOT!r}\nWORKDIR = {str(workdir)!r}\n" + script
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_eight_device_step_equals_one_device_step(tmp_path):
    _run_on_eight_devices(SCRIPT, tmp_path, 300)


FSDP_SCRIPT = r"""
import jax, numpy as np
assert len(jax.devices()) == 8, jax.devices()
from configs import tiny_test
import dflash_jax as dj
from dflash_jax.training import trainer


def config(mesh, **kw):
    cfg = tiny_test.get_config()
    cfg.data.update(kind="synthetic", num_docs=64, doc_len=40, seq_len=64, batch_size=8)
    cfg.update(num_train_steps=6, log_every=1, eval_every=6, eval_batches=1,
               eval_num_prompts=4, eval_max_new_tokens=8, checkpoint_every=3,
               async_checkpoint=False, mesh=mesh, **kw)
    return cfg


one = trainer.train_and_evaluate(config("data=1,fsdp=1,tensor=1"), WORKDIR + "/one")
fsdp = trainer.train_and_evaluate(config("data=2,fsdp=4"), WORKDIR + "/fsdp")
# Interrupted at step 3 and resumed from the sharded checkpoint.
trainer.train_and_evaluate(config("data=2,fsdp=4", stop_at_step=3), WORKDIR + "/resumed")
resumed = trainer.train_and_evaluate(config("data=2,fsdp=4"), WORKDIR + "/resumed")
l1, l8 = [l for _, l in one["losses"]], [l for _, l in fsdp["losses"]]
print("losses", l1, l8, resumed["losses"])
assert one["status"] == fsdp["status"] == resumed["status"] == "done"
assert np.allclose(l1, l8, atol=0, rtol=1e-5), (l1, l8)
assert [s for s, _ in resumed["losses"]] == [4, 5, 6]
assert np.allclose([l for _, l in resumed["losses"]], l8[3:], atol=0, rtol=1e-6)
assert "tau" in fsdp["eval"] and fsdp["eval"]["tau"] >= 1.0
# The layout really is sharded: AdamW moments and drafter weights split over fsdp.
exp = trainer.build_experiment(config("data=2,fsdp=4"), WORKDIR + "/fsdp")
opt, _ = trainer.make_optimizer(exp.config, 6)
state = trainer.TrainState(step=0, params=exp.init_params, opt_state=opt.init(exp.init_params),
                           rng=jax.random.PRNGKey(0))
mesh = dj.sharding.make_mesh(data=2, fsdp=4, tensor=1)
state_sh, frozen_sh, _ = trainer.train_shardings(mesh, "drafter", state, exp.frozen,
                                                 exp.target_cfg.head_dim,
                                                 exp.drafter_cfg.body.head_dim)
specs = [s.spec for s in jax.tree_util.tree_leaves(state_sh.params)]
assert any("fsdp" in str(s) for s in specs), specs
assert any("fsdp" in str(s.spec) for s in jax.tree_util.tree_leaves(frozen_sh))
# Same trained drafter either way.
d1 = dj.load_drafter(one["export"], target=exp.target_for(None))
d8 = dj.load_drafter(fsdp["export"], target=exp.target_for(None))
for a, b in zip(jax.tree_util.tree_leaves(d1.params), jax.tree_util.tree_leaves(d8.params)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
print("OK")
"""


def test_fsdp_training_equals_one_device_and_resumes_from_sharded_checkpoints(tmp_path):
    """train_and_evaluate on a data=2,fsdp=4 mesh (parameters, AdamW moments and frozen target
    sharded) gives the 1-device losses and drafter, evaluates tau with the sharded `generate`,
    and resumes exactly from its sharded checkpoint."""
    _run_on_eight_devices(FSDP_SCRIPT, tmp_path, 400)
