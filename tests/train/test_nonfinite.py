"""train.on_nonfinite: the step's in-graph `nonfinite` flag, `skip` keeping the old state bit for bit,
`stop` ending the run (read lazily, at the log step or before a save) with no checkpoint after the bad
step, `max_skipped` in a row stopping a skipping run, and Checkpointer.save refusing non-finite params."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.train.test_train_toy import ToyBatches, make_batch, toy_loss, toy_params
from tests.train.toy_loop import steps_on_disk, toy_run


def poisoned_loss(params, batch, rng):
    """The toy loss, NaN on the rows marked `poison` (so the micro-batch holding them is NaN)."""
    loss, m = toy_loss(params, {k: v for k, v in batch.items() if k != "poison"}, rng)
    return loss * jnp.where(jnp.any(batch["poison"] > 0), jnp.nan, 1.0), m  # NaN gradients too


class PoisonedBatches(ToyBatches):
    """The toy stream; the batches of the steps in `bad` (1-based) carry NaN-making rows."""

    def __init__(self, bad: set[int], state=None):
        super().__init__(seed=7, state=state)
        self.bad = bad

    def __next__(self):
        out = super().__next__()
        return {**out, "poison": np.full((self.batch,), int(self.index in self.bad), np.int32)}


def _batches(bad):
    return lambda data_state: PoisonedBatches(bad, data_state)


def test_skip_keeps_params_and_opt_state_bit_for_bit():
    from train.config import OptimizerConfig
    from train.optimizer import build_optimizer
    from train.state import init_train_state
    from train.step import make_train_step

    opt = build_optimizer(OptimizerConfig(lr=1e-2), 10)
    step = make_train_step(poisoned_loss, opt, micro_batches=2, on_nonfinite="skip", donate=False)
    state = init_train_state(toy_params(), opt)
    good = {**make_batch(7, 0), "poison": np.zeros(8, np.int32)}
    state, m = step(state, good)
    assert float(m["nonfinite"]) == 0.0
    before = jax.tree.map(np.asarray, state)
    new, m = step(state, {**good, "poison": np.ones(8, np.int32)})
    assert float(m["nonfinite"]) == 1.0 and not np.isfinite(float(m["loss"]))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, new.params), before.params)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, new.opt_state), before.opt_state)
    assert int(new.step) == int(before.step) + 1  # the step and the data move on
    # `stop` applies it (the loop stops the run): the params are NaN now
    stop = make_train_step(poisoned_loss, opt, micro_batches=2, donate=False)
    bad, m = stop(state, {**good, "poison": np.ones(8, np.int32)})
    assert float(m["nonfinite"]) == 1.0 and not np.isfinite(np.asarray(bad.params["head"]["bias"])).all()


def test_stop_ends_the_run_at_the_log_step_without_saving_after_the_bad_step(tmp_path):
    msgs: list[str] = []
    # logged (and checked) every 4 steps: the flag of step 6 is read at step 8, before its save
    res = toy_run(tmp_path / "run", tmp_path / "ckpt", loss_fn=poisoned_loss, batches=_batches({6}), steps=12,
                  every=4, log_every=4, messages=msgs)
    assert res.nonfinite_step == 6 and res.step == 8 and not res.preempted
    assert steps_on_disk(tmp_path / "ckpt") == [4]  # neither step 8 nor a final save
    assert any(m.startswith("step 6: non-finite") for m in msgs), msgs


def test_skip_counts_and_stops_after_max_skipped_in_a_row(tmp_path):
    res = toy_run(tmp_path / "a", tmp_path / "ca", loss_fn=poisoned_loss, batches=_batches({3, 6}), steps=12,
                  every=4, on_nonfinite="skip", max_skipped=2)
    assert res.nonfinite_step is None and res.step == 12 and res.skipped == 2
    assert steps_on_disk(tmp_path / "ca") == [4, 8, 12]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(res.state.params))

    res = toy_run(tmp_path / "b", tmp_path / "cb", loss_fn=poisoned_loss, batches=_batches({5, 6, 7}), steps=12,
                  every=4, on_nonfinite="skip", max_skipped=2)
    assert res.nonfinite_step == 6 and res.skipped == 2 and res.step == 6
    assert steps_on_disk(tmp_path / "cb") == [4]


def test_checkpointer_refuses_non_finite_params(tmp_path):
    from train.checkpoint import CheckpointError, Checkpointer
    from train.config import CheckpointConfig, OptimizerConfig
    from train.optimizer import build_optimizer
    from train.state import init_train_state

    opt = build_optimizer(OptimizerConfig(), 10)
    state = init_train_state(toy_params(), opt)
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "c"), keep=1))
    ck.save(state)
    p = {**state.params, "head": {**state.params["head"], "bias": state.params["head"]["bias"].at[3].set(jnp.inf)}}
    with pytest.raises(CheckpointError, match=r"refusing to save step 1 .*params leaf 'head.bias' is not finite"):
        ck.save(state.replace(params=p, step=state.step + 1))
    ck.close()
    assert steps_on_disk(tmp_path / "c") == [0]  # keep=1: the finite one survives
