"""Splash attention for a context shard whose queries sit at arbitrary places of the row (the zig-zag
layout): the keys are the whole row in row order, each shard's queries carry their row slots, and the
kernel's block tables are chosen per shard at run time, so splash visits only the tiles the shard's
queries can see.

Why: splash skips a tile only if its block table says so, and the tables are static. Under the
zig-zag layout shard i holds row pieces i and 2n - 1 - i; with one static mask per piece (the rolled
keys of :mod:`pallas_kernels.context.attention_kernels`) every piece visits the whole row, about
twice the causal work. Here the tables of all n shards are built ahead (numpy, cached) and stacked,
and inside the ``shard_map`` each shard indexes its own by ``axis_index``: the tables are operands
of the kernel (splash's scalar-prefetch ``MaskInfo``), not part of the compiled program's shape. The
in-kernel mask is one function for every shard of the query's code (``q_sequence``) and the key slot:

- clean stream, keys = the row's clean keys [m Tp] in row order: code = the query's row slot;
  visible iff key slot <= code;
- noisy stream, keys = [row's clean keys (m Tp) || the shard's own noisy keys (P Tp)]: code =
  (row slot of the query's block start) << shift | (its block start among the shard's queries);
  a clean key is visible iff its slot < the block start, a noisy key iff it lies in the query's
  block (the shard's noisy keys sit in the queries' order).

Segment ids still mask documents and pads. Every shard then runs the same number of tiles (the layout
balances them): (2n - 1) full piece-by-piece squares and 2 causal diagonals of the clean stream at
Tp = one piece, against 2 (2n - 1) squares plus 2 diagonals with the rolled keys.
Tables: ``block_mask`` (0 skip, 1 partial: apply the mask function, 2 full), ``data_next`` (the
block to fetch at each grid step: the next visited one in the kernel's iteration order, so skipped
steps fetch nothing new), computed vectorised from each query's visible key intervals and checked
against splash's own ``process_mask`` (tests/kernels/context/test_splash_rows.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sa_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as sa_info

from ..attention.splash import Stream, block_sizes_for
from .layout import piece_table, pieces


def query_slots(layout: str, n: int, tp: int) -> np.ndarray:
    """[n, P Tp] int: the row slot (on the padded grid of m = n P pieces of ``tp`` slots) of every
    query of every shard, the shard's pieces in its array order."""
    table = piece_table(layout, n)  # [n, P] row-order piece of each shard's piece
    return (table[:, :, None] * tp + np.arange(tp)[None, None, :]).reshape(n, -1)


class RowTables(NamedTuple):
    """Everything the kernel of one stream needs, for all n shards (leading dim n)."""

    codes: np.ndarray        # [n, Tq] int32: each query's code (``q_sequence``)
    block_mask: np.ndarray   # [n, 1, Tq / bq, S / bk] int: 0 skip, 1 partial, 2 full
    data_next: np.ndarray    # [n, 1, Tq / bq, S / bk] int32: fwd / dq grid (q outer, kv inner)
    data_next_dkv: np.ndarray  # [n, 1, Tq / bq, S / bk] int32: dkv grid (kv outer, q inner)
    shift: int               # noisy codes: bits of the local block start
    keys: int                # S: key slots of the kernel
    tiles: int               # most tiles any shard runs (block_mask != 0)


def _noisy_shift(tq: int) -> int:
    return max(int(tq - 1).bit_length(), 1)


def query_intervals(stream: Stream, slots: np.ndarray, block_size: int, clean_keys: int):
    """The key slots each query sees, as two half-open intervals: (lo, hi) [2, ..., Tq] int64 for
    ``slots`` [..., Tq] (before segment ids). Clean: [0, slot]; noisy: [0, block start) of the
    clean keys and its block among the shard's noisy keys (which follow the ``clean_keys``)."""
    slots = slots.astype(np.int64)
    if stream == "clean":
        zero = np.zeros_like(slots)
        return np.stack([zero, zero]), np.stack([slots + 1, zero])
    local = np.broadcast_to(np.arange(slots.shape[-1]), slots.shape)
    start, local_start = slots - slots % block_size, local - local % block_size
    lo = np.stack([np.zeros_like(slots), clean_keys + local_start])
    return lo, np.stack([start, clean_keys + local_start + block_size])


def query_codes(stream: Stream, slots: np.ndarray, block_size: int) -> tuple[np.ndarray, int]:
    """(codes [..., Tq] int32, shift) of the queries at row ``slots`` [..., Tq] (module docstring)."""
    if stream == "clean":
        return slots.astype(np.int32), 0
    tq = slots.shape[-1]
    shift = _noisy_shift(tq)
    start = slots.astype(np.int64) - slots % block_size
    local = np.arange(tq) - np.arange(tq) % block_size
    codes = (start << shift) | local
    if codes.max() >= 2 ** 31:
        raise ValueError(f"splash row tables: row slots up to {int(slots.max())} with {tq} queries per shard do "
                         "not fit the int32 query code; use more context shards")
    return codes.astype(np.int32), shift


