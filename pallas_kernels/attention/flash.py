"""The two training streams through our flash-attention kernel for GPUs (Pallas, Triton form):
the wrapper (padding, document extents, ``custom_vjp``, platform choice, ``shard_map``). The kernels
and the mask rule are in :mod:`pallas_kernels.attention.flash_calls`.

- Forward: one kernel -> out and the (base-2) logsumexp, saved for the backward with q, k, v, out.
- Backward: delta = rowsum(out * dO) in XLA, then a dq kernel (per query tile, over its key tiles)
  and a dk/dv kernel (per key tile and KV head, over the query tiles of its G query heads).
- Layout: the model's [B, T, H, D] and [B, S, K, D] go in as they are (no transposes, no repeat of
  the KV heads). T is padded to whole tiles (each half of the noisy keys separately, so the clean /
  noisy split stays at the padded length) with a segment id no document uses; each pad query still
  sees itself. D is padded with zeros to a power of two >= 16 (Triton's dot); scores are unchanged.
- Platform: ``interpret=None`` lowers the Triton kernels for CUDA / ROCm and runs the same kernels
  in the Pallas interpreter elsewhere, chosen at lowering time (``lax.platform_dependent``), so a
  CUDA lowering from a CPU host gets the real kernels while CPU tests interpret them. (On TPU the
  dispatch uses splash instead.)
- Under a multi-device mesh the kernels run in ``shard_map`` over batch and KV-head groups
  (:mod:`pallas_kernels.common.sharding`); T stays whole on every device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ..common import sharding
from .flash_calls import FlashConfig, Stream, backward_calls, forward_call
from .inputs import check_stream_inputs, pad_stream_rows

f32 = jnp.float32


def doc_extents(seg_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first, last) [B, T] int32: the first and the last slot holding each slot's segment id (exact
    for any id layout, not only contiguous documents: a stable sort groups equal ids)."""
    b, t = seg_BT.shape
    order = jnp.argsort(seg_BT, axis=1, stable=True)
    srt = jnp.take_along_axis(seg_BT, order, axis=1)
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    change = srt[:, 1:] != srt[:, :-1]
    ones = jnp.ones((b, 1), bool)
    first_pos = lax.cummax(jnp.where(jnp.concatenate([ones, change], 1), idx, 0), axis=1)
    last_pos = lax.cummin(jnp.where(jnp.concatenate([change, ones], 1), idx, t - 1), axis=1, reverse=True)
    inv = jnp.argsort(order, axis=1)
    back = lambda pos: jnp.take_along_axis(jnp.take_along_axis(order, pos, 1), inv, 1).astype(jnp.int32)  # noqa: E731
    return back(first_pos), back(last_pos)


def _select(call, mode: bool | None, *args):
    """``call(*args, interpret=...)``: forced by ``mode``, else Triton on CUDA / ROCm and the
    interpreter on every other platform (at lowering time)."""
    if mode is not None:
        return call(*args, interpret=mode)
    native = lambda *a: call(*a, interpret=False)  # noqa: E731
    return lax.platform_dependent(*args, cuda=native, rocm=native, default=lambda *a: call(*a, interpret=True))


def _core(cfg: FlashConfig, mode: bool | None):
    """The differentiable per-device core: (q, k, v, q_seg, kv_seg, q_first, kv_last) -> out."""

    def fwd_call(q, k, v, q_seg, kv_seg, q_first, *, interpret):
        return tuple(forward_call(q, k, v, q_seg, kv_seg, q_first, cfg=cfg, interpret=interpret))

    def bwd_call(*args, interpret):
        return tuple(backward_calls(*args, cfg=cfg, interpret=interpret))

    @jax.custom_vjp
    def core(q, k, v, q_seg, kv_seg, q_first, kv_last):
        return _select(fwd_call, mode, q, k, v, q_seg, kv_seg, q_first)[0]

    def core_fwd(q, k, v, q_seg, kv_seg, q_first, kv_last):
        out, lse = _select(fwd_call, mode, q, k, v, q_seg, kv_seg, q_first)
        return out, (q, k, v, out, lse, q_seg, kv_seg, q_first, kv_last)

    def core_bwd(res, do):
        q, k, v, out, lse, q_seg, kv_seg, q_first, kv_last = res
        delta = jnp.einsum("bthd,bthd->bht", out.astype(f32), do.astype(f32))
        dq, dk, dv = _select(bwd_call, mode, q, k, v, do.astype(q.dtype), lse, delta, q_seg, kv_seg, q_first,
                             kv_last)
        return dq, dk, dv, None, None, None, None

    core.defvjp(core_fwd, core_bwd)
    return core


