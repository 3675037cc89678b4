"""How a row's tokens are laid out over the ``context`` mesh axis: which pieces of the row each shard
holds, in what order.

The sequence dim is always sharded contiguously (shard i holds positions [i Tl, (i + 1) Tl) of the
array); a layout decides which tokens of the row sit at those positions:

- ``contiguous``: shard i holds row piece i (n pieces of Tl tokens): array order = row order.
- ``zigzag``: the row is cut into 2n pieces of Tl / 2 tokens and shard i holds pieces i and
  2n - 1 - i, in that order. Under a causal mask every shard then holds one early and one late piece,
  so each does the same attention work (contiguous: shard n - 1 does 2n - 1 times shard 0's).

Layers that mix tokens (attention, the GDN's conv and recurrence) need the row order; token-wise
layers do not care. Per shard, ``pieces(layout)`` pieces of equal length are treated as separate
rows ("piece rows" [B * P, Tl / P]) whose predecessors in the row are given by :func:`piece_table`.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context layout {layout!r}; expected one of {LAYOUTS}")
    return layout


def pieces(layout: str) -> int:
    """Pieces of the row per shard: 1 (contiguous) or 2 (zigzag)."""
    return 2 if check_layout(layout) == "zigzag" else 1


def piece_table(layout: str, n: int) -> np.ndarray:
    """[n, P] int: the row-order index of shard i's piece p (of n * P pieces)."""
    if pieces(layout) == 1:
        return np.arange(n)[:, None]
    return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1)


def row_order(layout: str, n: int) -> np.ndarray:
    """[n * P] int: for each row-order piece r, its flat index shard * P + piece (the inverse of
    :func:`piece_table`)."""
    table = piece_table(layout, n)
    out = np.empty(table.size, np.int64)
    out[table.reshape(-1)] = np.arange(table.size)
    return out


def layout_positions(t: int, n: int, layout: str) -> np.ndarray:
    """[T] int: the row position of the token at each array position (identity for contiguous)."""
    p = pieces(layout)
    if t % (n * p):
        raise ValueError(f"context layout {layout!r}: sequence length {t} does not split into {n * p} pieces")
    length = t // (n * p)
    table = piece_table(layout, n).reshape(-1)  # array piece j holds row piece table[j]
    return (table[:, None] * length + np.arange(length)[None, :]).reshape(-1)


def to_layout(x: jax.Array, n: int, layout: str, axis: int = 1) -> jax.Array:
    """Row order -> the layout's array order along ``axis`` (a gather by :func:`layout_positions`)."""
    if pieces(layout) == 1:
        return x
    return jnp.take(x, jnp.asarray(layout_positions(x.shape[axis], n, layout)), axis=axis)


def from_layout(x: jax.Array, n: int, layout: str, axis: int = 1) -> jax.Array:
    """The layout's array order -> row order along ``axis`` (the inverse of :func:`to_layout`)."""
    if pieces(layout) == 1:
        return x
    return jnp.take(x, jnp.asarray(np.argsort(layout_positions(x.shape[axis], n, layout))), axis=axis)


def to_piece_rows(x_BT: jax.Array, p: int) -> jax.Array:
    """A shard's [B, Tl, ...] -> [B * P, Tl / P, ...] (row b's piece q at b * P + q)."""
    b, tl = x_BT.shape[:2]
    return x_BT.reshape((b * p, tl // p) + x_BT.shape[2:])


def from_piece_rows(x_RT: jax.Array, p: int) -> jax.Array:
    """[B * P, Tl / P, ...] -> [B, Tl, ...] (the inverse of :func:`to_piece_rows`)."""
    r, tp = x_RT.shape[:2]
    return x_RT.reshape((r // p, tp * p) + x_RT.shape[2:])


__all__ = ["LAYOUTS", "check_layout", "from_layout", "from_piece_rows", "layout_positions", "piece_table",
           "pieces", "row_order", "to_layout", "to_piece_rows"]
