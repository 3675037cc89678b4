"""Moving a context-sharded row between row order and a layout (zig-zag) by point-to-point
exchanges: each shard sends its pieces straight to the shards that hold them in the other order.

The plain :func:`pallas_kernels.context.layout.to_layout` is a gather along T; on a sequence-sharded
array XLA's partitioner may all-gather the whole row to every shard for it (n times the data). Here,
inside a ``shard_map`` manual over the mesh: shard s's block [B, Tl, ...] is cut into its P pieces,
and for each piece slot one ``ppermute`` moves one piece per shard (for zig-zag: the even row pieces
in one exchange, the odd ones in the other, each a full permutation of the shards); every shard
sends and receives Tl tokens in all. The backward of a ``ppermute`` is the reverse ``ppermute``, so
gradients take the same paths back.

Tables (numpy, static): a *move* h = (pairs (source, dest) shards, the slot each source sends, the
slot each dest writes); to the layout, source slot h of the contiguous block (row piece s P + h)
goes to where the layout keeps it; back to row order, the piece of parity h of each shard goes to
slot h of its row-order shard.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ..common import sharding
from .layout import check_layout, pieces, piece_table, to_layout as gather_to_layout
from .layout import from_layout as gather_from_layout
from .axis import CONTEXT_AXIS, context_size


class Move(NamedTuple):
    """One ``ppermute`` of one piece per shard."""

    pairs: tuple[tuple[int, int], ...]  # (source shard, dest shard), every shard once on each side
    send: np.ndarray                    # [n] slot (of P) each shard sends
    recv: np.ndarray                    # [n] slot (of P) each shard writes what it receives into


def moves(layout: str, n: int, inverse: bool = False) -> tuple[Move, ...]:
    """The exchanges that take a contiguous block of n shards to ``layout`` (``inverse``: back)."""
    p = pieces(check_layout(layout))
    table = piece_table(layout, n)  # [n, P] row piece at (shard, slot) of the layout
    where = {int(r): (s, q) for (s, q), r in np.ndenumerate(table)}
    out = []
    for h in range(p):
        send, recv, pairs = np.zeros(n, np.int64), np.zeros(n, np.int64), []
        for src in range(n):
            if not inverse:  # row piece src P + h, at slot h of shard src, goes where the layout keeps it
                dst, slot = where[src * p + h]
                send[src], recv[dst] = h, slot
            else:  # the piece of this shard whose row index is h mod P goes to slot h of its row-order shard
                slots = [q for q in range(p) if table[src, q] % p == h]
                if len(slots) != 1:
                    raise ValueError(f"context exchange: layout {layout!r} at n={n} gives shard {src} {len(slots)} "
                                     f"pieces of row index {h} mod {p}, not one")
                q = slots[0]
                dst = int(table[src, q]) // p
                send[src], recv[dst] = q, h
            pairs.append((src, dst))
        if sorted(d for _, d in pairs) != list(range(n)):
            raise ValueError(f"context exchange: layout {layout!r} at n={n} is not one piece per shard per move")
        out.append(Move(tuple(pairs), send, recv))
    return tuple(out)


def exchange_block(x_BTX: jax.Array, layout: str, inverse: bool, axis: str = CONTEXT_AXIS) -> jax.Array:
    """Inside a shard_map manual over ``axis``: this shard's block [B, Tl, ...] in row order -> its
    block in ``layout`` (``inverse``: the reverse)."""
    n, p = lax.axis_size(axis), pieces(layout)
    if p == 1:
        return x_BTX
    b, tl = x_BTX.shape[:2]
    me = lax.axis_index(axis)
    slots = jnp.moveaxis(x_BTX.reshape((b, p, tl // p) + x_BTX.shape[2:]), 1, 0)  # [P, B, Tl / P, ...]
    out = jnp.zeros_like(slots)
    for mv in moves(layout, n, inverse):
        got = lax.ppermute(jnp.take(slots, jnp.asarray(mv.send)[me], axis=0), axis, mv.pairs)
        out = lax.dynamic_update_index_in_dim(out, got, jnp.asarray(mv.recv)[me], axis=0)
    return jnp.moveaxis(out, 0, 1).reshape(x_BTX.shape)


def _exchange(x_BTX: jax.Array, layout: str, inverse: bool, mesh) -> jax.Array:
    n, p = context_size(mesh), pieces(layout)
    if p == 1 or n == 1:
        return x_BTX
    if x_BTX.shape[1] % (n * p):
        raise ValueError(f"context layout {layout!r}: sequence length {x_BTX.shape[1]} does not split into {n * p} "
                         "pieces")
    b_axes, _ = sharding.gdn_mesh_axes(mesh, x_BTX.shape[0], 1)
    spec = P(b_axes, CONTEXT_AXIS, *([None] * (x_BTX.ndim - 2)))
    return sharding.run_sharded(lambda x: exchange_block(x, layout, inverse), mesh, (spec,), spec, x_BTX)


def to_layout(x_BTX: jax.Array, n: int, layout: str, mesh=None) -> jax.Array:
    """Row order -> ``layout`` along dim 1 of [B, T, ...] split over n context shards: the exchange
    under a mesh whose context axis is n, else the plain gather (``context_layout.to_layout``)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if context_size(mesh) != n:
        return gather_to_layout(x_BTX, n, layout)
    return _exchange(x_BTX, layout, False, mesh)


def from_layout(x_BTX: jax.Array, n: int, layout: str, mesh=None) -> jax.Array:
    """The inverse of :func:`to_layout`."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if context_size(mesh) != n:
        return gather_from_layout(x_BTX, n, layout)
    return _exchange(x_BTX, layout, True, mesh)


__all__ = ["Move", "exchange_block", "from_layout", "moves", "to_layout"]
