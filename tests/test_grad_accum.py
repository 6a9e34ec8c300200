"""Gradient accumulation (`grad_accum_steps`): one step over micro-batches is the full batch's.

The batch's loss mask is made uneven across rows (an empty row, a half row), so micro-batches
score different numbers of tokens: a plain mean of micro-batch losses would then differ from the
full-batch loss, and only the weighting by each micro-batch's share of the weights matches it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dflash_jax.training import losses
from dflash_jax.training.step import (
    TrainState,
    check_grad_accum,
    make_optimizer,
    make_train_step,
    train_shardings,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from configs import tiny_test
    from dflash_jax.training import experiment

    c = tiny_test.get_config()
    c.data.update(kind="synthetic", num_docs=40, doc_len=40, batch_size=8)
    c.eval_num_prompts = 1
    c.warmup_ratio = 0.0
    exp = experiment.build_experiment(c, str(tmp_path_factory.mktemp("accum")))
    batch = {
        k: np.asarray(next(exp.train_iter)[k]) for k in ("input_ids", "loss_mask", "segment_ids")
    }
    lm = batch["loss_mask"].astype(np.float32)
    lm[0] = 0.0  # a row with nothing to score
    lm[1, lm.shape[1] // 2 :] = 0.0  # a half row
    lm[5, : lm.shape[1] // 4] = 0.0
    batch["loss_mask"] = lm
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    return c, exp, batch


def _state(params, optimizer, seed=0):
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.PRNGKey(seed),
    )


def _run(loss_fn, optimizer, params, frozen, batch, accum, steps=1, mesh=None, sh=None):
    step = make_train_step(loss_fn, optimizer, mesh, sh, grad_accum_steps=accum)
    state = _state(params, optimizer)
    for _ in range(steps):
        state, metrics = step(state, frozen, batch)
    return jax.device_get(state.params), jax.device_get(metrics)


def _assert_trees_close(a, b, rtol, atol):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def sgd_runs(setup):
    """SGD with learning rate 1: the new parameters are params - grad, so they expose the
    gradient itself. accum -> (params, metrics)."""
    _, exp, batch = setup
    return {
        a: _run(exp.loss_fn, optax.sgd(1.0), exp.init_params, exp.frozen, batch, a)
        for a in (1, 2, 4)
    }


@pytest.mark.parametrize("accum", (2, 4))
def test_accumulated_gradient_and_metrics_equal_the_full_batch(setup, sgd_runs, accum):
    _, exp, _ = setup
    full_p, full_m = sgd_runs[1]
    p, m = sgd_runs[accum]
    moved = jax.tree_util.tree_map(
        lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), full_p, exp.init_params
    )
    assert max(jax.tree_util.tree_leaves(moved)) > 1e-3  # the step did move the parameters
    _assert_trees_close(p, full_p, rtol=1e-5, atol=1e-6)
    assert set(m) == set(full_m)
    for k in full_m:
        np.testing.assert_allclose(m[k], full_m[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert full_m["weight_sum"] > 0 and full_m["num_blocks"] > 0


def test_micro_batches_score_unequal_shares_so_a_plain_mean_would_be_wrong(setup, sgd_runs):
    """The property the weighting exists for: on this batch the mean of the micro-batch losses
    is not the full-batch loss (the accumulated one is, by the test above)."""
    _, exp, batch = setup
    key = jax.random.fold_in(jax.random.PRNGKey(0), 0)
    keys = losses.row_keys(key, 8)
    loss_fn = jax.jit(exp.loss_fn)
    parts = []
    for i in range(4):  # micro-batch i: rows i, i + 4 (make_train_step's split)
        rows = np.arange(i, 8, 4)
        micro = {k: v[rows] for k, v in batch.items()}
        loss, m = loss_fn(exp.init_params, exp.frozen, micro, keys[rows])
        parts.append((float(loss), float(m["weight_sum"])))
    full = float(sgd_runs[1][1]["loss"])
    weighted = sum(l * w for l, w in parts) / sum(w for _, w in parts)
    assert len({w for _, w in parts}) > 1  # unequal shares
    np.testing.assert_allclose(weighted, full, rtol=1e-5)
    assert abs(np.mean([l for l, _ in parts]) - full) > 1e-3


def test_donated_adamw_steps_with_accumulation_equal_the_full_batch(setup):
    """Two real optimizer steps (AdamW, clipping, schedule; step 0 is warmup at lr 0) of the
    step the trainer runs (donate=True): the compiled step aliases the new state to the donated
    one (parameters and AdamW moments reuse the input buffers) with the micro-batch scan
    inside, and gives the full batch's parameters and metrics."""
    c, exp, batch = setup
    opt, _ = make_optimizer(c, 10)
    full = _run(exp.loss_fn, opt, exp.init_params, exp.frozen, batch, 1, steps=2)
    fresh = jax.tree_util.tree_map(jnp.copy, exp.init_params)  # donated below, not the fixture's
    state = _state(fresh, opt)
    compiled = (
        make_train_step(exp.loss_fn, opt, donate=True, grad_accum_steps=2)
        .lower(state, exp.frozen, batch)
        .compile()
    )
    nbytes = lambda t: sum(x.nbytes for x in jax.tree_util.tree_leaves(t) if hasattr(x, "nbytes"))
    state_bytes = nbytes(state.params) + nbytes(state.opt_state)
    assert compiled.memory_analysis().alias_size_in_bytes >= 0.99 * state_bytes > 0
    assert "while" in compiled.as_text()  # the micro-batch scan
    for _ in range(2):
        state, metrics = compiled(state, exp.frozen, batch)
    leaf = jax.tree_util.tree_leaves(fresh)[0]
    assert leaf.is_deleted()  # its buffer went to the new state
    _assert_trees_close(jax.device_get(state.params), full[0], rtol=1e-5, atol=2e-6)
    metrics = jax.device_get(metrics)
    for k in full[1]:
        np.testing.assert_allclose(metrics[k], full[1][k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_target_mode_loss_accumulates_on_a_sharded_mesh(setup):
    """The target's next-token loss (target mode's step), laid out by `train_shardings` on a
    mesh (the sharding constraints of the accumulating step are traced)."""
    from dflash_jax.parallel import sharding

    _, exp, batch = setup
    loss_fn = lambda p, f, b, k: losses.target_loss(exp.tmod, p, b)
    opt = optax.sgd(1.0)
    mesh = sharding.make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
    state = _state(exp.target_params, opt)
    sh = train_shardings(mesh, "target", state, None, exp.target_cfg.head_dim)
    full = _run(loss_fn, opt, exp.target_params, None, batch, 1, mesh=mesh, sh=sh)
    acc = _run(loss_fn, opt, exp.target_params, None, batch, 4, mesh=mesh, sh=sh)
    _assert_trees_close(acc[0], full[0], rtol=1e-5, atol=1e-6)
    for k in full[1]:
        np.testing.assert_allclose(acc[1][k], full[1][k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_bad_grad_accum_is_one_clear_line_before_any_compile(setup, tmp_path):
    from dflash_jax.training import trainer

    c, exp, _ = setup
    for accum in (3, 0):
        with pytest.raises(ValueError) as e:
            check_grad_accum(8, accum)
        msg = str(e.value)
        assert "\n" not in msg and str(accum) in msg and "8" in msg
    with pytest.raises(ValueError, match="not divisible by the 4 batch shards"):
        check_grad_accum(8, 4, 4)
    with pytest.raises(ValueError, match="grad_accum_steps must be >= 1"):
        make_train_step(exp.loss_fn, optax.sgd(1.0), grad_accum_steps=0)
    bad = c.copy_and_resolve_references()
    bad.grad_accum_steps = 3
    with pytest.raises(
        ValueError, match="grad_accum_steps 3 must be >= 1 and divide the batch size 8"
    ):
        trainer.train_and_evaluate(bad, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # refused before building (or compiling) anything


def test_dry_run_cli_refuses_a_bad_grad_accum_in_one_line(capsys):
    from dflash_jax.dry_run import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--mode=train", "--model=tiny", "--batch=8", "--grad_accum=3"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --grad_accum 3 must be >= 1 and divide --batch 8", err
