"""Attention of the two training streams over a sequence-sharded row (context parallelism).

Each device of the ``context`` axis holds the queries of one contiguous shard of the row (shard i =
slots [i*Tl, (i+1)*Tl)). K/V are exchanged by an all-gather over the axis (the simplest correct
exchange; a ring with ``ppermute`` overlapping compute is the next step):

- clean stream: the shard's queries over the gathered clean keys [T], token-causal within the
  document, by GLOBAL slots (``causal_segment_mask`` with the shard's slot offset);
- noisy stream: the shard's noisy queries over the gathered CLEAN keys [T] and the shard's own
  NOISY keys [Tl] only: a noisy key is visible only inside the query's block and no block straddles
  two shards, so the noisy K/V never travel.

The masks compare ROW positions (``_slots``), so the same bodies serve any ``context_layout``: with
zigzag, a shard's queries are row pieces i and 2n-1-i and the gathered keys come in array order.

Per shard the core is the jnp reference ``attend`` (dense [Tl, T] scores: 1/n of the one-device
row) with ``backend="reference"``, or the splash / flash kernel on a static per-shard layout
(:mod:`pallas_kernels.context.attention_kernels`). Gradients flow back through the all-gather (a
reduce-scatter of dK, dV).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from .attention_kernels import context_kernel_attention, sharded_stream_attention
from ..attention.reference import attend, causal_segment_mask, noisy_query_mask
from .layout import layout_positions, pieces
from .axis import CONTEXT_AXIS, context_size, over_context

_TOK4, _TOK2 = P(None, CONTEXT_AXIS, None, None), P(None, CONTEXT_AXIS)


def _gather(x: jax.Array, axis: str) -> jax.Array:
    return lax.all_gather(x, axis, axis=1, tiled=True)


def _slots(b: int, tl: int, layout: str, axis: str) -> tuple[jax.Array, jax.Array]:
    """Row positions of the shard's tokens [B, Tl] and of the gathered row [B, T] (the layout's
    order: identity for contiguous shards). The masks compare these, so any layout is exact."""
    n = lax.axis_size(axis)
    pos = jnp.asarray(layout_positions(n * tl, n, layout), jnp.int32)
    mine = lax.dynamic_slice_in_dim(pos, lax.axis_index(axis) * tl, tl)
    return jnp.broadcast_to(mine, (b, tl)), jnp.broadcast_to(pos, (b, n * tl))


def shard_clean_attention(q_BTHD, k_BTKD, v_BTKD, seg_BT, axis: str = CONTEXT_AXIS,
                          layout: str = "contiguous") -> jax.Array:
    """Per-shard body (inside a shard_map manual over ``axis``): [B, Tl, H, D] clean-stream output."""
    b, tl = seg_BT.shape
    k_all, v_all, seg_all = (_gather(x, axis) for x in (k_BTKD, v_BTKD, seg_BT))
    q_slot, k_slot = _slots(b, tl, layout, axis)
    return attend(q_BTHD, k_all, v_all, causal_segment_mask(q_slot, seg_BT, k_slot, seg_all))


def shard_noisy_attention(q_BTHD, kc_BTKD, vc_BTKD, kn_BTKD, vn_BTKD, seg_BT, block_size: int,
                          axis: str = CONTEXT_AXIS, layout: str = "contiguous") -> jax.Array:
    """Per-shard body: noisy queries [B, Tl] over gathered clean keys [T] || local noisy keys [Tl]
    with the block rule (``noisy_query_mask``). Every piece of the layout is a whole number of
    blocks, so a block's tokens are contiguous row positions inside one shard."""
    b, tl = seg_BT.shape
    if tl % block_size:
        raise ValueError(f"context shard of {tl} tokens is not a multiple of block_size {block_size}")
    kc_all, vc_all, seg_all = (_gather(x, axis) for x in (kc_BTKD, vc_BTKD, seg_BT))
    t = seg_all.shape[1]
    slot_l, slot_all = _slots(b, tl, layout, axis)
    start = lambda s: s - s % block_size  # noqa: E731
    k_slot = jnp.concatenate([slot_all, slot_l], axis=1)
    mask = noisy_query_mask(start(slot_l), seg_BT, k_slot, jnp.concatenate([seg_all, seg_BT], axis=1),
                            start(k_slot), jnp.arange(t + tl) >= t)
    return attend(q_BTHD, jnp.concatenate([kc_all, kn_BTKD], axis=1), jnp.concatenate([vc_all, vn_BTKD], axis=1),
                  mask)


