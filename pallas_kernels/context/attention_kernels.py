"""The attention kernels (splash on TPU, flash on GPU) on one shard of a sequence-sharded row: the
static per-shard layout that lets the one-device kernels run unchanged but for an offset.

Shard i of n holds Tl tokens (global slots [i Tl, (i + 1) Tl)). Per shard, all inside one
``shard_map`` manual over ``context`` and the batch / head axes (kernels cannot be auto-partitioned):

1. pad the shard's q, K/V and segment ids to Tp slots (whole kernel tiles, a multiple of the block;
   pad id ``LANE_PAD_SEGMENT``), BEFORE the all-gather, so the gathered clean keys [n Tp] are the
   shards' padded pieces in row order;
2. all-gather the clean K/V and ids over ``context`` and roll them by (i + 1) Tp so the shard's own
   piece comes last: [pieces i+1 .. n-1 | pieces 0 .. i-1 | piece i]; the first n - 1 - i pieces
   (future keys) get the id ``FUTURE_SEGMENT``, which no query holds;
3. now the shard's Tp queries are the last Tp of P + Tp clean keys, P = (n - 1) Tp, the same for
   every shard (static): the clean stream is the causal mask shifted by P (splash ``CausalMask``
   offset P, flash ``q_offset`` P), the noisy stream runs over [rolled clean keys || the shard's own
   noisy keys] with the block mask after a visible prefix of P clean keys. The noisy K/V never
   travel (a noisy key is seen only inside its block; no block straddles two shards).

Why it equals the one-device row: softmax is a function of the SET of visible keys, not of their
order. Past pieces keep their relative order and stay before the queries' own piece, so "key slot
<= query slot" and "key before the query's block start" hold exactly as on the global slots; future
keys are removed by their id; padded slots carry the pad id (each pad query sees itself). Tl and Tp
are multiples of the block, so blocks on the padded grid are the row's blocks.

Cost: splash skips tiles by the static mask only, so every shard runs its [Tp, P] prefix tiles
(future ones masked by id): n Tp x (n - 1) Tp + one causal Tp x Tp per shard, about twice the causal
work of the row (the reference per shard computes the same dense [Tl, T]); flash skips by the
document extents too, so it does not visit future keys nor keys before the query's document.
Gradients flow back through the roll and the all-gather (a reduce-scatter of dK, dV).

Under the zig-zag layout (``model.context_layout``: shard i holds row pieces i and 2n - 1 - i) splash
takes another road: the shard's two pieces are one query row over the row's keys in ROW order
(no roll), and the kernel's block tables are this shard's, picked at run time from tables built for
every shard (:mod:`pallas_kernels.context.splash_rows`): every shard runs the same ~causal share of
tiles, about half of the contiguous layout's. Flash runs the two pieces as rows with their own
rolled keys (``rolled_piece_keys``; it skips by document extent anyway).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ..common import sharding
from ..attention.flash import flash_core
from ..attention.flash_calls import FlashConfig
from ..attention.inputs import LANE_PAD_SEGMENT, pad_rows
from ..attention.splash import LANES, splash_core
from .splash_rows import shard_kernel
from .layout import from_piece_rows, pieces, to_piece_rows
from .axis import CONTEXT_AXIS, context_size, in_row_order, my_pieces

#: id of the keys of later shards after the roll: matches no query (documents and pads use ids >= -1,
#: the tile padding LANE_PAD_SEGMENT)
FUTURE_SEGMENT = LANE_PAD_SEGMENT - 1
KERNEL_BACKENDS = ("splash", "flash")


def shard_tile(backend: str, block_size: int, dtype, config: FlashConfig | None = None) -> int:
    """Each shard's piece is padded to a multiple of this: the kernel's tiles and the block."""
    if backend == "splash":
        return math.lcm(LANES, block_size)
    return dataclasses.replace(config or FlashConfig.for_dtype(dtype), block_size=block_size).tile_multiple()


def rolled_clean_keys(k_BTKD, v_BTKD, seg_BT, axis: str = CONTEXT_AXIS):
    """Inside a shard_map manual over ``axis``: the shard's padded clean K/V [B, Tp, K, D] and ids
    [B, Tp] -> the row's, gathered and rolled so this shard's piece is last, future pieces' ids set to
    ``FUTURE_SEGMENT`` ([B, n Tp, K, D] x2, [B, n Tp])."""
    n, i, tp = lax.axis_size(axis), lax.axis_index(axis), seg_BT.shape[1]
    start = ((i + 1) % n) * tp  # the gathered row read from here (cyclically) ends with piece i

    def roll(x):
        x = lax.all_gather(x, axis, axis=1, tiled=True)
        return lax.dynamic_slice_in_dim(jnp.concatenate([x, x], axis=1), start, n * tp, axis=1)

    seg = roll(seg_BT)
    future = jnp.arange(n * tp, dtype=jnp.int32) < (n - 1 - i) * tp
    return roll(k_BTKD), roll(v_BTKD), jnp.where(future[None, :], FUTURE_SEGMENT, seg)


def keys_in_row_order(x_RTX: jax.Array, layout: str, axis: str = CONTEXT_AXIS) -> jax.Array:
    """Inside a shard_map manual over ``axis``: the shard's padded piece rows [B * P, Tp, ...] ->
    every shard's, all-gathered, as the row in row order [B, m Tp, ...] (m = n P pieces)."""
    rows = in_row_order(x_RTX, layout, axis)  # [m, B, Tp, ...]
    return jnp.moveaxis(rows, 0, 1).reshape((rows.shape[1], rows.shape[0] * rows.shape[2]) + rows.shape[3:])


