"""A failed background (async) checkpoint write: surfaced as one CheckpointSaveError naming the step dir
and the OS error, the run stops, Orbax's own tracebacks stay out of the log, and the last complete
checkpoint survives (keep=1). The disk-full error is injected where Orbax really writes in the
background: the JSON items' commit (`JsonCheckpointHandler._save_fn`)."""

from __future__ import annotations

import errno
import logging
import os

import orbax.checkpoint as ocp
import pytest

from tests.train.toy_loop import losses, steps_on_disk, toy_run


@pytest.fixture
def disk_full_at_step_8(monkeypatch):
    orig = ocp.JsonCheckpointHandler._save_fn

    async def save_fn(self, x, directory):
        if directory.parent.name.startswith("8."):  # <dir>/8.orbax-checkpoint-tmp/<item>...
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "metadata"))
        return await orig(self, x, directory)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", save_fn)


@pytest.mark.parametrize("async_save", [True, False])
def test_failed_save_stops_the_run_with_one_line_and_keeps_the_last_checkpoint(
        tmp_path, disk_full_at_step_8, caplog, async_save):
    from train.checkpoint import CheckpointSaveError

    ck = tmp_path / "ckpt"
    caplog.set_level(logging.INFO)
    with pytest.raises(CheckpointSaveError) as e:
        toy_run(tmp_path / "run", ck, steps=12, every=4, keep=1, async_save=async_save)
    msg = str(e.value)
    assert "\n" not in msg and f"checkpoint save of step 8 to {ck / '8'} failed" in msg, msg
    assert "[Errno 28] No space left on device" in msg and "last complete checkpoint (step 4) is kept" in msg, msg
    assert steps_on_disk(ck) == [4]  # keep=1 did not push the good one out for the failed one
    assert max(losses(tmp_path / "run")) < 12  # stopped: no training past the failure
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
