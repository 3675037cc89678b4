"""train.ckpt_verify through train.loop.run: a corrupt newest checkpoint (truncated params data, a
deleted OCDBT file, garbage item metadata) is moved aside with one line and the run resumes from the
previous one, reproducing the uninterrupted run's losses; all corrupt -> a clear error, nothing deleted."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

from tests.train.toy_loop import losses, steps_on_disk, toy_run


def _truncate_params(step_dir: Path) -> None:
    files = [f for f in glob.glob(str(step_dir / "params" / "**" / "d" / "*"), recursive=True) if os.path.isfile(f)]
    assert files
    for f in files:
        os.truncate(f, os.path.getsize(f) // 2)


def _delete_ocdbt_file(step_dir: Path) -> None:
    files = sorted(f for f in glob.glob(str(step_dir / "params" / "**" / "d" / "*"), recursive=True))
    os.remove(files[0])


def _garbage_metadata(step_dir: Path) -> None:
    (step_dir / "params" / "_METADATA").write_text("\x00 not json {{")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    toy_run(run, None, steps=12)
    ref = losses(run)
    assert sorted(ref) == list(range(1, 13))
    return ref


@pytest.mark.parametrize("corrupt", [_truncate_params, _delete_ocdbt_file, _garbage_metadata])
def test_corrupt_newest_checkpoint_falls_back_and_matches_uninterrupted_losses(tmp_path, reference, corrupt):
    run, ck = tmp_path / "run", tmp_path / "ckpt"
    res = toy_run(run, ck, steps=8, every=4)
    assert res.step == 8 and steps_on_disk(ck) == [4, 8]
    corrupt(ck / "8")

    messages: list[str] = []
    res = toy_run(run, ck, steps=12, every=4, messages=messages)
    assert res.resumed_from == 4 and res.step == 12
    bad = [m for m in messages if "unreadable" in m]
    assert len(bad) == 1 and str(ck / "8") in bad[0] and "8.corrupt" in bad[0] and "\n" not in bad[0], messages
    assert (ck / "8.corrupt").is_dir()  # kept for a post-mortem, never deleted
    assert steps_on_disk(ck) == [4, 8, 12]  # step 8 re-trained from 4
    assert losses(run) == reference  # bit-exact with the uninterrupted run


def _resume_with_another_model(run_dir, ck):
    """The toy with a 3-entry head bias against checkpoints of the 16-entry one."""
    from tests.train.test_train_toy import ToyBatches, toy_loss, toy_params
    from tests.train.toy_loop import trainer_config
    from train.config import OptimizerConfig
    from train.loop import run
    from train.optimizer import build_optimizer
    from train.state import init_train_state
    from train.step import make_train_step

    opt = build_optimizer(OptimizerConfig(), 4)
    params = toy_params()
    params["head"]["bias"] = params["head"]["bias"][:3]
    run(make_train_step(toy_loss, opt), lambda: init_train_state(params, opt), ToyBatches(seed=7),
        config=trainer_config(run_dir, ck, steps=12))


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    from train.checkpoint import CheckpointError

    run, ck = tmp_path / "run", tmp_path / "ckpt"
    toy_run(run, ck, steps=8, every=4)
    # a checkpoint of another model is the user's mistake, not corruption: it propagates, nothing moves
    with pytest.raises(CheckpointError, match="'head.bias' has shape"):
        _resume_with_another_model(run, ck)
    assert steps_on_disk(ck) == [4, 8] and not list(ck.glob("*.corrupt*"))

    (ck / "8.corrupt").mkdir()  # a name already taken: the next one gets a suffix
    for s in (4, 8):
        _truncate_params(ck / str(s))
    with pytest.raises(CheckpointError, match="no readable checkpoint in .*not starting from scratch") as e:
        toy_run(run, ck, steps=12, every=4)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in ck.iterdir() if not p.name.startswith(".")) == ["4.corrupt", "8.corrupt",
                                                                                  "8.corrupt-1"]
    assert max(losses(run)) == 8  # the metrics of the old run are untouched
