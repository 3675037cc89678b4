"""The GDN layer over a sequence-sharded row (context parallelism, `clover_jax.parallel.context`).

`GatedDeltaNet.__call__` (no cache) and `GatedDeltaNet.two_stream` hand over here when the active
mesh has a `context` axis > 1. Projections and the output stay outside (token-wise, partitioned by
XLA); the sequence mixing runs per shard in one `shard_map` manual over `context`:

- conv halo: the K-1 pre-conv clean inputs before the shard (and their segment ids) come from the
  previous shard by `ppermute`; shard 0 gets the empty ring of the one-device run. The conv masks
  taps by segment as on one device, so a document start at (or just after) a shard boundary reads
  nothing of the document before it. The noisy stream's block rings read the same halo.
- recurrence: `pallas_kernels.gdn_context` (affine shard maps, scanned across the axis; jnp
  reference math per shard whatever `gdn_backend` says: per-shard kernels are the next step).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from clover_jax.model.gdn import CONV_PARTS, block_rings
from pallas_kernels.gdn_context import (
    CONTEXT_AXIS, from_previous_shard, over_context, shard_block_gdn, shard_chunk_gdn,
)

_TOK = P(None, CONTEXT_AXIS)


def _halo(parts: dict[str, jax.Array], seg_BT: jax.Array, lring: int, empty_segment: int):
    """({part: the previous shard's last L pre-conv inputs [B, L, C]}, their segment ids [B, L]);
    zeros with `empty_segment` on shard 0."""
    rings = {p: from_previous_shard(parts[p], lring, CONTEXT_AXIS) for p in CONV_PARTS}
    ring_seg = from_previous_shard(seg_BT, lring, CONTEXT_AXIS)
    ring_seg = jnp.where(lax.axis_index(CONTEXT_AXIS) == 0, empty_segment, ring_seg)
    return rings, ring_seg


def _zero_state(layer, b: int) -> jax.Array:
    c = layer.cfg
    return jnp.zeros((b, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), jnp.float32)


def clean_forward(layer, x_BTD: jax.Array, ctx: dict[str, Any], empty_segment: int = -1) -> jax.Array:
    """The AR forward without a cache, [B, T, D] -> [B, T, D], T sharded over `context`."""
    c = layer.cfg
    mixed = layer.mix_inputs(x_BTD)
    g, beta = layer.gates(mixed["b"], mixed["a"])
    lring = c.linear_conv_kernel_dim - 1

    def body(q, k, v, g, beta, seg):
        parts = {"q": q, "k": k, "v": v}
        rings, ring_seg = _halo(parts, seg, lring, empty_segment)
        qh, kh, vh = layer.heads(layer._conv_parts(parts, seg, rings, ring_seg))
        o, _ = shard_chunk_gdn(qh, kh, vh, g, beta, seg, _zero_state(layer, seg.shape[0]), has_initial_state=False,
                               chunk_size=c.gdn_chunk_size)
        return o

    o = over_context(body, (_TOK,) * 6, _TOK, mixed["q"], mixed["k"], mixed["v"], g, beta,
                     ctx["segment_ids"].astype(jnp.int32))
    return layer.output(o, mixed["z"], x_BTD.dtype)


def two_stream(layer, x_BSD: jax.Array, ctx: dict[str, Any]) -> jax.Array:
    """Both block-mode streams, x [B, 2T, D] = clean || noisy -> [B, 2T, D], each stream's T sharded
    over `context` (every shard a whole number of blocks)."""
    c = layer.cfg
    bk, seg, empty = ctx["block_size"], ctx["segment_ids"].astype(jnp.int32), ctx["empty_segment"]
    t = seg.shape[1]
    lring = c.linear_conv_kernel_dim - 1
    mixed = layer.mix_inputs(x_BSD)
    clean = {p: mixed[p][:, :t] for p in CONV_PARTS}
    noisy = {p: mixed[p][:, t:] for p in CONV_PARTS}
    g, beta = layer.gates(mixed["b"][:, :t], mixed["a"][:, :t])

    def body(cq, ck, cv, nq, nk, nv, g, beta, seg):
        b, tl = seg.shape
        n = tl // bk
        clean, noisy = {"q": cq, "k": ck, "v": cv}, {"q": nq, "k": nk, "v": nv}
        rings, ring_seg = _halo(clean, seg, lring, empty)
        conv_c = layer._conv_parts(clean, seg, rings, ring_seg)
        blocks = lambda a: a.reshape((b * n, bk) + a.shape[2:])  # noqa: E731
        ring_parts = {p: block_rings(clean[p], seg, bk, lring, empty, halo=(rings[p], ring_seg)) for p in CONV_PARTS}
        conv_n = layer._block_conv_parts({p: blocks(noisy[p]) for p in CONV_PARTS}, blocks(seg),
                                         {p: r for p, (r, _) in ring_parts.items()}, ring_parts["q"][1])
        conv_n = {p: v.reshape(b, tl, -1) for p, v in conv_n.items()}
        q_c, k_c, v_c = layer.heads(conv_c)
        q_n, k_n, v_n = layer.heads(conv_n)
        o_c, o_n, _ = shard_block_gdn(q_c, k_c, v_c, g, beta, q_n, k_n, v_n, layer.bd_gdn_softmax_scalars[...], seg,
                                      _zero_state(layer, b), has_initial_state=False, block_size=bk,
                                      chunk_size=c.gdn_chunk_size)
        return o_c, o_n

    o_c, o_n = over_context(body, (_TOK,) * 9, (_TOK, _TOK), clean["q"], clean["k"], clean["v"], noisy["q"],
                            noisy["k"], noisy["v"], g, beta, seg)
    z = mixed["z"]
    return layer.output(jnp.concatenate([o_c, o_n], axis=1), z, x_BSD.dtype)
