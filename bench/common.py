"""Helpers shared by the bench scripts (run as `python bench/<name>.py`, so this imports as `common`)."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


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


def timeit(fn, repeats: int) -> float:
    fn()  # warm-up / compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def in_own_process(fn, *args):
    """`fn(*args)` in a fresh (spawned) process: torch gets the cores to itself. Run after JAX in the
    same process, torch's per-module times came out several-fold slow (XLA's CPU thread pool is
    still there), so the torch side of every comparison runs in its own process."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def chunked_ce(m, h_BTD, targets_BT):
    """Mean CE of final-normed hidden states against targets by the library's chunked CE."""
    from sft.loss import weighted_ce

    w = m.embed.embedding[...].T if m.cfg.tie_word_embeddings else m.lm_head.kernel[...]
    mask = jnp.ones(targets_BT.shape, bool)
    return weighted_ce(h_BTD, w, targets_BT, mask / mask.size, mask)[0]
