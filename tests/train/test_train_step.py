"""train.step: gradient accumulation equals one big batch (against jax.grad of the full-batch loss),
loss decreases, compute-dtype casting, eval, data-parallel sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tests.model.parity_utils import FP32_REL, assert_rel_close
from tests.train.test_train_toy import ToyBatches, make_batch, toy_loss, toy_params
from train.config import OptimizerConfig
from train.optimizer import build_optimizer
from train.state import init_train_state
from train.step import evaluate, make_eval_step, make_train_step, split_micro_batches


#: An optax transform whose state is the last gradient it saw (exactly: no params arithmetic).
RECORD_GRADS = optax.GradientTransformation(
    init=lambda p: jax.tree.map(jnp.zeros_like, p),
    update=lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g),
)


def _step_grads(loss_fn, params, batch, micro_batches):
    """The gradients the step hands to the optimizer, and its metrics."""
    state = init_train_state(params, RECORD_GRADS)
    step = make_train_step(loss_fn, RECORD_GRADS, micro_batches=micro_batches, donate=False)
    new, metrics = step(state, batch)
    return new.opt_state, jax.device_get(metrics)


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_accumulated_masked_mean_equals_full_batch(micro_batches):
    params, batch = toy_params(), make_batch(0, 0)
    # oracle: jax.grad of the loss on the whole batch at once, no trainer code involved
    want_loss, want_m = toy_loss(params, batch, None)
    want_g = jax.grad(lambda p: toy_loss(p, batch, None)[0])(params)
    got_g, got_m = _step_grads(toy_loss, params, batch, micro_batches)
    np.testing.assert_allclose(got_m["loss"], want_loss, rtol=1e-6)
    np.testing.assert_allclose(got_m["accuracy"], want_m["accuracy"], rtol=1e-6)
    assert got_m["weight"] == want_m["weight"] == batch["mask"].sum()  # counts are summed
    assert got_m["tokens"] == batch["mask"].size
    jax.tree.map(lambda g, w: assert_rel_close(g, w, FP32_REL, "grad"), got_g, want_g)

    # the micro-batches really are uneven, so a plain mean of micro-batch losses would be wrong
    mbs = split_micro_batches(batch, micro_batches)
    per_mb = [toy_loss(params, jax.tree.map(lambda x: x[i], mbs), None)[0] for i in range(micro_batches)]
    assert abs(float(np.mean(per_mb)) - float(want_loss)) > 1e-3


def test_accumulation_without_weight_is_plain_mean():
    def mse(params, batch, rng):  # per-example mean: equal-size micro-batches average exactly
        pred = jnp.take(params["embed"]["embedding"], batch["ids"], axis=0).sum(-1)
        return jnp.mean((pred - batch["mask"]) ** 2), {}

    params, batch = toy_params(), make_batch(1, 0)
    want = jax.grad(lambda p: mse(p, batch, None)[0])(params)
    got, m = _step_grads(mse, params, batch, 4)
    np.testing.assert_allclose(m["loss"], mse(params, batch, None)[0], rtol=1e-6)
    jax.tree.map(lambda g, w: assert_rel_close(g, w, FP32_REL, "grad"), got, want)


def test_split_micro_batches_is_strided_and_checks_divisibility():
    x = np.arange(12).reshape(6, 2)
    np.testing.assert_array_equal(split_micro_batches({"x": x}, 3)["x"][1], x[1::3])
    with pytest.raises(ValueError, match=r"batch leaf ids .*divisible by micro_batches=3"):
        split_micro_batches({"ids": np.zeros((4, 2))}, 3)


def test_loss_decreases_with_adamw_and_metrics():
    opt = build_optimizer(OptimizerConfig(lr=3e-2, warmup_steps=2, weight_decay=0.0), total_steps=30)
    state = init_train_state(toy_params(), opt)
    step = make_train_step(toy_loss, opt, micro_batches=2)
    it, losses = ToyBatches(seed=0), []
    for _ in range(30):
        state, m = step(state, next(it))
        losses.append(float(m["loss"]))
    assert int(state.step) == 30
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    assert float(m["lr"]) == pytest.approx(float(opt.schedule(29)))
    assert float(m["grad_norm"]) > 0


def test_compute_dtype_casts_inside_grad_and_keeps_masters():
    seen = {}

    def loss_fn(params, batch, rng):
        seen.update({k: v.dtype for k, v in params.items()})
        return jnp.sum(params["kernel"].astype(jnp.float32) ** 2) + jnp.sum(params["A_log"] ** 2), {}

    params = {"kernel": jnp.full((3,), 0.5, jnp.float32), "A_log": jnp.full((2,), 0.25, jnp.float32)}
    state = init_train_state(params, optax.sgd(0.5))
    new, _ = make_train_step(loss_fn, optax.sgd(0.5), compute_dtype="bfloat16")(state, {"x": np.zeros((1,))})
    assert seen == {"kernel": jnp.bfloat16, "A_log": jnp.float32}
    assert new.params["kernel"].dtype == jnp.float32  # master copy stays fp32
    np.testing.assert_allclose(new.params["kernel"], 0.0)  # 0.5 - 0.5 * 2 * 0.5
    np.testing.assert_allclose(new.params["A_log"], 0.0)


def test_eval_step_and_evaluate_weight_batches():
    params = toy_params()
    batches = [make_batch(5, i) for i in range(3)]
    got = evaluate(make_eval_step(toy_loss), params, iter(batches), steps=3)
    big = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    want_loss, want_m = toy_loss(params, big, None)
    np.testing.assert_allclose(got["loss"], want_loss, rtol=1e-6)
    np.testing.assert_allclose(got["accuracy"], want_m["accuracy"], rtol=1e-6)
    assert got["weight"] == big["mask"].sum()


def test_data_parallel_mesh_matches_single_device():
    assert jax.device_count() == 8
    opt = build_optimizer(OptimizerConfig(lr=1e-2), total_steps=4)

    def losses(shard: bool):
        state = init_train_state(toy_params(), opt)
        kw = {}
        if shard:
            mesh = Mesh(np.array(jax.devices()), ("data",))
            rep = NamedSharding(mesh, P())
            state = jax.device_put(state, rep)
            data = NamedSharding(mesh, P("data"))
            kw = {"in_shardings": (rep, data), "out_shardings": (rep, rep)}
        step = make_train_step(toy_loss, opt, micro_batches=2, **kw)
        it, out = ToyBatches(seed=2, batch=16), []
        for _ in range(4):
            batch = next(it)
            if shard:
                batch = jax.device_put(batch, data)
                assert len(batch["ids"].sharding.device_set) == 8
            state, m = step(state, batch)
            out.append(float(m["loss"]))
        return out, state

    (single, s1), (sharded, s8) = losses(False), losses(True)
    np.testing.assert_allclose(sharded, single, rtol=1e-6)
    jax.tree.map(lambda a, b: assert_rel_close(a, b, FP32_REL, "params"), s8.params, s1.params)
