"""SIGTERM outside the training loop of `launch.py sft`: one line, exit 143, at once.

`train.loop.run` installs its own SIGTERM handler around its steps only (it finishes the step,
saves, exits 143). Before it (config, data, the init checkpoint, the first compile: minutes on the
35B) and after it (final checkpoint, export, summary) SIGTERM would meet the process's default:
with libtpu installed, JAX's backend start-up loads it even on a CPU host, and libtpu then installs
absl's FailureSignalHandler for every signal still at its default disposition, which prints a C++
stack dump for SIGTERM. A Python handler installed before the backend starts keeps it away
(libtpu leaves a signal that already has a handler alone).

A Python handler alone would run only when the main thread comes back to the interpreter, which an
XLA compile does not do for minutes, so it is paired with `signal.set_wakeup_fd`: Python's C-level
handler writes the signal number to a pipe at once, and a daemon thread reading that pipe prints
the message and ends the process (`os._exit`, launch.py's exit code 143). Nothing is lost by not
unwinding: before the loop no new state exists; an init checkpoint or export being written sits in
a temp dir renamed into place only when complete, and an unfinished Orbax checkpoint is never taken
for a complete one. While the loop's own handler is installed, the thread leaves SIGTERM to it.

The message: ``SIGTERM received during <phase>: no checkpoint written since step N; exiting``, N
the newest complete checkpoint in `checkpoint.dir` (0 when there is none: a rerun starts over),
the phase read off the main thread's stack (`PHASES`), so the recipe keeps no bookkeeping for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Callable, Iterator

__all__ = ["PHASES", "current_phase", "sigterm_exits"]

#: (module, function) on the main thread's stack -> phase named in the message; the innermost
#: frame that matches wins (the compile runs inside run_sft, the init checkpoint inside prepare)
PHASES: dict[tuple[str, str], str] = {
    ("sft.recipe", "generate_init_checkpoint"): "the init checkpoint write",
    ("sft.recipe", "compiled"): "compile",
    ("sft.recipe", "step_flops"): "compile",
    ("sft.export", "export_params"): "the HF export",
    ("train.checkpoint", "restore"): "the checkpoint restore",
    ("train.loop", "run"): "the training loop",
    ("sft.recipe", "open_data"): "data loading",
    ("sft.remote", "localize"): "staging remote inputs",
}


def current_phase(frame: FrameType | None) -> str:
    """The phase of `PHASES` that `frame`'s stack is in (innermost match), else "setup"."""
    while frame is not None:
        phase = PHASES.get((frame.f_globals.get("__name__", ""), frame.f_code.co_name))
        if phase is not None:
            return phase
        frame = frame.f_back
    return "setup"


def _newest_checkpoint(directory: str | None) -> int | None:
    """The newest finalized Orbax step under `directory` (None: unknown dir or unreadable)."""
    if directory is None:
        return None
    try:
        from orbax.checkpoint import utils

        steps = utils.checkpoint_steps(directory)  # finalized steps only (no temp dirs), also gs://
    except Exception:  # a missing or unreachable dir: say what we know, never fail the exit
        return None
    return max(steps, default=0)


class _Guard:
    """The installed handler and its pipe thread (see the module docstring)."""

    def __init__(self, checkpoint_dir: Callable[[], str | None], exit_code: int):
        self.checkpoint_dir, self.exit_code = checkpoint_dir, exit_code
        self._once = threading.Lock()
        self._main = threading.main_thread().ident

    def handler(self, signum: int, frame: Any) -> None:
        """The Python-level handler (main thread): the same exit, should the thread not have run."""
        self.exit(frame)

    def exit(self, frame: FrameType | None) -> None:
        if not self._once.acquire(blocking=False):
            return  # the other path is already printing and exiting
        step = _newest_checkpoint(self.checkpoint_dir())
        since = f" since step {step}" if step is not None else ""
        try:
            sys.stdout.flush()  # what the run printed so far comes before the message
        except Exception:
            pass
        os.write(sys.stdout.fileno(), f"SIGTERM received during {current_phase(frame)}: no checkpoint written"
                                      f"{since}; exiting\n".encode())
        os._exit(self.exit_code)

    def watch(self, read_fd: int) -> None:
        """Daemon thread: one byte per caught signal; SIGTERM while our handler is the installed one exits."""
        try:
            while chunk := os.read(read_fd, 64):
                if signal.SIGTERM in chunk and signal.getsignal(signal.SIGTERM) == self.handler:
                    self.exit(sys._current_frames().get(self._main))
        finally:
            os.close(read_fd)


@contextlib.contextmanager
def sigterm_exits(checkpoint_dir: Callable[[], str | None], exit_code: int) -> Iterator[None]:
    """Inside: SIGTERM (outside `train.loop`'s own handler) prints the one-line message and exits
    with `exit_code` (launch.py: 143, as after the loop's own SIGTERM save) at once, also in the
    middle of a compile. `checkpoint_dir()` gives the run's checkpoint dir, None until known.
    Install it before anything starts the JAX backend (module docstring). Off the main thread
    (where signals cannot be handled) it does nothing. On exit the previous SIGTERM handler and
    wakeup fd come back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    guard = _Guard(checkpoint_dir, exit_code)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # set_wakeup_fd needs it: a full pipe must not block a handler
    prev_handler = signal.signal(signal.SIGTERM, guard.handler)
    prev_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=guard.watch, args=(read_fd,), name="sigterm-exits", daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(prev_fd)
        signal.signal(signal.SIGTERM, prev_handler)
        os.close(write_fd)  # the thread reads end-of-file and closes its end
