"""train.checkpoint + train.loop: exact resume across SIGTERM and SIGKILL (real subprocesses), keep-N,
half-written checkpoints ignored, restore errors, restore into another sharding.

Run as a script, this file is the worker: the toy LM trained by `train.loop.run` on the
deterministic `ToyBatches` stream (see `_worker`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = 12


def _trainer_config(run_dir, ckpt_dir, every, steps=STEPS, keep=3):
    from train.config import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainConfig, TrainerConfig, WandbConfig

    return TrainerConfig(
        train=TrainConfig(steps=steps, micro_batches=2, log_every=1),
        optimizer=OptimizerConfig(lr=3e-2, warmup_steps=3, decay="cosine"),
        checkpoint=CheckpointConfig(dir=ckpt_dir, every_steps=every, keep=keep),
        logging=LoggingConfig(run_dir=run_dir, progress="off", wandb=WandbConfig(mode="disabled")),
    )


def _train(run_dir, ckpt_dir, every, *, sleep=0.0, kill_after_save=None, steps=STEPS, keep=3, stall_after=None):
    """The toy run; returns the LoopResult. `kill_after_save`: SIGKILL this process right after the
    (async) save of that step was issued, i.e. with the write most likely still in flight.
    `stall_after`: the batch source advances its state past batch `stall_after` and then blocks
    for good in a read of a pipe nobody writes (a stalled reader)."""
    from tests.train.test_train_toy import ToyBatches, toy_loss, toy_params
    from train.loop import run
    from train.optimizer import build_optimizer
    from train.state import init_train_state
    from train.step import make_train_step

    cfg = _trainer_config(run_dir, ckpt_dir, every, steps, keep)
    opt = build_optimizer(cfg.optimizer, cfg.train.steps)
    step = make_train_step(toy_loss, opt, micro_batches=cfg.train.micro_batches)

    class SlowBatches(ToyBatches):
        def __next__(self):
            time.sleep(sleep)
            out = super().__next__()
            if stall_after is not None and self.index > stall_after:
                os.read(os.pipe()[0], 1)  # never returns: only a signal ends it
            return out

    def on_checkpoint(s, state):
        if kill_after_save is not None and s == kill_after_save:
            os.kill(os.getpid(), signal.SIGKILL)

    return run(step, lambda: init_train_state(toy_params(), opt, seed=cfg.train.seed),
               lambda data_state: SlowBatches(seed=7, state=data_state), config=cfg,
               run_config={"recipe": "toy", "steps": steps}, on_checkpoint=on_checkpoint)


def _worker(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir")
    p.add_argument("--ckpt-dir")
    p.add_argument("--every", type=int)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--kill-after-save", type=int)
    p.add_argument("--stall-after", type=int)
    a = p.parse_args(argv)
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    res = _train(a.run_dir, a.ckpt_dir, a.every, sleep=a.sleep, kill_after_save=a.kill_after_save,
                 stall_after=a.stall_after)
    print(f"worker done: step={res.step} preempted={res.preempted} resumed_from={res.resumed_from}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    _worker(sys.argv[1:])
    sys.exit(0)


# ---------------------------------------------------------------------------------------------- tests
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _records(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def _spawn(tmp_path, *args):
    env = dict(os.environ)  # conftest's JAX_PLATFORMS / XLA_FLAGS: the same numerics as here
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), str(HERE), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-dir", str(tmp_path / "run"),
           "--ckpt-dir", str(tmp_path / "ckpt"), *map(str, args)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _steps_on_disk(ckpt_dir):
    return sorted(int(p.name) for p in Path(ckpt_dir).iterdir() if p.name.isdigit())


def test_resume_after_sigterm_and_sigkill_is_bit_exact(tmp_path):
    ref_dir = tmp_path / "ref"
    _train(str(ref_dir / "run"), None, 0)
    ref = {r["step"]: r["loss"] for r in _records(ref_dir / "run")}
    assert sorted(ref) == list(range(1, STEPS + 1))

    # 1) external SIGTERM mid-run: the loop saves the step it finished and exits cleanly
    proc = _spawn(tmp_path, "--every", 100, "--sleep", 0.4)
    deadline = time.time() + 120
    while len(_records(tmp_path / "run")) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "SIGTERM received" in out and "preempted=True" in out, out
    s1 = _records(tmp_path / "run")[-1]["step"]
    assert 3 <= s1 < STEPS and _steps_on_disk(tmp_path / "ckpt") == [s1], out  # no periodic save (every=100)

    # 2) resume, checkpoint every 2 steps, and die by SIGKILL right after issuing an async save
    kill_at = s1 + 4 if (s1 + 4) % 2 == 0 else s1 + 3
    proc = _spawn(tmp_path, "--every", 2, "--kill-after-save", kill_at)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == -signal.SIGKILL, out
    assert f"resumed from checkpoint step {s1}" in out, out
    complete = _steps_on_disk(tmp_path / "ckpt")
    assert complete and max(complete) <= kill_at, complete

    # 3) resume to the end: the newest complete checkpoint, then every step exactly as uninterrupted
    proc = _spawn(tmp_path, "--every", 2)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert f"resumed from checkpoint step {max(complete)}" in out and f"step={STEPS}" in out, out
    recs = _records(tmp_path / "run")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))  # re-run steps replaced, not duplicated
    assert {r["step"]: r["loss"] for r in recs} == ref  # bit-exact

    # the run config and the final state come back from the last checkpoint
    from train.checkpoint import Checkpointer
    from train.config import CheckpointConfig

    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    state, data, run_cfg = ck.restore(jax.eval_shape(lambda: _toy_state()[0]))
    ck.close()
    assert int(state.step) == STEPS and data == {"seed": 7, "index": STEPS}
    assert run_cfg == {"recipe": "toy", "steps": STEPS}


def _toy_state(trainable=None):
    from tests.train.test_train_toy import toy_params
    from train.config import OptimizerConfig
    from train.optimizer import build_optimizer
    from train.state import init_train_state

    opt = build_optimizer(OptimizerConfig(trainable=trainable), 10)
    return init_train_state(toy_params(), opt), opt


def test_sigterm_while_the_reader_is_stalled_exits_and_saves_a_consistent_checkpoint(tmp_path):
    """The batch source advances its state past batch 5 and then blocks in a read that never
    returns: SIGTERM still ends the run within the 30 s preemption notice, with a checkpoint of
    step 4 whose data state is the one right after batch 4 (not the advanced live state), so a
    resume would draw batch 5 next."""
    proc = _spawn(tmp_path, "--every", 100, "--stall-after", 4)
    deadline = time.time() + 120
    while len(_records(tmp_path / "run")) < 4:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    time.sleep(0.5)  # well inside the stalled read by now
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        out = proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("SIGTERM ignored while the input pipeline is stalled: " + proc.communicate()[0][-2000:])
    assert proc.returncode == 0 and time.time() - t0 < 30, out
    assert "SIGTERM received while waiting for data: stopped after step 4" in out and "preempted=True" in out, out
    assert _steps_on_disk(tmp_path / "ckpt") == [4], out

    from train.checkpoint import Checkpointer
    from train.config import CheckpointConfig

    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    state, data, _ = ck.restore(jax.eval_shape(lambda: _toy_state()[0]))
    ck.close()
    assert int(state.step) == 4 and data == {"seed": 7, "index": 4}


def test_keep_n_and_half_written_checkpoint_is_ignored(tmp_path):
    from train.checkpoint import Checkpointer
    from train.config import CheckpointConfig

    res = _train(str(tmp_path / "run"), str(tmp_path / "ckpt"), 1, steps=4, keep=2)
    assert res.step == 4 and _steps_on_disk(tmp_path / "ckpt") == [3, 4]
    want = jax.tree.map(np.asarray, res.state)

    # a save killed mid-write leaves Orbax's tmp directory (never the final name): fake one for step 5
    tmp = tmp_path / "ckpt" / "5.orbax-checkpoint-tmp"
    shutil.copytree(tmp_path / "ckpt" / "4", tmp)
    (tmp / "_CHECKPOINT_METADATA").unlink()
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt"), keep=2))
    assert ck.latest_step() == 4 and ck.all_steps() == [3, 4]
    state, data, _ = ck.restore(jax.eval_shape(lambda: _toy_state()[0]))
    assert int(state.step) == 4 and data == {"seed": 7, "index": 4}
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), want)
    ck.close()
    assert not tmp.exists()  # the next manager cleans the partial write up


def test_restore_errors_name_the_item_and_key(tmp_path):
    from train.checkpoint import CheckpointError, Checkpointer
    from train.config import CheckpointConfig

    state, _ = _toy_state()
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "c"), async_save=False))
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        ck.restore(state)
    ck.save(state, data_state={"index": 0})
    other, _ = _toy_state(trainable=("head",))  # fewer Adam moments than saved
    with pytest.raises(CheckpointError, match=r"item 'opt_state': unexpected entries .*embed.*trainable"):
        ck.restore(jax.eval_shape(lambda: other))
    bad = state.replace(params={**state.params, "head": {**state.params["head"], "bias": jnp.zeros((3,))}})
    with pytest.raises(CheckpointError, match=r"item 'params': 'head.bias' has shape \(16,\), expected \(3,\)"):
        ck.restore(bad)
    with pytest.raises(CheckpointError, match="data iterator state at step 0 must be JSON"):
        Checkpointer(CheckpointConfig(dir=str(tmp_path / "d"))).save(state, data_state={"x": object()})
    ck.close()


def test_restore_into_a_sharded_layout(tmp_path):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from train.checkpoint import Checkpointer
    from train.config import CheckpointConfig

    state, _ = _toy_state()
    want = jax.tree.map(np.asarray, state)
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "c")))
    ck.save(state, data_state={})
    ck.wait()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "fsdp"))

    def target(path, x):
        spec = P("fsdp") if x.ndim >= 1 and x.shape[0] % 2 == 0 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    got, _, _ = ck.restore(jax.tree_util.tree_map_with_path(target, state))
    emb = got.params["embed"]["embedding"]
    assert emb.sharding == NamedSharding(mesh, P("fsdp")) and len(emb.addressable_shards) == 8
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, got), want)
    ck.close()


def test_a_checkpoint_without_frozen_params_holds_the_trained_ones_and_refuses_other_base_weights(tmp_path):
    """`save_frozen: false`: the params item holds only the trained leaves (the item's own
    metadata), a restore takes the frozen ones from the initial params and gives back the saved
    state bit for bit; initial params whose frozen leaves differ (another init checkpoint) are
    refused naming the leaf, as is a restore without them."""
    from train.checkpoint import CheckpointError, Checkpointer
    from train.config import CheckpointConfig

    state, opt = _toy_state(trainable=("head",))
    mask = opt.trainable_mask(state.params)
    # as after some training: the trained leaves moved, the frozen ones did not
    trained = state.replace(params={**state.params, "head": jax.tree.map(lambda x: x + 1.0, state.params["head"])},
                            step=jnp.asarray(3, jnp.int32))
    cfg = CheckpointConfig(dir=str(tmp_path / "c"), async_save=False, save_frozen=False)
    with pytest.raises(CheckpointError, match="save_frozen: false needs to know which params train"):
        Checkpointer(cfg)
    ck = Checkpointer(cfg, params_mask=mask)
    ck.save(trained)
    saved = {m.name for m in jax.tree.leaves(ck.manager.item_metadata(3)["params"].tree) if hasattr(m, "shape")}
    assert saved == {"head.kernel", "head.bias"}
    abstract = jax.eval_shape(lambda: state)
    got, _, _ = ck.restore(abstract, frozen=lambda: state.params)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, trained))
    with pytest.raises(CheckpointError, match="needs the run's initial params"):
        ck.restore(abstract)
    other = {**state.params, "embed": jax.tree.map(lambda x: x * 1.01, state.params["embed"])}
    with pytest.raises(CheckpointError, match=r"not those it was trained with: 'embed\.\w+'"):
        ck.restore(abstract, frozen=lambda: other)
    # a full checkpoint is not one without frozen params (and the other way round): the item names it
    full = Checkpointer(CheckpointConfig(dir=str(tmp_path / "f"), async_save=False))
    full.save(trained)
    full.close()
    with pytest.raises(CheckpointError, match="unexpected entries .*embed.*save_frozen"):
        Checkpointer(dataclasses.replace(cfg, dir=str(tmp_path / "f")), params_mask=mask).restore(
            abstract, frozen=lambda: state.params)
    ck.close()
