"""The context mesh axis: its name (``CONTEXT_AXIS``, defined here only), its size under the current
mesh, the ``shard_map`` wrappers of a sequence-sharded body, and the moves of piece rows between shards
that every context-parallel op shares (the GDN scan, attention over shards, the model's conv halo).

A row of T tokens is split over the n shards of the axis into pieces (``layout``: one contiguous piece
per shard, or zigzag pieces i and 2n-1-i, :mod:`pallas_kernels.context.layout`); a shard holds its
pieces as rows [B * P, Tp, ...] (``to_piece_rows``). Everything here runs inside a ``shard_map``
manual over the axis unless it says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ..common import sharding
from .layout import piece_table, pieces, row_order

CONTEXT_AXIS = "context"


# ---------------------------------------------------------------------------------------------
# mesh helpers
def context_size(mesh=None, axis: str = CONTEXT_AXIS) -> int:
    """Size of the context axis of ``mesh`` (default: the one set by ``jax.set_mesh``); 1 when there
    is no mesh, no such axis, or the axis is already manual (we are inside its shard_map)."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", False) or axis not in getattr(mesh, "shape", {}):
        return 1
    if axis in set(getattr(mesh, "manual_axes", ())):
        return 1
    return int(mesh.shape[axis])


def over_context(body, in_specs: tuple, out_specs, *args, mesh=None, axis: str = CONTEXT_AXIS):
    """``shard_map(body)`` manual over ``axis`` only. ``check_vma=False``: the bodies mix per-shard
    and all-gathered values (their replicated outputs are equal on every shard by construction)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=frozenset({axis}), check_vma=False)(*args)


class RowSpecs(NamedTuple):
    """PartitionSpecs of a sequence-sharded layer's arrays: rows over ``batch`` axes, heads over
    ``heads`` axes, tokens over the context axis. ``tok`` [B, T], ``tok_h`` [B, T, H, ...] (also a
    head-major flat [B, T, H*d]), ``state`` [B, H, ...], ``per_head`` [H, ...], ``channel`` [K, H*d]."""
    tok: P
    tok_h: P
    state: P
    per_head: P
    channel: P


def row_specs(mesh, B: int, HK: int, batch_axes: Sequence[str] | None = None,
              head_axes: Sequence[str] | None = None, axis: str = CONTEXT_AXIS) -> RowSpecs:
    """The specs for rows of ``B`` over ``HK`` key heads (head axes must split the KEY heads: a
    device's value heads then read its own key heads). Axes as ``sharding.gdn_mesh_axes`` picks
    them (explicit, else the defaults), never ``axis`` itself."""
    drop = lambda axes: None if axes is None else tuple(a for a in axes if a != axis)  # noqa: E731
    b, h = sharding.gdn_mesh_axes(mesh, B, HK, drop(batch_axes), drop(head_axes))
    return RowSpecs(P(b, axis), P(b, axis, h), P(b, h), P(h), P(None, h))


def over_rows(body, in_specs: tuple, out_specs, *args, mesh=None):
    """``shard_map(body)`` manual over every mesh axis (``sharding.run_sharded``; specs from
    :func:`row_specs`). ``check_vma=False``: the bodies mix per-shard and all-gathered values (their
    context-replicated outputs are equal on every shard by construction)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    return sharding.run_sharded(body, mesh, in_specs, out_specs, *args)


def from_previous_shard(x_BT: jax.Array, n: int, axis: str = CONTEXT_AXIS) -> jax.Array:
    """The last ``n`` entries along axis 1 of the previous shard's ``x`` (zeros on shard 0): the halo
    exchange. Inside a shard_map manual over ``axis``; the shard must hold at least ``n`` entries."""
    if x_BT.shape[1] < n:
        raise ValueError(f"context shard of {x_BT.shape[1]} tokens is shorter than the {n}-token halo")
    size = lax.axis_size(axis)
    return lax.ppermute(x_BT[:, x_BT.shape[1] - n:], axis, [(j, j + 1) for j in range(size - 1)])


def in_row_order(x_RX: jax.Array, layout: str, axis: str = CONTEXT_AXIS) -> jax.Array:
    """Per piece row values [B * P, ...] of every shard, all-gathered and put in row order:
    [n * P, B, ...] (row-order piece r of every row b). The reorder is static slices concatenated
    (a gather by a constant index would transpose into a scatter-add in the backward)."""
    p = pieces(layout)
    every = lax.all_gather(x_RX, axis)  # [n, B * P, ...]
    if p == 1:
        return every
    n, b = every.shape[0], x_RX.shape[0] // p
    every = jnp.moveaxis(every.reshape((n, b, p) + x_RX.shape[1:]), 2, 1).reshape((n * p, b) + x_RX.shape[1:])
    return jnp.concatenate([every[j:j + 1] for j in row_order(layout, n)], axis=0)


def my_pieces(layout: str, axis: str) -> jax.Array:
    """[P] int32: the row-order indices of this shard's pieces."""
    return jnp.asarray(piece_table(layout, lax.axis_size(axis)), jnp.int32)[lax.axis_index(axis)]


def pick_pieces(rows_NBX: jax.Array, index_P: jax.Array) -> jax.Array:
    """Row-order values [n * P, B, ...] -> this shard's piece rows [B * P, ...] at ``index`` (one
    dynamic slice per piece: its transpose is an update of a slice, not a scatter-add)."""
    got = jnp.stack([lax.dynamic_index_in_dim(rows_NBX, i, axis=0, keepdims=False) for i in index_P], axis=1)
    return got.reshape((-1,) + got.shape[2:])  # [B, P, ...] -> [B * P, ...]


def from_previous_piece(x_RT: jax.Array, n: int, layout: str, axis: str = CONTEXT_AXIS) -> jax.Array:
    """For every piece row [B * P, Tp, ...]: the last ``n`` entries of the piece before it in the row
    (zeros for the row's first piece). One piece per shard: a ``ppermute`` from the previous shard;
    several: a gather of every piece's tail (n tokens each) put in row order."""
    if pieces(layout) == 1:
        return from_previous_shard(x_RT, n, axis)
    if x_RT.shape[1] < n:
        raise ValueError(f"context piece of {x_RT.shape[1]} tokens is shorter than the {n}-token halo")
    rows = in_row_order(x_RT[:, x_RT.shape[1] - n:], layout, axis)
    prev = pick_pieces(rows, jnp.maximum(my_pieces(layout, axis) - 1, 0))
    first = first_piece(x_RT.shape[0], layout, axis)
    return jnp.where(first.reshape((-1,) + (1,) * (prev.ndim - 1)), jnp.zeros_like(prev), prev)


def first_piece(rows: int, layout: str, axis: str = CONTEXT_AXIS) -> jax.Array:
    """[rows] bool over the piece rows [B * P]: the piece is its row's first."""
    mine = my_pieces(layout, axis)
    return jnp.tile(mine == 0, rows // mine.shape[0])


__all__ = [
    "CONTEXT_AXIS", "RowSpecs", "context_size", "first_piece", "from_previous_piece", "from_previous_shard",
    "in_row_order", "my_pieces", "over_context", "over_rows", "pick_pieces", "row_specs",
]
