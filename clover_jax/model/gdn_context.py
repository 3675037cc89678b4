"""The GDN layer over a sequence-sharded row (context parallelism, `pallas_kernels.context.split`).

`GatedDeltaNet.__call__` (no cache) and `GatedDeltaNet.two_stream` hand over here when the active
mesh has a `context` axis > 1. Projections and the output stay outside (token-wise, partitioned by
XLA); the sequence mixing runs per shard in one `shard_map` manual over every mesh axis
(`pallas_kernels.context.axis.over_rows`): rows over the axes THE rule table gives `batch`, key and
value heads over those of `act_heads` (the conv channels and taps with them), tokens over `context`.

- conv halo: the K-1 pre-conv clean inputs before each piece of the row the shard holds (and their
  segment ids) come from the piece before it (`pallas_kernels.context.axis.from_previous_piece`: the
  previous shard by `ppermute` for contiguous shards; for the zigzag layout, whose shards hold two
  pieces each, from the pieces' tails gathered in row order); the row's first piece gets the empty
  ring of the one-device run. The conv masks
  taps by segment as on one device, so a document start at (or just after) a shard boundary reads
  nothing of the document before it. The noisy stream's block rings read the same halo.
- recurrence: `pallas_kernels.context.gdn_scan` (affine shard maps, scanned across the axis), each shard
  through the GDN dispatch with the configured `gdn_backend`, key heads grouped.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from clover_jax.model.gdn_conv import CONV_PARTS, block_rings
from clover_jax.parallel import sharding as sh
from pallas_kernels.context.layout import from_piece_rows, pieces, to_piece_rows
from pallas_kernels.context.axis import CONTEXT_AXIS, RowSpecs, first_piece, from_previous_piece, over_rows, row_specs
from pallas_kernels.context.gdn_scan import shard_block_gdn, shard_chunk_gdn
from pallas_kernels.context.stream_layout import join_streams, split_streams


def _halo(parts: dict[str, jax.Array], seg_RT: jax.Array, lring: int, empty_segment: int, layout: str):
    """For every piece row [B * P, Tp] of the shard: ({part: the last L pre-conv inputs of the piece
    before it in the row [B * P, L, C]}, their segment ids [B * P, L]); zeros with `empty_segment`
    for the row's first piece."""
    rings = {p: from_previous_piece(parts[p], lring, layout, CONTEXT_AXIS) for p in CONV_PARTS}
    ring_seg = from_previous_piece(seg_RT, lring, layout, CONTEXT_AXIS)
    ring_seg = jnp.where(first_piece(seg_RT.shape[0], layout, CONTEXT_AXIS)[:, None], empty_segment, ring_seg)
    return rings, ring_seg


def _specs(layer, b: int) -> RowSpecs:
    """Row / head specs: the mesh axes the rule table gives `batch` and `act_heads` on a [B, T, nk]
    activation (what the activations entering the shard_map carry, so entering moves nothing); the
    GDN defaults without a sharding context."""
    mesh = jax.sharding.get_abstract_mesh()
    ctx = sh.current()
    if ctx is None:
        return row_specs(mesh, b, layer.cfg.linear_num_key_heads)
    spec = ctx.spec(("batch", None, "act_heads"), (b, 1, layer.cfg.linear_num_key_heads))
    axes = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)  # noqa: E731
    return row_specs(mesh, b, layer.cfg.linear_num_key_heads, axes(spec[0]), axes(spec[2]))


def _zero_state(v_BTHV: jax.Array, dk: int) -> jax.Array:
    b, _, h, dv = v_BTHV.shape
    return jnp.zeros((b, h, dk, dv), jnp.float32)


