"""``pl.CostEstimate``s for this package's ``pallas_call``s, so that XLA's cost analysis of a compiled
step counts the kernels (a Mosaic / Triton custom call without one counts as zero FLOPs).

A kernel here is a grid of identical steps that each run one function of per-step tiles (the
chunk math of :mod:`pallas_kernels.gdn_chunk_math`, the block readouts of
:mod:`pallas_kernels.gdn_block_math`). Its cost is computed from shapes, not measured: the per-step
function is lowered once for the tile shapes (plain jnp, no Pallas; cached by shapes) and XLA's HLO
cost analysis of that step (dot FLOPs 2mnk, elementwise ops, exp / log as transcendentals) is
multiplied by the number of times the grid runs it. Bytes accessed: every operand and result once
(the tiles are streamed through fast memory once per kernel).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Spec = tuple[tuple[int, ...], str]  # (shape, dtype name) of one per-step operand


@functools.lru_cache(maxsize=512)
def step_cost(fn: Callable, specs: tuple[Spec, ...], static: tuple[tuple[str, object], ...] = ()) -> tuple[float, float]:
    """(flops, transcendentals) of one call ``fn(*operands, **dict(static))`` on operands of ``specs``
    (XLA HLO cost analysis of its unoptimised lowering; ``fn`` a module-level function and ``static``
    hashable keywords, so the cache hits across layers and calls)."""
    args = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in specs]
    cost = jax.jit(functools.partial(fn, **dict(static))).lower(*args).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0)), float(cost.get("transcendentals", 0.0))


def spec(shape: Sequence[int], dtype) -> Spec:
    return tuple(int(n) for n in shape), jnp.dtype(dtype).name


def nbytes(*arrays) -> int:
    """Total bytes of arrays / ShapeDtypeStructs (None entries skipped)."""
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays if a is not None)


def grid_estimate(steps: Sequence[tuple[Callable, tuple[Spec, ...], tuple, int]], operands: Sequence,
                  results: Sequence) -> pl.CostEstimate:
    """CostEstimate of a kernel that runs each ``(fn, specs, static, count)`` of ``steps`` ``count``
    times, reading ``operands`` and writing ``results`` (arrays or ShapeDtypeStructs) once."""
    flops = trans = 0.0
    for fn, specs, static, count in steps:
        f, t = step_cost(fn, specs, static)
        flops += count * f
        trans += count * t
    return pl.CostEstimate(flops=int(flops), transcendentals=int(trans),
                           bytes_accessed=nbytes(*operands) + nbytes(*results))