def rolled_piece_keys(k_RTKD, v_RTKD, seg_RT, layout: str, axis: str = CONTEXT_AXIS):
    """``rolled_clean_keys`` for a layout with P pieces per shard: the shard's padded piece rows
    [B * P, Tp, K, D] -> for every piece row, the row's pieces in row order rolled so that piece comes
    last, the pieces after it in the row given ``FUTURE_SEGMENT`` ([B * P, n P Tp, K, D] x2,
    [B * P, n P Tp]). Each piece row gets its own copy of the gathered keys (P copies per shard)."""
    p, tp = pieces(layout), seg_RT.shape[1]
    m = lax.axis_size(axis) * p
    mine = my_pieces(layout, axis)  # [P] row-order indices of this shard's pieces

    def roll(x):
        row = keys_in_row_order(x, layout, axis)
        both = jnp.concatenate([row, row], axis=1)
        out = [lax.dynamic_slice_in_dim(both, ((mine[j] + 1) % m) * tp, m * tp, axis=1) for j in range(p)]
        return jnp.stack(out, axis=1).reshape((-1, m * tp) + x.shape[2:])  # piece row b * P + j

    future = jnp.arange(m * tp, dtype=jnp.int32)[None, :] < ((m - 1 - mine) * tp)[:, None]  # [P, m Tp]
    future = jnp.tile(future, (seg_RT.shape[0] // p, 1))
    return roll(k_RTKD), roll(v_RTKD), jnp.where(future, FUTURE_SEGMENT, roll(seg_RT))


def _on_device(backend: str, stream: str, q, k, v, q_seg, kv_seg, block_size: int, prefix: int,
               interpret: bool | None, config: FlashConfig | None):
    """One stream's kernel on one device's padded blocks, its queries after ``prefix`` clean keys."""
    if backend == "splash":
        return splash_core(q, k, v, q_seg, kv_seg, stream=stream, block_size=block_size, interpret=interpret,
                           prefix=prefix)
    cfg = dataclasses.replace(config or FlashConfig.for_dtype(q.dtype), stream=stream, scale=q.shape[-1] ** -0.5,
                              block_size=block_size, q_offset=prefix)
    return flash_core(q, k, v, q_seg, kv_seg, cfg=cfg, interpret=interpret)


def _splash_in_row_order(streams: tuple[str, ...], qs, kv, q_seg, tl: int, block_size: int, layout: str,
                         interpret: bool | None, axis: str) -> tuple[jax.Array, ...]:
    """Splash under a layout of P > 1 pieces per shard: the shard's padded piece rows (q [B * P, Tp,
    H, D] per stream, kv, q_seg [B * P, Tp]) run as ONE query row [B, P Tp] at their row slots over
    the row's clean keys in row order, with this shard's block tables
    (:mod:`pallas_kernels.context.splash_rows`), so it runs only the tiles its queries see.
    Returns [B, P tl, H, D] per stream (pads dropped)."""
    npc, tp = pieces(layout), q_seg.shape[1]
    n, shard = lax.axis_size(axis), lax.axis_index(axis)
    k, v, kv_seg = (keys_in_row_order(x, layout, axis) for x in (kv[0], kv[1], q_seg))
    join = lambda x: from_piece_rows(x, npc)  # noqa: E731  [B * P, Tp, ...] -> [B, P Tp, ...]
    cat = lambda a, b: jnp.concatenate([a, b], axis=1)  # noqa: E731
    own_seg, outs = join(q_seg), []
    for stream, q in zip(streams, qs):
        block = block_size if stream == "noisy" else 1
        make = functools.partial(shard_kernel, stream, layout, n, tp, block)
        if stream == "clean":
            out = splash_core(join(q), k, v, own_seg, kv_seg, shard, stream="clean", block_size=1,
                              interpret=interpret, make_kernel=make)
        else:  # [the row's clean keys || the shard's own noisy keys, in its query order]
            out = splash_core(join(q), cat(k, join(kv[2])), cat(v, join(kv[3])), own_seg, cat(kv_seg, own_seg),
                              shard, stream="noisy", block_size=block, interpret=interpret, make_kernel=make)
        outs.append(join(to_piece_rows(out, npc)[:, :tl]))
    return tuple(outs)


def _shard_body(streams: tuple[str, ...], block_size: int, backend: str, tp: int, interpret: bool | None,
                config: FlashConfig | None, axis: str, layout: str = "contiguous"):
    """Per-device body of one or both streams over ONE exchange of the clean K/V: args = one q per
    stream of ``streams`` (clean first), kc, vc, (kn, vn if the noisy stream runs), seg: the shard's
    [B, Tl] blocks -> one [B, Tl, H, D] per stream. With both streams the gathered K/V feed both
    kernels, so their dK / dV are summed on the chip before the one reduce-scatter back. A layout of
    P pieces per shard runs splash on the keys in row order with per-shard tables
    (``_splash_in_row_order``) and flash on the pieces as rows, each with its own rolled keys
    (``rolled_piece_keys``), so each piece's queries sit after a static prefix."""
    npc = pieces(layout)

    def body(*args):
        qs, kv, seg = args[:len(streams)], args[len(streams):-1], args[-1]
        qs, kv, seg = [to_piece_rows(q, npc) for q in qs], [to_piece_rows(x, npc) for x in kv], to_piece_rows(seg, npc)
        tl = seg.shape[1]
        qs, kv = [pad_rows(q, tp) for q in qs], [pad_rows(x, tp) for x in kv]
        q_seg = pad_rows(seg, tp, LANE_PAD_SEGMENT)
        if backend == "splash" and npc > 1:
            return _splash_in_row_order(streams, qs, kv, q_seg, tl, block_size, layout, interpret, axis)
        if npc == 1:  # the contiguous path as measured (tiled all-gather, bench/context.py)
            k, v, kv_seg = rolled_clean_keys(kv[0], kv[1], q_seg, axis)
        else:
            k, v, kv_seg = rolled_piece_keys(kv[0], kv[1], q_seg, layout, axis)
        prefix = k.shape[1] - tp
        outs = []
        for stream, q in zip(streams, qs):
            if stream == "clean":
                out = _on_device(backend, "clean", q, k, v, q_seg, kv_seg, 1, prefix, interpret, config)
            else:  # [rolled clean keys || the shard's own noisy keys]
                cat = lambda a, b: jnp.concatenate([a, b], axis=1)  # noqa: E731
                out = _on_device(backend, "noisy", q, cat(k, kv[2]), cat(v, kv[3]), q_seg, cat(kv_seg, q_seg),
                                 block_size, prefix, interpret, config)
            outs.append(from_piece_rows(out[:, :tl], npc))
        return tuple(outs)

    return body


def context_kernel_attention(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, *, stream: str, block_size: int,
                             backend: str, **kw) -> jax.Array:
    """One training stream through ``backend`` ("splash" or "flash") with T sharded over the context
    axis (``context.attention.context_stream_attention`` checks the shapes and the split). Shapes as
    ``stream_attention``: q [B, T, H, D]; k, v [B, T] clean or [B, 2T] = clean || noisy keys. ``kw``:
    as :func:`sharded_stream_attention`."""
    t = segment_ids_BT.shape[1]
    if stream == "clean":
        return sharded_stream_attention(q_BTHD, None, k_BSKD, v_BSKD, segment_ids_BT, backend=backend, **kw)[0]
    return sharded_stream_attention(None, q_BTHD, k_BSKD[:, :t], v_BSKD[:, :t], segment_ids_BT, backend=backend,
                                    block_size=block_size, noisy_kv=(k_BSKD[:, t:], v_BSKD[:, t:]), **kw)[1]


def sharded_stream_attention(q_clean_BTHD, q_noisy_BTHD, kc_BTKD, vc_BTKD, segment_ids_BT, *, backend: str,
                             block_size: int = 1, noisy_kv: tuple[jax.Array, jax.Array] | None = None,
                             interpret: bool | None = None, mesh=None, batch_axes: Sequence[str] | None = None,
                             head_axes: Sequence[str] | None = None, config: FlashConfig | None = None,
                             axis: str = CONTEXT_AXIS, layout: str = "contiguous"
                             ) -> tuple[jax.Array | None, jax.Array | None]:
    """The kernel path of the clean stream (``q_clean`` [B, T, H, D], else None), the noisy stream
    (``q_noisy`` and ``noisy_kv`` = (kn, vn) [B, T, K, D], else None) or both over one exchange, the
    clean K/V ``kc``, ``vc`` [B, T, K, D]. Every array is sharded over ``axis`` like the queries, so
    a shard's clean and noisy pieces are local (no resharding of a [B, 2T] layout). Batch and KV-head
    mesh axes as for the one-device kernels (``sharding.gdn_mesh_axes``). Returns (clean out,
    noisy out), [B, T, H, D] each or None."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"context attention: backend {backend!r} is not one of {KERNEL_BACKENDS}")
    if (q_noisy_BTHD is None) != (noisy_kv is None):
        raise ValueError("context attention: the noisy stream needs both q_noisy and noisy_kv = (kn, vn)")
    streams = tuple(n for n, q in (("clean", q_clean_BTHD), ("noisy", q_noisy_BTHD)) if q is not None)
    if not streams:
        raise ValueError("context attention: neither q_clean nor q_noisy given")
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    b, t = segment_ids_BT.shape
    tl = t // (context_size(mesh, axis) * pieces(layout))  # one piece's tokens
    block = block_size if "noisy" in streams else 1
    qs = tuple(q for q in (q_clean_BTHD, q_noisy_BTHD) if q is not None)
    mult = shard_tile(backend, block, qs[0].dtype, config)
    body = _shard_body(streams, block, backend, -(-tl // mult) * mult, interpret, config, axis, layout)
    b_axes, h_axes = sharding.gdn_mesh_axes(mesh, b, kc_BTKD.shape[2], batch_axes, head_axes)
    tok4, tok2 = P(b_axes, axis, h_axes, None), P(b_axes, axis)
    kv = (kc_BTKD, vc_BTKD) + (tuple(noisy_kv) if noisy_kv is not None else ())
    outs = iter(sharding.run_sharded(body, mesh, (tok4,) * (len(qs) + len(kv)) + (tok2,), (tok4,) * len(qs),
                                         *qs, *kv, segment_ids_BT.astype(jnp.int32)))
    return tuple(next(outs) if name in streams else None for name in ("clean", "noisy"))


__all__ = ["FUTURE_SEGMENT", "context_kernel_attention", "rolled_clean_keys", "shard_tile", "sharded_stream_attention"]
