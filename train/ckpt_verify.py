"""Resume from the newest *readable* checkpoint: a corrupt one is moved aside, never used or deleted.

A checkpoint can be complete by Orbax's rule (renamed from its tmp dir) and still unreadable later: a
truncated OCDBT data file, a deleted one, garbage in an item's metadata (a disk or copy fault). Each
step, newest first, is checked by using it: the config item is read (JSON), then every array item is
restored with Orbax's own metadata check first (`Checkpointer.restore`: item metadata parses, names
and shapes fit). Orbax / TensorStore report unreadable data as ``ValueError`` (JSON decode errors
included) or ``OSError``; only those count as corruption. A shape mismatch (`CheckpointError`, the
model changed) or a config mismatch (`on_config` raising) is the user's and propagates unchanged.

A corrupt step dir ``<dir>/<step>`` is renamed to ``<step>.corrupt`` (``.corrupt-1``, ... if taken),
which Orbax never lists, with one log line naming it and why; then the next newest is tried. If
checkpoints exist and none is readable, `CheckpointError`: a silent restart from scratch would look
like progress while throwing the run away.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax

from train.checkpoint import CheckpointError, Checkpointer, error_line
from train.state import TrainState

CORRUPT_SUFFIX = ".corrupt"

#: what a read of damaged checkpoint data raises (TensorStore: ValueError; files: OSError)
CORRUPTION_ERRORS = (ValueError, OSError)


def move_aside(ckpt: Checkpointer, step: int) -> Any:
    """Renames the step dir to ``<step>.corrupt`` (a free variant of it) and returns the new path;
    process 0 renames, every process waits for it."""
    src = ckpt.step_dir(step)
    dst = src.with_name(src.name + CORRUPT_SUFFIX)
    n = 0
    while dst.exists():
        n += 1
        dst = src.with_name(f"{src.name}{CORRUPT_SUFFIX}-{n}")
    if jax.process_index() == 0:
        src.rename(dst)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"ckpt_move_aside_{step}")
    ckpt.manager.reload()  # forget the step
    return dst


def restore_newest_good(
    ckpt: Checkpointer, target: TrainState, *, message: Callable[[str], None],
    on_config: Callable[[int, Mapping[str, Any]], None] | None = None, frozen: Callable[[], Any] | None = None,
) -> tuple[int, TrainState, dict[str, Any]] | None:
    """(step, state, data_state) of the newest readable checkpoint; None when there is none at all.

    on_config(step, stored_config) runs before that step's arrays are read (it may refuse).
    frozen(): the run's initial params, for a checkpoint without its frozen ones (`Checkpointer.restore`)."""
    moved: list[str] = []
    for step in sorted(ckpt.all_steps(), reverse=True):
        try:
            stored = ckpt.restore_config(step)
        except CORRUPTION_ERRORS as e:
            moved.append(_aside(ckpt, step, "config", e, message))
            continue
        if on_config is not None:
            on_config(step, stored)
        try:
            state, data_state, _ = ckpt.restore(target, step, frozen=frozen)
        except CORRUPTION_ERRORS as e:
            moved.append(_aside(ckpt, step, "arrays", e, message))
            continue
        return step, state, data_state
    if moved:
        raise CheckpointError(f"no readable checkpoint in {ckpt.directory}: every one was corrupt and is moved "
                              f"aside ({', '.join(moved)}); not starting from scratch over them: remove them "
                              "(or set another checkpoint.dir) to start fresh")
    return None


def _aside(ckpt: Checkpointer, step: int, what: str, e: BaseException, message: Callable[[str], None]) -> str:
    dst = move_aside(ckpt, step)
    message(f"checkpoint {ckpt.step_dir(step)} is unreadable ({what}: {error_line(e)}); moved aside to "
            f"{dst}, trying the previous one")
    return str(dst)


__all__ = ["CORRUPT_SUFFIX", "move_aside", "restore_newest_good"]