def flash_core(q, k, v, q_seg, kv_seg, *, cfg: FlashConfig, interpret: bool | None):
    """The kernels on one device's whole-tile blocks: q [B, Tq, H, D]; k, v [B, S, K, D] with the
    Tq queries after ``cfg.q_offset`` = O clean keys, S = O + Tq (clean) or O + 2 Tq (noisy: the
    queries' noisy keys last); q_seg [B, Tq], kv_seg [B, S] int32 (the queries' ids are kv_seg's at
    [O, O + Tq)). Pads D for Triton's dots and derives the document extents from the clean keys'
    ids. Returns [B, Tq, H, D]."""
    d, tq, off = q.shape[-1], q.shape[1], cfg.q_offset
    dp = max(16, 1 << (d - 1).bit_length())
    q, k, v = (jnp.pad(x, ((0, 0),) * 3 + ((0, dp - d),)) for x in (q, k, v))
    first, last = doc_extents(kv_seg[:, :off + tq])
    kv_last = last if cfg.stream == "clean" else jnp.concatenate([last, last[:, off:]], axis=1)
    return _core(cfg, interpret)(q, k.astype(q.dtype), v.astype(q.dtype), q_seg, kv_seg, first[:, off:],
                                 kv_last)[..., :d]


def flash_attention(
    q_BTHD: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    segment_ids_BT: jax.Array,
    *,
    stream: Stream,
    block_size: int = 1,
    interpret: bool | None = None,
    mesh=None,
    batch_axes: Sequence[str] | None = None,
    head_axes: Sequence[str] | None = None,
    config: FlashConfig | None = None,
) -> jax.Array:
    """One training stream's attention core through the flash kernel (same contract as
    ``attention.splash.splash_attention``).

    Args:
        q_BTHD: [B, T, H, D] rotated queries (unscaled; the D^-0.5 scale is applied in the kernel).
        k_BSKD, v_BSKD: [B, S, K, D]; S = T for ``stream="clean"``, 2T (clean || noisy slots) for
            ``"noisy"``. H must be a multiple of K.
        segment_ids_BT: [B, T] int document ids (the noisy slots share them).
        block_size: the noisy stream's row-grid block (T must be a multiple); unused for "clean".
        interpret: None = Triton on GPU, the interpreter elsewhere; True / False force one.
        mesh, batch_axes, head_axes: as for the GDN kernels; the head axes must divide K.
        config: tiles and launch parameters (default ``FlashConfig.for_dtype(q.dtype)``; its stream /
            block / scale are set here).

    Returns:
        [B, T, H, D] in q's dtype (fp32 softmax statistics and accumulation).
    """
    b, t, h, d = q_BTHD.shape
    kv = k_BSKD.shape[2]
    check_stream_inputs("flash_attention", q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, stream, block_size)
    cfg = dataclasses.replace(config or FlashConfig.for_dtype(q_BTHD.dtype), stream=stream, scale=d ** -0.5,
                              block_size=block_size if stream == "noisy" else 1)
    mult = cfg.tile_multiple()
    args = pad_stream_rows(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, stream, -(-t // mult) * mult)
    core = lambda *a: flash_core(*a, cfg=cfg, interpret=interpret)  # noqa: E731
    mesh = sharding.active_mesh(mesh)
    if mesh is None:
        out = core(*args)
    else:
        b_axes, h_axes = sharding.gdn_mesh_axes(mesh, b, kv, batch_axes, head_axes)
        heads, rows = P(b_axes, None, h_axes, None), P(b_axes)
        out = sharding.run_sharded(core, mesh, (heads, heads, heads, rows, rows), heads, *args)
    return out[:, :t]