def _check_split(t: int, block_size: int, mesh, layout: str = "contiguous") -> None:
    n = context_size(mesh)
    m = n * pieces(layout)
    if t % m or (t // m) % block_size:
        raise ValueError(f"attention context parallelism: sequence length {t} must split into {m} pieces ({layout} "
                         f"layout over mesh.context={n}) whose length is a multiple of block_size {block_size}")


def context_two_stream_attention(q_c_BTHD, q_n_BTHD, k_c_BTKD, k_n_BTKD, v_c_BTKD, v_n_BTKD, segment_ids_BT, *,
                                 block_size: int, backend: str, mesh=None, layout: str = "contiguous",
                                 **kernel_kw) -> tuple[jax.Array, jax.Array]:
    """Both training streams with T sharded over ``context``: each stream's q, k, v [B, T, *] ->
    (clean, noisy) outputs [B, T, H, D]. A kernel backend runs both streams in one shard_map over ONE
    exchange of the clean K/V (one all-gather; the two streams' dK / dV summed before one
    reduce-scatter); the reference runs the two streams apart."""
    t = segment_ids_BT.shape[1]
    if any(a.shape[1] != t for a in (q_c_BTHD, q_n_BTHD, k_c_BTKD, k_n_BTKD, v_c_BTKD, v_n_BTKD)):
        raise ValueError(f"two-stream attention: every stream's q, k, v must be [B, T] for T={t}, got "
                         f"q {q_c_BTHD.shape} / {q_n_BTHD.shape}, k {k_c_BTKD.shape} / {k_n_BTKD.shape}")
    _check_split(t, block_size, mesh, layout)
    if backend == "reference":
        seg = segment_ids_BT.astype(jnp.int32)
        clean = lambda q, k, v, s: shard_clean_attention(q, k, v, s, layout=layout)  # noqa: E731
        out_c = over_context(clean, (_TOK4, _TOK4, _TOK4, _TOK2), _TOK4, q_c_BTHD, k_c_BTKD, v_c_BTKD, seg, mesh=mesh)
        return out_c, _reference_noisy(q_n_BTHD, k_c_BTKD, v_c_BTKD, k_n_BTKD, v_n_BTKD, seg, block_size, mesh, layout)
    return sharded_stream_attention(q_c_BTHD, q_n_BTHD, k_c_BTKD, v_c_BTKD, segment_ids_BT, backend=backend,
                                    block_size=block_size, noisy_kv=(k_n_BTKD, v_n_BTKD), mesh=mesh, layout=layout,
                                    **kernel_kw)


def _reference_noisy(q_BTHD, kc_BTKD, vc_BTKD, kn_BTKD, vn_BTKD, seg_BT, block_size: int, mesh,
                     layout: str = "contiguous") -> jax.Array:
    """The reference noisy stream over context shards: [B, T, H, D]."""
    body = lambda q, kc, vc, kn, vn, s: shard_noisy_attention(q, kc, vc, kn, vn, s, block_size,  # noqa: E731
                                                              layout=layout)
    return over_context(body, (_TOK4,) * 5 + (_TOK2,), _TOK4, q_BTHD, kc_BTKD, vc_BTKD, kn_BTKD, vn_BTKD, seg_BT,
                        mesh=mesh)


def context_stream_attention(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, *, stream: str, block_size: int = 1,
                             mesh=None, backend: str = "reference", layout: str = "contiguous",
                             **kernel_kw) -> jax.Array:
    """``stream_attention`` with T sharded over the ``context`` axis. Clean: q, k, v [B, T, *];
    noisy: q [B, T], k, v [B, 2T] = clean || noisy keys. Returns [B, T, H, D]. ``backend``: a
    resolved one ("reference", "splash", "flash"); ``kernel_kw`` (interpret, batch_axes, head_axes,
    config) go to the kernel path. ``layout``: the context layout of every [B, T] array
    (``context_layout``)."""
    t = segment_ids_BT.shape[1]
    _check_split(t, block_size, mesh, layout)
    if stream not in ("clean", "noisy"):
        raise ValueError(f"unknown attention stream {stream!r}; expected 'clean' or 'noisy'")
    if stream == "noisy" and k_BSKD.shape[1] != 2 * t:
        raise ValueError(f"noisy stream: keys must be [B, 2T] = clean || noisy, got {k_BSKD.shape} for T={t}")
    if backend != "reference":
        return context_kernel_attention(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, stream=stream, block_size=block_size,
                                        backend=backend, mesh=mesh, layout=layout, **kernel_kw)
    seg = segment_ids_BT.astype(jnp.int32)
    if stream == "clean":
        clean = lambda q, k, v, s: shard_clean_attention(q, k, v, s, layout=layout)  # noqa: E731
        return over_context(clean, (_TOK4, _TOK4, _TOK4, _TOK2), _TOK4, q_BTHD, k_BSKD, v_BSKD, seg, mesh=mesh)
    return _reference_noisy(q_BTHD, k_BSKD[:, :t], v_BSKD[:, :t], k_BSKD[:, t:], v_BSKD[:, t:], seg, block_size, mesh,
                            layout)


__all__ = ["context_stream_attention", "context_two_stream_attention", "shard_clean_attention", "shard_noisy_attention"]