@functools.lru_cache(maxsize=64)
def mask_function(stream: Stream, shift: int, clean_keys: int, block_size: int):
    """The in-kernel mask of (query codes, key slots), one for every shard (numpy or jnp ints)."""
    if stream == "clean":
        def clean_rows(q, kv):
            return kv <= q
        return clean_rows

    low = (1 << shift) - 1

    def noisy_rows(q, kv):
        start, local_start = q >> shift, q & low
        first = local_start + clean_keys
        return (kv < start) | ((kv >= first) & (kv < first + block_size))

    return noisy_rows


def block_classes(lo: np.ndarray, hi: np.ndarray, bq: int, bk: int, keys: int) -> np.ndarray:
    """[Tq / bq, S / bk] int32 for one shard's query intervals (lo, hi [2, Tq]): 2 where every query
    of the q tile sees every key of the kv tile, 1 where some pair is visible, else 0."""
    edges = np.arange(0, keys, bk)
    seen = sum(np.clip(np.minimum(h[:, None], edges + bk) - np.maximum(l[:, None], edges), 0, None)
               for l, h in zip(lo, hi))  # [Tq, S / bk] keys of each tile each query sees
    seen = seen.reshape(-1, bq, edges.size)
    return np.where((seen == bk).all(axis=1), 2, np.where((seen > 0).any(axis=1), 1, 0)).astype(np.int32)


def next_visited(classes: np.ndarray, kv_outer: bool) -> np.ndarray:
    """``data_next`` of splash for one head's block classes [Q, K]: at each grid step, the kv (fwd,
    dq) or q (dkv, ``kv_outer``) index of the first visited tile at or after it in the grid's
    iteration order, wrapping to the first visited tile (zeros when none is)."""
    order = classes.T if kv_outer else classes
    active = np.flatnonzero(order.reshape(-1))
    if active.size == 0:
        return np.zeros(classes.shape, np.int32)
    at = np.searchsorted(active, np.arange(order.size))
    nxt = active[np.where(at < active.size, at, 0)]
    inner = nxt % order.shape[1]  # kv index (fwd) or q index (dkv): the grid's innermost axis
    inner = inner.reshape(order.shape)
    return (inner.T if kv_outer else inner).astype(np.int32)


@functools.lru_cache(maxsize=16)
def row_tables(stream: Stream, layout: str, n: int, tp: int, block_size: int) -> RowTables:
    """The tables of every shard for queries of ``pieces(layout)`` pieces of ``tp`` slots each over
    the row's keys (m = n P pieces of ``tp``: clean; + the shard's P Tp noisy keys: noisy), at the
    tiles ``block_sizes_for`` picks."""
    slots = query_slots(layout, n, tp)
    tq, clean_keys = slots.shape[1], n * pieces(layout) * tp
    keys = clean_keys + (tq if stream == "noisy" else 0)
    bs = block_sizes_for(tq, keys)
    if (bs.block_q, bs.block_kv) != (bs.block_q_dkv, bs.block_kv_dkv):
        raise ValueError("splash row tables: the forward and backward tiles differ")  # one table serves both
    codes, shift = query_codes(stream, slots, block_size)
    lo, hi = query_intervals(stream, slots, block_size, clean_keys)
    classes = np.stack([block_classes(lo[:, s], hi[:, s], bs.block_q, bs.block_kv, keys) for s in range(n)])
    nxt = np.stack([next_visited(c, False) for c in classes])
    nxt_dkv = np.stack([next_visited(c, True) for c in classes])
    tiles = int(np.count_nonzero(classes, axis=(1, 2)).max())
    return RowTables(codes, classes[:, None], nxt[:, None], nxt_dkv[:, None], shift, keys, tiles)


def shard_kernel(stream: Stream, layout: str, n: int, tp: int, block_size: int, heads: int, interpret: bool,
                 shard: jax.Array) -> sa_kernel.SplashAttentionKernel:
    """The splash kernel of shard ``shard`` (a traced ``axis_index``) for ``heads`` query heads: the
    tables of :func:`row_tables` picked at run time; the grid (all tiles, unshrunk) is the same on
    every shard, and the tiles a shard's table marks 0 cost no compute nor fetch."""
    t = row_tables(stream, layout, n, tp, block_size)
    pick = lambda a: jnp.asarray(a)[shard]  # noqa: E731
    block_mask = pick(t.block_mask)
    fwd = sa_info.MaskInfo(data_next=pick(t.data_next), mask_next=None, block_mask=block_mask,
                           partial_mask_blocks=None, q_sequence=pick(t.codes))
    dkv = fwd._replace(data_next=pick(t.data_next_dkv))
    fn = mask_function(stream, t.shift, n * pieces(layout) * tp, block_size)
    return sa_kernel.SplashAttentionKernel(
        fwd, fwd, dkv, block_sizes=block_sizes_for(t.codes.shape[1], t.keys), is_mqa=False, save_residuals=False,
        mask_value=sa_kernel.DEFAULT_MASK_VALUE, attn_logits_soft_cap=None, residual_checkpoint_name=None,
        mask_function=fn, interpret=interpret)


__all__ = ["RowTables", "block_classes", "mask_function", "next_visited", "query_codes",
           "query_intervals", "query_slots", "row_tables", "shard_kernel"]
