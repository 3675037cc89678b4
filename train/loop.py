"""The training loop: resume, steps, eval, logging, periodic/final/SIGTERM checkpoints.

Resume is exact: a checkpoint after step s holds the state after s updates and the data iterator's
state after s batches, so the resumed run draws batch s+1 next (nothing skipped, nothing repeated)
and, the step being deterministic, reproduces the interrupted run's losses bit for bit.

SIGTERM (preemption): the handler only sets a flag; the loop finishes the step in flight, saves a
checkpoint, waits for it to be final, prints a message and returns with ``preempted=True`` (the
caller decides the exit code). With several processes the flag is agreed on by all of them every
`train.log_every` steps (a tiny all-gather), so they save the same step.
While the loop waits for the next batch (a slow or stalled input pipeline) the handler raises
`DataWaitInterrupted` instead, so the wait ends at once: the state after the last finished step and
the data state recorded right after its batch was drawn are consistent, and a single process saves
them (several processes cannot agree on a step from inside a data wait: they exit without a save,
the last periodic checkpoint stands). The data state is therefore read after every batch drawn
(`data_state_fn`, cheap for the SFT iterator), not at save time.

Multi-process data state: `data_state_fn` runs on every process but the checkpoint keeps one JSON
(Orbax writes it from the primary process), so it must be the same on every process, e.g. the
global batch index of an index-based pipeline where each process reads its slice of batch k.

Faults (docs/guides/sft.md "Faults and recovery"): the run holds a lock on its checkpoint and run
dirs (`train.run_lock`, taken before the checkpoint manager exists: a new manager deletes leftover tmp
dirs, which would be the other run's save in flight); a resume takes the newest readable checkpoint
and moves corrupt ones aside (`train.ckpt_verify`), after comparing its stored config with this one
where the caller says it must match (`resume_must_match`, `train.config_diff`); non-finite steps stop
the run or are skipped (`train.on_nonfinite`, `train.nonfinite`); a failed background save stops it
(`CheckpointSaveError` from `Checkpointer.check` after each step).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import jax
import numpy as np

from train.checkpoint import Checkpointer
from train.ckpt_verify import restore_newest_good
from train.config import TrainerConfig
from train.config_diff import check_resume_config
from train.logging import MetricsLogger
from train.nonfinite import NonfiniteGuard
from train.run_lock import run_lock
from train.state import TrainState

BatchFactory = Callable[[dict[str, Any] | None], Iterator[Any]]


@dataclass(frozen=True)
class LoopResult:
    state: TrainState
    step: int
    preempted: bool  # stopped by SIGTERM (a checkpoint of `step` was written)
    data_exhausted: bool  # the batches ran out before `train.steps`
    resumed_from: int | None  # the checkpoint step this run started from
    nonfinite_step: int | None = None  # the run stopped on a non-finite step (train.on_nonfinite)
    skipped: int = 0  # updates skipped as non-finite (train.on_nonfinite: skip)


class DataWaitInterrupted(BaseException):
    """SIGTERM arrived while the loop waited for a batch. A BaseException, so that no `except
    Exception` in a data pipeline (a renderer counting bad records, say) can swallow it."""


class _SigtermFlag:
    """Installs a SIGTERM handler that sets a flag (main thread only; elsewhere a no-op).

    With several processes the flag must be agreed on, so that all of them save the same step: an
    all-gather, done only every `sync_every` steps (it waits for the device queue, so every step
    would stall the dispatch pipeline). A single process reads its flag every step.
    """

    def __init__(self, enabled: bool, sync_every: int):
        self.flag = False
        self.sync_every = max(sync_every, 1)
        self._prev: Any = None
        self._installed = enabled and threading.current_thread() is threading.main_thread()
        self._in_data_wait = False

    def __enter__(self) -> "_SigtermFlag":
        if self._installed:
            self._prev = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.flag = True
        if self._in_data_wait:
            self._in_data_wait = False
            raise DataWaitInterrupted()

    @contextlib.contextmanager
    def data_wait(self) -> Iterator[None]:
        """While inside, SIGTERM raises `DataWaitInterrupted` in the main thread (Python runs the
        handler between bytecodes, and a blocking sleep / lock / read returns EINTR to it)."""
        self._in_data_wait = self._installed
        try:
            yield
        finally:
            self._in_data_wait = False

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._prev)

    def agreed(self, step: int, *, final: bool = False) -> bool:
        if jax.process_count() == 1:
            return self.flag
        if not final and step % self.sync_every:
            return False
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.asarray(self.flag))))


def _tokens(batch: Any, metrics: Mapping[str, Any], tokens_per_step: int | None) -> Any:
    if "tokens" in metrics:
        return metrics["tokens"]
    if tokens_per_step is not None:
        return tokens_per_step
    leaves = jax.tree.leaves(batch)
    return int(np.prod(np.shape(leaves[0]))) if leaves else 0


def _abstract_state(state: TrainState | Callable[[], TrainState]) -> TrainState:
    if callable(state):
        return jax.eval_shape(state)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), state)


def _open_batches(batches: BatchFactory | Iterable[Any], data_state: dict[str, Any] | None) -> Iterator[Any]:
    if callable(batches) and not hasattr(batches, "__next__"):
        return iter(batches(data_state))
    it = iter(batches)
    if data_state:
        if not hasattr(it, "set_state"):
            raise TypeError("resuming needs the data iterator's state restored: pass a factory "
                            "`batches(data_state) -> iterator` or an iterator with set_state()")
        it.set_state(data_state)
    return it


def run(
    train_step: Callable[[TrainState, Any], tuple[TrainState, Mapping[str, Any]]],
    state: TrainState | Callable[[], TrainState],
    batches: BatchFactory | Iterable[Any],
    *,
    config: TrainerConfig,
    data_state_fn: Callable[[], Mapping[str, Any]] | None = None,
    eval_fn: Callable[[TrainState], Mapping[str, Any]] | None = None,
    run_config: Mapping[str, Any] | None = None,
    flops_per_step: float | None = None,
    peak_flops: float | None = None,
    tokens_per_step: int | None = None,
    on_checkpoint: Callable[[int, TrainState], None] | None = None,
    on_step: Callable[[int, TrainState, Mapping[str, Any]], None] | None = None,
    checkpointer: Checkpointer | None = None,
    logger: MetricsLogger | None = None,
    abstract_state: TrainState | None = None,
    resume_must_match: Sequence[str] = (),
    resume_defaults: Mapping[str, Any] | None = None,
    params_mask: Any = None,
) -> LoopResult:
    """Trains until `config.train.steps` updates (counting those of a resumed checkpoint).

    state: a `TrainState`, or a zero-argument function making one (called only when there is no
      checkpoint to resume, so a resumed run never loads its initial weights).
    batches: `batches(data_state) -> iterator` (data_state None on a fresh start), or an iterator
      (with `set_state` to resume). `data_state_fn()` returns the iterator's JSON-able state after
      the last batch drawn (default: the iterator's `get_state` when it has one).
    eval_fn(state) -> scalar metrics, every `train.eval_every` steps (logged as ``eval/<name>``).
    on_checkpoint(step, state) after each save is issued; on_step(step, state, metrics) after each step.
    abstract_state: the restore target (shapes, dtypes, shardings); default: derived from `state`
      (`jax.eval_shape` of the function, so make that cheap to trace, or pass this).
    A `checkpointer` / `logger` passed in is flushed but left open; the ones made here are closed.
    resume_must_match: dotted prefixes of `run_config` that a resumed checkpoint's stored config must
      equal (`train.config_diff`; `train.resume: force` accepts a difference and logs it).
    resume_defaults: the default `run_config` (a key a checkpoint predates matches at its default).
    params_mask: params-shaped bools, True = trained: what a `checkpoint.save_frozen: false`
      checkpoint holds (a resume then builds the initial state for the frozen params).
    """
    say = logger.message if logger is not None else print
    with run_lock([config.checkpoint.dir if checkpointer is None else checkpointer.directory,
                   config.logging.run_dir], message=say):
        return _run(train_step, state, batches, config=config, data_state_fn=data_state_fn, eval_fn=eval_fn,
                    run_config=run_config, flops_per_step=flops_per_step, peak_flops=peak_flops,
                    tokens_per_step=tokens_per_step, on_checkpoint=on_checkpoint, on_step=on_step,
                    checkpointer=checkpointer, logger=logger, abstract_state=abstract_state,
                    resume_must_match=resume_must_match, resume_defaults=resume_defaults, params_mask=params_mask)


def _run(train_step: Callable, state: Any, batches: Any, *, config: TrainerConfig, data_state_fn: Any, eval_fn: Any,
         run_config: Any, flops_per_step: Any, peak_flops: Any, tokens_per_step: Any, on_checkpoint: Any,
         on_step: Any, checkpointer: Any, logger: Any, abstract_state: Any,
         resume_must_match: Sequence[str], resume_defaults: Mapping[str, Any] | None, params_mask: Any) -> LoopResult:
    """`run` inside the run lock."""
    tc, cc = config.train, config.checkpoint
    ckpt, own_ckpt, own_log = checkpointer, False, logger is None
    if ckpt is None and cc.dir is not None:
        ckpt, own_ckpt = Checkpointer(cc, run_config=run_config, params_mask=params_mask), True
    log = logger or MetricsLogger(config.logging, total_steps=tc.steps, log_every=tc.log_every,
                                  run_config=run_config, flops_per_step=flops_per_step, peak_flops=peak_flops)

    data_state: dict[str, Any] | None = None  # restored data state, then the one after the last batch drawn
    def on_config(step: int, stored: Mapping[str, Any]) -> None:
        if not resume_must_match:
            return
        where = str(ckpt.step_dir(step))
        diff = check_resume_config(stored, run_config or {}, resume_must_match, where=where,
                                   force=tc.resume == "force", defaults=resume_defaults)
        if diff:
            log.message(f"train.resume=force: resuming {where} despite {len(diff)} config difference(s): "
                         + "; ".join(diff))

    resumed_from = None
    initial: list[Any] = []  # the initial state, once built (a resume without frozen params needs it)

    def initial_state() -> Any:
        if not initial:
            initial.append(state() if callable(state) else state)
        return initial[0]

    if ckpt is not None and ckpt.all_steps():
        target = abstract_state if abstract_state is not None else _abstract_state(state)
        found = restore_newest_good(ckpt, target, message=log.message, on_config=on_config,
                                    frozen=lambda: initial_state().params)
        if found is not None:
            resumed_from, state, data_state = found
    if resumed_from is None:
        state = initial_state()
    initial.clear()  # a resumed run keeps only the initial state's frozen params
    it = _open_batches(batches, data_state)
    if data_state_fn is None and hasattr(it, "get_state"):
        data_state_fn = it.get_state

    step = int(jax.device_get(state.step))
    log.start(step)
    if resumed_from is not None:
        log.message(f"resumed from checkpoint step {resumed_from} in {ckpt.directory}")
    last_saved = resumed_from
    preempted = exhausted = in_data_wait = False
    track_data = ckpt is not None and data_state_fn is not None
    guard = NonfiniteGuard(tc.on_nonfinite, tc.max_skipped, log.message)

    def save() -> None:
        nonlocal last_saved
        if ckpt is None or last_saved == step or guard.poll():
            return
        ckpt.save(state, data_state=data_state if track_data else None)
        last_saved = step
        if on_checkpoint is not None:
            on_checkpoint(step, state)

    try:
        with _SigtermFlag(cc.save_on_sigterm, tc.log_every) as sigterm:
            while step < tc.steps:
                if sigterm.agreed(step):
                    preempted = True
                    break
                try:
                    with sigterm.data_wait():
                        batch = next(it)
                except StopIteration:
                    exhausted = True
                    log.message(f"data exhausted after {step} steps (train.steps={tc.steps})")
                    break
                except DataWaitInterrupted:
                    preempted = in_data_wait = True
                    break
                if track_data:
                    data_state = data_state_fn()
                state, metrics = train_step(state, batch)
                step += 1
                eval_metrics = None
                if eval_fn is not None and tc.eval_every and step % tc.eval_every == 0:
                    eval_metrics = eval_fn(state)
                guard.add(step, metrics)
                rec = log.record(step, metrics, _tokens(batch, metrics, tokens_per_step), eval_metrics=eval_metrics)
                if on_step is not None:
                    on_step(step, state, metrics)
                if rec is not None and guard.poll():  # the logger just fetched these metrics
                    break
                if ckpt is not None:
                    ckpt.check()  # a failed background save stops the run here
                    if ckpt.should_save(step):
                        save()
                        if guard.stop_step is not None:
                            break
            else:
                preempted = sigterm.agreed(step, final=True)
            guard.poll()
            if preempted:
                alone = jax.process_count() == 1
                if alone or not in_data_wait:
                    save()
                if ckpt is not None:
                    ckpt.wait()
                where = (f"checkpoint step {step} saved to {ckpt.directory}" if ckpt is not None and (alone or not in_data_wait)
                         else "no checkpoint saved (several processes cannot agree on a step from a data wait)"
                         if ckpt is not None else "no checkpoint dir")
                during = " while waiting for data" if in_data_wait else ""
                log.message(f"SIGTERM received{during}: stopped after step {step}; {where}; exiting")
        if not preempted and ckpt is not None and cc.save_final:
            save()
        if guard.stop_step is not None:
            newest = f"the newest checkpoint is step {last_saved}" if last_saved is not None else "no checkpoint written"
            log.message(f"stopped after step {step} (non-finite at step {guard.stop_step}); {newest}")
    finally:
        log.flush(step)
        if ckpt is not None:
            ckpt.close() if own_ckpt else ckpt.wait()
        if own_log:
            log.close()
    return LoopResult(state=state, step=step, preempted=preempted, data_exhausted=exhausted,
                      resumed_from=resumed_from, nonfinite_step=guard.stop_step, skipped=guard.skipped)


__all__ = ["DataWaitInterrupted", "LoopResult", "run"]