def clean_forward(layer, x_BTD: jax.Array, ctx: dict[str, Any], empty_segment: int = -1) -> jax.Array:
    """The AR forward without a cache, [B, T, D] -> [B, T, D], T sharded over `context`."""
    c = layer.cfg
    mixed = layer.mix_inputs(x_BTD, ctx.get("lora_key"))
    g, beta = layer.gates(mixed["b"], mixed["a"])
    lring = c.linear_conv_kernel_dim - 1
    weights = layer.conv_weights()
    sp = _specs(layer, x_BTD.shape[0])

    layout = ctx.get("context_layout", "contiguous")
    npc = pieces(layout)

    def body(q, k, v, g, beta, seg, w):
        parts = {"q": q, "k": k, "v": v}
        parts, seg_r = {p: to_piece_rows(x, npc) for p, x in parts.items()}, to_piece_rows(seg, npc)
        rings, ring_seg = _halo(parts, seg_r, lring, empty_segment, layout)
        conv = {p: from_piece_rows(x, npc) for p, x in layer.conv_parts(parts, seg_r, rings, ring_seg, w).items()}
        qh, kh, vh = layer.heads(conv, repeat=False)
        o, _ = shard_chunk_gdn(qh, kh, vh, g, beta, seg, _zero_state(vh, c.linear_key_head_dim),
                               has_initial_state=False, chunk_size=c.gdn_chunk_size, backend=c.gdn_backend,
                               layout=layout)
        return o

    w_specs = {name: sp.channel for name in weights}
    o = over_rows(body, (sp.tok_h,) * 5 + (sp.tok, w_specs), sp.tok_h, mixed["q"], mixed["k"], mixed["v"], g, beta,
                  ctx["segment_ids"].astype(jnp.int32), weights)
    return layer.output(o, mixed["z"], x_BTD.dtype, ctx.get("lora_key"))


def two_stream(layer, x_BSD: jax.Array, ctx: dict[str, Any]) -> jax.Array:
    """Both block-mode streams, x [B, 2T, D] in the layout of `pallas_kernels.context.stream_layout` (each
    context shard holds the clean and noisy tokens of the same positions) -> [B, 2T, D] in that
    layout, each stream's T sharded over `context` (every shard a whole number of blocks)."""
    c = layer.cfg
    bk, seg, empty = ctx["block_size"], ctx["segment_ids"].astype(jnp.int32), ctx["empty_segment"]
    lring = c.linear_conv_kernel_dim - 1
    mixed = layer.mix_inputs(x_BSD, ctx.get("lora_key"))
    streams = {p: split_streams(mixed[p]) for p in (*CONV_PARTS, "b", "a")}
    clean, noisy = ({p: streams[p][i] for p in CONV_PARTS} for i in (0, 1))
    g, beta = layer.gates(streams["b"][0], streams["a"][0])
    weights = layer.conv_weights()
    sp = _specs(layer, x_BSD.shape[0])

    layout = ctx.get("context_layout", "contiguous")
    npc = pieces(layout)

    def body(cq, ck, cv, nq, nk, nv, g, beta, seg, w, scalars):
        rows = lambda a: to_piece_rows(a, npc)  # noqa: E731  the shard's pieces as rows [B * P, Tp]
        seg_r = rows(seg)
        r, tp = seg_r.shape
        n = tp // bk
        clean, noisy = {"q": rows(cq), "k": rows(ck), "v": rows(cv)}, {"q": rows(nq), "k": rows(nk), "v": rows(nv)}
        rings, ring_seg = _halo(clean, seg_r, lring, empty, layout)
        conv_c = layer.conv_parts(clean, seg_r, rings, ring_seg, w)
        blocks = lambda a: a.reshape((r * n, bk) + a.shape[2:])  # noqa: E731
        ring_parts = {p: block_rings(clean[p], seg_r, bk, lring, empty, halo=(rings[p], ring_seg)) for p in CONV_PARTS}
        conv_n = layer.block_conv_parts({p: blocks(noisy[p]) for p in CONV_PARTS}, blocks(seg_r),
                                         {p: r_ for p, (r_, _) in ring_parts.items()}, ring_parts["q"][1], w)
        back = lambda a: from_piece_rows(a.reshape(r, tp, -1), npc)  # noqa: E731
        q_c, k_c, v_c = layer.heads({p: back(x) for p, x in conv_c.items()}, repeat=False)
        q_n, k_n, v_n = layer.heads({p: back(x) for p, x in conv_n.items()}, repeat=False)
        o_c, o_n, _ = shard_block_gdn(q_c, k_c, v_c, g, beta, q_n, k_n, v_n, scalars, seg,
                                      _zero_state(v_c, c.linear_key_head_dim), has_initial_state=False,
                                      block_size=bk, chunk_size=c.gdn_chunk_size, backend=c.gdn_backend,
                                      layout=layout)
        return o_c, o_n

    w_specs = {name: sp.channel for name in weights}
    o_c, o_n = over_rows(body, (sp.tok_h,) * 8 + (sp.tok, w_specs, sp.per_head), (sp.tok_h, sp.tok_h),
                         clean["q"], clean["k"], clean["v"], noisy["q"], noisy["k"], noisy["v"], g, beta, seg, weights,
                         layer.bd_gdn_softmax_scalars[...])
    return layer.output(join_streams(o_c, o_n), mixed["z"], x_BSD.dtype, ctx.get("lora_key"))
