"""The trainer reads and checks a run's settings once: `check_run` (the preflight) returns the
mesh it resolved and checked, and the setup builds on it without checking any of it again."""

import math

import jax
import pytest

from configs import tiny_test
from dflash_jax.parallel import sharding
from dflash_jax.training import preflight, trainer


def _config(**kw):
    """tiny_test on synthetic documents (no regeneration): 2 steps, nothing evaluated or
    exported."""
    c = tiny_test.get_config()
    c.data.update(kind="synthetic", num_docs=64, doc_len=40, seq_len=64, batch_size=8)
    c.update(dict(num_train_steps=2, log_every=1, eval_every=0, checkpoint_every=100))
    c.update(dict(export=False, async_checkpoint=False, **kw))
    return c


def test_the_preflight_returns_the_mesh_it_resolved(tmp_path, monkeypatch):
    """The devices are the one CPU device counted 8 times: the preflight only counts them. An
    expert axis over the tiny (dense) target passes only where its experts are not known before
    it loads (as for a hub id): then `num_experts` is None and the setup checks the axis."""
    monkeypatch.setattr(preflight, "_mesh_devices", lambda spec: jax.devices()[:1] * 8)
    experts = preflight._target_num_experts
    monkeypatch.setattr(
        preflight, "_target_num_experts", lambda c: None if "expert" in c.mesh else experts(c)
    )
    wd = str(tmp_path / "w")
    for spec, accum, axes, sizes in (
        ("", 1, dict(data=-1, fsdp=1, tensor=1), dict(data=8, fsdp=1, tensor=1)),
        ("data=2,fsdp=-1", 1, dict(data=2, fsdp=-1, tensor=1), dict(data=2, fsdp=4, tensor=1)),
        ("fsdp=2,tensor=2", 2, dict(data=1, fsdp=2, tensor=2), dict(data=1, fsdp=2, tensor=2)),
        (
            "data=2,expert=-1",
            1,
            dict(data=2, fsdp=1, tensor=1, expert=-1),
            dict(data=2, fsdp=1, tensor=1, expert=4),
        ),
    ):
        cfg = _config(mesh=spec, grad_accum_steps=accum)
        got = trainer.check_run(cfg, wd)
        assert got.accum == accum == trainer.preflight(cfg, wd)
        plan = got.mesh
        assert plan.spec == spec and dict(plan.axes) == axes and dict(plan.sizes) == sizes
        assert len(plan.devices) == math.prod(sizes.values())
        assert plan.n_batch == sizes["data"] * sizes["fsdp"]
        assert plan.num_experts == (None if "expert" in spec else 0)  # a fresh target: dense
    only = tiny_test.get_config()
    only.regen.only = True
    assert trainer.check_run(only, wd) == trainer.Preflight(accum=1, mesh=None)  # no training
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("how", ("experts read", "experts unknown", "checked given"))
def test_setup_runs_none_of_the_preflight_checks_again(tmp_path, monkeypatch, how):
    """One small run: the mesh spec is parsed once, the expert axis checked once (by the
    preflight where it reads the target's experts, else by the setup once the target loaded)
    and grad_accum_steps checked by the preflight only (against the batch, then against the
    mesh's batch shards). Old setups parsed the mesh and checked both again."""
    calls = []  # (name, in the setup, args)
    in_setup = [False]

    def spy(name, fn):
        def wrapped(*a, **kw):
            calls.append((name, in_setup[0], a))
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(sharding, "parse_mesh", spy("parse_mesh", sharding.parse_mesh))
    monkeypatch.setattr(
        sharding, "check_expert_axis", spy("check_expert_axis", sharding.check_expert_axis)
    )
    monkeypatch.setattr(
        preflight, "check_grad_accum", spy("check_grad_accum", preflight.check_grad_accum)
    )
    setup = trainer._setup

    def watched_setup(*a, **kw):
        in_setup[0] = True
        try:
            return setup(*a, **kw)
        finally:
            in_setup[0] = False

    monkeypatch.setattr(trainer, "_setup", watched_setup)
    if how == "experts unknown":  # as for a target given by hub id
        monkeypatch.setattr(preflight, "_target_num_experts", lambda config: None)
    cfg, wd = _config(grad_accum_steps=2), str(tmp_path / "w")
    checked = trainer.check_run(cfg, wd) if how == "checked given" else None
    out = trainer.train_and_evaluate(cfg, wd, checked)
    assert out["status"] == "done" and out["step"] == 2
    want = [
        ("check_grad_accum", False, (8, 2)),
        ("parse_mesh", False, ("data=-1",)),
        ("check_expert_axis", False, (1, 0)),
        ("check_grad_accum", False, (8, 2, 1)),
    ]
    if how == "experts unknown":
        del want[2]
        want.append(("check_expert_axis", True, (1, 0)))  # the setup, once loaded
    assert calls == want
