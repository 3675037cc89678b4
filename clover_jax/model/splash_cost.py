"""The cost of a compiled splash call (JAX's maintained kernel carries no ``pl.CostEstimate``): the
matmul FLOPs of the tiles it runs, counted by splash's own mask processing, for the `kernel_cost`
hook of `train.hlo_cost` (through `kernel_costs.step_kernel_cost`).

It lives in the model, beside `kernel_costs`, not in the kernel's module: under a context layout of
several pieces per shard the count needs the per-shard block tables
(`pallas_kernels.context.splash_rows`), which are built on the kernel module; a cost model inside
the kernel module made the two import each other.
"""

from __future__ import annotations

import math
import re

import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as sa

from pallas_kernels.attention.splash import Stream, block_sizes_for, stream_mask
from pallas_kernels.context.layout import pieces
from pallas_kernels.context.splash_rows import row_tables

#: matmuls of bq x bk x D per executed tile: fwd S = QK^T, O += PV; dq: S, dP = dO V^T, dQ = dS K;
#: dkv: S, dP, dV = P^T dO, dK = dS^T Q
_TILE_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}


def active_tiles(stream: Stream, tp: int, block_size: int, prefix: int = 0) -> int:
    """Tiles of one head's [Tp, S] mask that splash runs (not all masked), at ``block_sizes_for``:
    counted by splash's own mask processing, the same tables the kernel walks."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as sa_info

    mask = stream_mask(stream, tp, block_size, prefix)
    bs = block_sizes_for(tp, mask.shape[1])
    info, _ = sa_info.process_mask(sa.MultiHeadMask([mask]), (bs.block_q, bs.block_kv))
    return int(np.count_nonzero(info.block_mask))


def kernel_cost(name: str, operands: tuple, results: tuple, estimate: object = None, *,
                block_size: int, context: int = 1, layout: str = "contiguous") -> tuple[float, float] | None:
    """(FLOPs, bytes) of one compiled splash call named ``splash_mha_{fwd,dq,dkv}...`` (the
    ``kernel_cost`` hook of `train.hlo_cost`): matmul FLOPs of the tiles the kernel runs for the
    stream its shapes name (S = 2T: noisy, with the training ``block_size``), x batch x query heads;
    with the row over ``context`` shards (each shard's Tp queries after the (context - 1) Tp keys of
    the others): S = context Tp clean, (context + 1) Tp noisy; under a ``layout`` of several pieces
    per shard (zigzag) the shard's queries run over the row's keys with their own tables
    (:mod:`pallas_kernels.context.splash_rows`): the most tiles any shard runs;
    bytes = its operands and results read / written once. None for any other kernel (``estimate``,
    the call's own cost estimate, is unused: splash reports none).

    ``operands`` / ``results``: the call's arrays (objects with ``dtype``, ``dims``, ``bytes``); q is
    the first float [B, H, Tp, D] (or [H, Tp, D]) operand, k the next."""
    m = re.match(r"splash_mha_(fwd|dq|dkv)", name)
    arrays = [a for a in operands if len(a.dims) in (3, 4) and a.dtype in ("bf16", "f32", "f16")]
    if m is None or len(arrays) < 2:
        return None
    (h, tp, d), s = arrays[0].dims[-3:], arrays[1].dims[-2]
    b = math.prod(arrays[0].dims[:-3])  # the vmapped rows (squeezed away when one)
    stream: Stream = "noisy" if s == (context + 1) * tp else "clean"
    if stream == "clean" and s != context * tp:
        return None
    bs = block_sizes_for(tp, s)
    block = block_size if stream == "noisy" else 1
    if context > 1 and pieces(layout) > 1:
        tiles = row_tables(stream, layout, context, tp // pieces(layout), block).tiles
    else:
        tiles = active_tiles(stream, tp, block, prefix=(context - 1) * tp)
    flops = 2.0 * _TILE_MATMULS[m.group(1)] * tiles * bs.block_q * bs.block_kv * d * b * h
    return flops, float(sum(a.bytes for a in (*operands, *results)))


__all__ = ["active_tiles", "kernel_cost"]
