"""Helpers shared by the bench scripts (run as `python bench/<name>.py`, so this imports as `common`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time in seconds of `fn()` over `repeats` calls, after one untimed call (compile and
    warm-up); every call is waited for with `jax.block_until_ready`."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best
