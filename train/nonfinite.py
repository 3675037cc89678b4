"""The loop's side of `train.on_nonfinite`: reads the steps' in-graph ``nonfinite`` flags lazily.

The flags stay on the device until the loop reads them: at each log step (where the logger fetches
the same metrics, so no extra stall), before every checkpoint save and at the end. Reading them in
order tells the first non-finite step (``stop``) or the run of consecutive skipped updates
(``skip``: `max_skipped` in a row stop the run). Invariant: `poll` is called before any save, so a
save never follows an unread non-finite step.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax


class NonfiniteGuard:
    def __init__(self, mode: str, max_skipped: int, message: Callable[[str], None]):
        self.mode, self.max_skipped, self.message = mode, max_skipped, message
        self._pending: list[tuple[int, Any, Any]] = []  # (step, flag, loss) on the device
        self.skipped = 0  # skipped updates in this run
        self._in_a_row = 0
        self.stop_step: int | None = None  # the step that ended the run

    def add(self, step: int, metrics: Mapping[str, Any]) -> None:
        if "nonfinite" in metrics:
            self._pending.append((step, metrics["nonfinite"], metrics.get("loss")))

    def poll(self) -> bool:
        """Reads the pending flags (one transfer); True when the run must stop."""
        if not self._pending or self.stop_step is not None:
            return self.stop_step is not None
        pending, self._pending = self._pending, []
        for step, flag, loss in jax.device_get(pending):
            if not float(flag):
                self._in_a_row = 0
                continue
            if self.mode == "stop":
                self.stop_step = step
                self.message(f"step {step}: non-finite loss / gradient (loss {float(loss)}); stopping: no "
                             f"checkpoint is saved after it (train.on_nonfinite=stop)")
                return True
            self.skipped += 1
            self._in_a_row += 1
            self.message(f"step {step}: non-finite loss / gradient (loss {float(loss)}); update skipped "
                         f"({self._in_a_row} in a row, {self.skipped} in this run)")
            if self._in_a_row >= self.max_skipped:
                self.stop_step = step
                self.message(f"step {step}: {self._in_a_row} updates in a row skipped (train.max_skipped="
                             f"{self.max_skipped}); stopping")
                return True
        return False


__all__ = ["NonfiniteGuard"]
