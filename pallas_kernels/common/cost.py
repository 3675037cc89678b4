"""``pl.CostEstimate``s for this package's ``pallas_call``s, so that XLA's cost analysis of a compiled
step counts the kernels (a Mosaic / Triton custom call without one counts as zero FLOPs).

A kernel here is a grid of identical steps that each run one function of per-step tiles (the
chunk math of :mod:`pallas_kernels.gdn.chunk_math`, the block readouts of
:mod:`pallas_kernels.gdn.block_math`). Its cost is computed from shapes, not measured: the per-step
function is traced once for the tile shapes (plain jnp, no Pallas; cached by shapes), its jaxpr is
counted the way XLA's HLO cost analysis counts (dot FLOPs 2mnk, one per elementwise output, exp /
log as transcendentals), and that is multiplied by the number of times the grid runs the step. Bytes accessed: every operand and result once
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


_TRANSCENDENTAL = {"exp", "exp2", "log", "log1p", "tanh", "logistic", "rsqrt", "sqrt", "pow", "sin", "cos", "erf"}
_FREE = {"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "convert_element_type", "transpose", "slice",
         "iota", "concatenate", "pad", "copy", "dynamic_slice", "dynamic_update_slice", "gather"}


def _jaxpr_cost(jaxpr) -> tuple[float, float]:
    """(flops, transcendentals) of a jaxpr, counted as XLA's HLO cost analysis does: 2mnk per dot,
    one per output element of an elementwise op, one per input element of a reduction; layout ops
    free; sub-jaxprs (pjit, custom_jvp, ...) recursed into."""
    flops = trans = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = [v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
        if subs:
            for sub in subs:
                f, t = _jaxpr_cost(getattr(sub, "jaxpr", sub))
                flops, trans = flops + f, trans + t
            continue
        out = sum(math.prod(v.aval.shape) for v in eqn.outvars)
        if name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            flops += 2.0 * out * math.prod(lhs[d] for d in lc)
        elif name.startswith("reduce_") or name in ("argmax", "argmin"):
            flops += math.prod(eqn.invars[0].aval.shape)
        elif name not in _FREE:
            flops += out
            trans += out if name in _TRANSCENDENTAL else 0
    return flops, trans


@functools.lru_cache(maxsize=512)
def step_cost(fn: Callable, specs: tuple[Spec, ...], static: tuple[tuple[str, object], ...] = ()) -> tuple[float, float]:
    """(flops, transcendentals) of one call ``fn(*operands, **dict(static))`` on operands of
    ``specs``, from its jaxpr (traced, not compiled: this runs while the caller's step is being traced,
    whatever its mesh or target). ``fn`` a module-level function and ``static`` hashable keywords, so
    the cache hits across layers and calls."""
    args = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in specs]
    return _jaxpr_cost(jax.make_jaxpr(functools.partial(fn, **dict(static)))(*args).jaxpr)


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
