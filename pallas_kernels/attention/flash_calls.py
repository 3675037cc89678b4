"""The Pallas (Triton form) kernels of :mod:`pallas_kernels.attention.flash`: flash-attention forward,
dq and dk/dv for the two training streams, the block-diffusion rule computed in the kernel from
slots and segment ids (docs/design.md 3.1).

Per-row layout (the wrapper pads; every length here is a whole number of tiles):

- q, dO, out: [B, Tq, H, Dp]; k, v: [B, S, K, Dp] (S = Tq clean, 2 Tq noisy = clean || noisy slots);
  GQA native: query head h reads KV head h // G, G = H / K (the KV BlockSpecs index the shared head,
  the dk/dv kernel loops over the G query heads of its KV head; nothing is repeated);
- q_seg [B, Tq], kv_seg [B, S] segment ids; q_first [B, Tq]: first slot of each query's segment id,
  kv_last [B, S]: last query slot of each key's segment id (exact for any id layout): they bound
  the tiles a document can reach;
- lse, delta: [B, H, Tq] fp32; lse in base 2 (scores are scaled by log2(e) so the kernel uses exp2).

Masks (key index kv in [0, S), query slot q, both with equal segment ids):
clean: kv <= q. noisy, with s = q - q % block: kv < s (clean keys before the block start) or
Tq + s <= kv < Tq + s + block (noisy keys of the same block).

A context shard (``FlashConfig.q_offset`` = O > 0, :mod:`pallas_kernels.context.attention`): the
Tq queries are the LAST Tq of O + Tq clean keys (the shard's own piece after the keys gathered from
the other shards), so query i has slot q = O + i and the rules above hold unchanged on key indices
(clean keys [0, O + Tq), the shard's noisy keys after them: S = O + Tq, or O + 2 Tq).

Tile skipping: each program visits only key tiles (fwd, dq) or query tiles (dk/dv) that can hold a
visible pair, from the causal / block structure and the document extents; inside a visited tile the
exact mask applies (masked scores give exactly zero probability). Numerics: bf16 (or fp32) operands,
fp32 accumulation and softmax statistics; fp32 operands run the dots at HIGHEST precision.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..common.cost import nbytes

f32 = jnp.float32
LOG2E = math.log2(math.e)
NEG = -1e30  # finite "minus infinity" for masked scores: exp2(NEG - m) is 0 and never NaN

Stream = Literal["clean", "noisy"]


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Static kernel parameters. Tiles are powers of two (Triton); numerics do not depend on them.

    Defaults for head dim 256 in bf16 on an H100/H200: the forward keeps a [64, 256] fp32
    accumulator; the backward keeps dk and dv [32, 256] fp32 accumulators per program."""

    stream: Stream = "clean"
    block_size: int = 1  # the noisy stream's row-grid block
    q_offset: int = 0  # slot of the first query: clean keys before the queries' own (context shards)
    scale: float = 1.0  # softmax scale (D^-0.5)
    block_q: int = 64
    block_k: int = 64
    block_q_bwd: int = 32
    block_k_bwd: int = 32
    num_warps: int = 8
    num_warps_bwd: int = 4
    num_stages: int = 2

    @classmethod
    def for_dtype(cls, dtype) -> FlashConfig:
        """The defaults for 2-byte operands; fp32 operands (tests, parity checks) get half the tiles,
        so the tiles of head dim 256 still fit a GPU's shared memory."""
        if jnp.dtype(dtype).itemsize <= 2:
            return cls()
        return cls(block_q=32, block_k=32, block_q_bwd=16, block_k_bwd=16, num_warps=4)

    def tile_multiple(self) -> int:
        """Padded lengths must be multiples of this (every tile and the block grid)."""
        return math.lcm(self.block_q, self.block_k, self.block_q_bwd, self.block_k_bwd, self.block_size)


def _div(a, b: int):
    return lax.div(a, b)  # non-negative operands: truncation is the floor (Triton has no floor_divide)


def _cdiv(a, b: int):
    return lax.div(a + (b - 1), b)


def _start(slot, block: int):
    """First slot of the slot's block on the row grid."""
    return slot - lax.rem(slot, block)


def visible(cfg: FlashConfig, tq: int, q_slot, q_seg, kv_idx, kv_seg):
    """[bq, bk] bool mask of queries (slots ``q_slot`` [bq]) over keys (indices ``kv_idx`` [bk])."""
    same = q_seg[:, None] == kv_seg[None, :]
    kv = kv_idx[None, :]
    if cfg.stream == "clean":
        return same & (kv <= q_slot[:, None])
    s = _start(q_slot, cfg.block_size)[:, None]
    return same & ((kv < s) | ((kv >= s + tq) & (kv < s + (tq + cfg.block_size))))


def key_tile_ranges(cfg: FlashConfig, tq: int, qs, bq: int, bk: int, q_first):
    """[(lo, hi), ...] key-tile ranges a query tile [qs, qs + bq) (local: slots ``q_offset + qs`` on)
    visits; ``q_first`` [bq]: the first slot of each query's segment id. Works on traced values and
    on NumPy / Python ints."""
    n_q, qs = tq // bk, cfg.q_offset + qs  # noisy keys start at q_offset + tq: tile n_q + slot // bk
    if cfg.stream == "clean":
        return [(_div(jnp.min(q_first), bk), _cdiv(qs + bq, bk))]
    bs = cfg.block_size
    start = _start(qs + jnp.arange(bq, dtype=jnp.int32), bs)
    sees_clean = q_first < start  # a query sees clean keys [first, start) of its document
    clean = (_div(jnp.min(jnp.where(sees_clean, q_first, cfg.q_offset + tq)), bk),
             _cdiv(jnp.max(jnp.where(sees_clean, start, 0)), bk))
    st_first, st_last = _start(qs, bs), _start(qs + bq - 1, bs)
    noisy = (n_q + _div(st_first, bk), jnp.minimum(n_q + _cdiv(st_last + bs, bk), (cfg.q_offset + 2 * tq) // bk))
    return [clean, noisy]


def query_tile_range(cfg: FlashConfig, tq: int, ks, bk: int, bq: int, kv_last):
    """(lo, hi) local query tiles a key tile [ks, ks + bk) visits; ``kv_last`` [bk]: the last query
    slot of each key's segment id (an upper bound is enough). Query slots start at ``q_offset``."""
    nq, off = tq // bq, cfg.q_offset
    local_tiles = lambda first, last: (_div(jnp.maximum(first - off, 0), bq),  # noqa: E731
                                       jnp.minimum(_cdiv(jnp.maximum(last - off + 1, 0), bq), nq))
    if cfg.stream == "clean":  # key k: queries [k, last]
        return local_tiles(ks, jnp.max(kv_last))
    bs = cfg.block_size
    kv = ks + jnp.arange(bk, dtype=jnp.int32)
    # clean key k: queries [next block start, last] of its document; noisy key: queries of its block
    after = _start(kv, bs) + bs
    seen = after <= kv_last
    lo_c, hi_c = local_tiles(jnp.min(jnp.where(seen, after, off + tq)), jnp.max(jnp.where(seen, kv_last, -1)))
    slot = ks - (off + tq)
    lo_n = _div(_start(slot, bs), bq)
    hi_n = jnp.minimum(_cdiv(_start(slot + bk - 1, bs) + bs, bq), nq)
    noisy = ks >= off + tq
    return jnp.where(noisy, lo_n, lo_c), jnp.where(noisy, hi_n, hi_c)


def _dot(a, b, contract: tuple[int, int]):
    prec = lax.Precision.HIGHEST if a.dtype == f32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=(prec, prec),
                           preferred_element_type=f32)


def _probs(cfg, tq, q, k, q_slot, q_seg, kv_idx, kv_seg, lse):
    """Recomputed probabilities [bq, bk] fp32 from the saved base-2 logsumexp."""
    s = _dot(q, k, (1, 1)) * (cfg.scale * LOG2E)
    mask = visible(cfg, tq, q_slot, q_seg, kv_idx, kv_seg)
    return jnp.where(mask, jnp.exp2(jnp.where(mask, s, NEG) - lse[:, None]), 0.0)


# ------------------------------------------------------------------------------------------ forward

def _fwd_kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, q_first_ref, o_ref, lse_ref, *, cfg: FlashConfig):
    bq, bk, tq = cfg.block_q, cfg.block_k, q_seg_ref.shape[0]
    qs = pl.program_id(0) * bq
    rows = pl.ds(qs, bq)
    q, q_seg = q_ref[...], q_seg_ref[rows]
    q_slot = cfg.q_offset + qs + jnp.arange(bq, dtype=jnp.int32)

    def body(j, carry):
        acc, m, l = carry
        cols = pl.ds(j * bk, bk)
        s = _dot(q, k_ref[cols, :], (1, 1)) * (cfg.scale * LOG2E)
        mask = visible(cfg, tq, q_slot, q_seg, j * bk + jnp.arange(bk, dtype=jnp.int32), kv_seg_ref[cols])
        s = jnp.where(mask, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
        acc = acc * alpha[:, None] + _dot(p.astype(v_ref.dtype), v_ref[cols, :], (1, 0))
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    carry = (jnp.zeros(q.shape, f32), jnp.full((bq,), -jnp.inf, f32), jnp.zeros((bq,), f32))
    for lo, hi in key_tile_ranges(cfg, tq, qs, bq, bk, q_first_ref[rows]):
        carry = lax.fori_loop(lo, hi, body, carry)
    acc, m, l = carry
    l = jnp.where(l == 0.0, 1.0, l)  # a query with no visible key (never a real token): output 0
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def forward_call(q, k, v, q_seg, kv_seg, q_first, *, cfg: FlashConfig, interpret: bool):
    """-> (out [B, Tq, H, Dp] in q's dtype, lse [B, H, Tq] fp32)."""
    B, tq, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G, bq = H // K, cfg.block_q
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, tq), f32)]
    kv_spec = pl.BlockSpec((None, S, None, D), lambda i, b, h: (b, 0, _div(h, G), 0))
    q_spec = pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0))
    row = lambda n: pl.BlockSpec((None, n), lambda i, b, h: (b, 0))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg), out_shape=out_shape, grid=(tq // bq, B, H),
        in_specs=[q_spec, kv_spec, kv_spec, row(tq), row(S), row(tq)],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        compiler_params=None if interpret else _gpu_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret, name=f"flash_{cfg.stream}_fwd",
        cost_estimate=_cost(cfg, q, (q, k, v), out_shape, matmuls=2),
    )(q, k, v, q_seg, kv_seg, q_first)


# ----------------------------------------------------------------------------------------- backward

def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, q_first_ref, dq_ref, *,
               cfg: FlashConfig):
    bq, bk, tq = cfg.block_q_bwd, cfg.block_k_bwd, q_seg_ref.shape[0]
    qs = pl.program_id(0) * bq
    rows = pl.ds(qs, bq)
    q, do, lse, delta, q_seg = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], q_seg_ref[rows]
    q_slot = cfg.q_offset + qs + jnp.arange(bq, dtype=jnp.int32)

    def body(j, dq):
        cols = pl.ds(j * bk, bk)
        k = k_ref[cols, :]
        p = _probs(cfg, tq, q, k, q_slot, q_seg, j * bk + jnp.arange(bk, dtype=jnp.int32), kv_seg_ref[cols], lse)
        ds = p * (_dot(do, v_ref[cols, :], (1, 1)) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k, (1, 0))

    dq = jnp.zeros(q.shape, f32)
    for lo, hi in key_tile_ranges(cfg, tq, qs, bq, bk, q_first_ref[rows]):
        dq = lax.fori_loop(lo, hi, body, dq)
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, kv_last_ref,
                dk_ref, dv_ref, *, cfg: FlashConfig):
    bq, bk, tq = cfg.block_q_bwd, cfg.block_k_bwd, q_seg_ref.shape[0]
    G = q_ref.shape[1]
    ks = pl.program_id(0) * bk
    cols = pl.ds(ks, bk)
    k, v, kv_seg = k_ref[...], v_ref[...], kv_seg_ref[cols]
    kv_idx = ks + jnp.arange(bk, dtype=jnp.int32)
    lo, hi = query_tile_range(cfg, tq, ks, bk, bq, kv_last_ref[cols])

    def head(g, carry):
        def body(i, carry):
            dk, dv = carry
            rows = pl.ds(i * bq, bq)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            q_slot = cfg.q_offset + i * bq + jnp.arange(bq, dtype=jnp.int32)
            p = _probs(cfg, tq, q, k, q_slot, q_seg_ref[rows], kv_idx, kv_seg, lse_ref[g, rows])
            ds = p * (_dot(do, v, (1, 1)) - delta_ref[g, rows][:, None])
            return dk + _dot(ds.astype(q.dtype), q, (0, 0)), dv + _dot(p.astype(do.dtype), do, (0, 0))

        return lax.fori_loop(lo, hi, body, carry)

    zeros = jnp.zeros(k.shape, f32)
    dk, dv = lax.fori_loop(0, G, head, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def backward_calls(q, k, v, do, lse, delta, q_seg, kv_seg, q_first, kv_last, *, cfg: FlashConfig,
                   interpret: bool):
    """-> (dq [B, Tq, H, Dp], dk, dv [B, S, K, Dp]) in the inputs' dtypes; ``delta`` = rowsum(out * dO)."""
    B, tq, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G, bq, bk = H // K, cfg.block_q_bwd, cfg.block_k_bwd
    params = None if interpret else _gpu_params(cfg.num_warps_bwd, cfg.num_stages)
    row = lambda n: pl.BlockSpec((None, n), lambda i, b, h: (b, 0))  # noqa: E731

    q_tile = pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0))
    kv_full = pl.BlockSpec((None, S, None, D), lambda i, b, h: (b, 0, _div(h, G), 0))
    stat_tile = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(tq // bq, B, H), in_specs=[q_tile, kv_full, kv_full, q_tile, stat_tile, stat_tile, row(tq), row(S),
                                         row(tq)],
        out_specs=q_tile, compiler_params=params, interpret=interpret, name=f"flash_{cfg.stream}_dq",
        cost_estimate=_cost(cfg, q, (q, k, v, do, lse, delta), (q,), matmuls=3),
    )(q, k, v, do, lse, delta, q_seg, kv_seg, q_first)

    # dk / dv: one program per (key tile, row, KV head); its G query heads are a [Tq, G, Dp] block
    group = lambda x: x.reshape(B, tq, K, G, D)  # noqa: E731  free: head h = kv * G + g
    q_group = pl.BlockSpec((None, tq, None, G, D), lambda j, b, kh: (b, 0, kh, 0, 0))
    stat_group = pl.BlockSpec((None, None, G, tq), lambda j, b, kh: (b, kh, 0, 0))
    kv_tile = pl.BlockSpec((None, bk, None, D), lambda j, b, kh: (b, j, kh, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid=(S // bk, B, K), in_specs=[q_group, kv_tile, kv_tile, q_group, stat_group, stat_group, row(tq),
                                        row(S), row(S)],
        out_specs=[kv_tile, kv_tile], compiler_params=params, interpret=interpret, name=f"flash_{cfg.stream}_dkv",
        cost_estimate=_cost(cfg, q, (q, k, v, do, lse, delta), (k, v), matmuls=4),
    )(group(q), k, v, group(do), lse.reshape(B, K, G, tq), delta.reshape(B, K, G, tq), q_seg, kv_seg, kv_last)
    return dq, dk, dv


# -------------------------------------------------------------------------------------------- shared

def _gpu_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as plgpu
    params = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return params(num_warps=num_warps, num_stages=num_stages)


def visible_pairs(stream: Stream, t: int, block_size: int, q_offset: int = 0) -> int:
    """Visible (query, key) pairs of one head of a one-document row of length t (the mask's upper
    bound; packed documents only remove pairs); ``q_offset`` clean keys before the t queries (a
    context shard's earlier keys) are visible to all of them."""
    if stream == "clean":
        return q_offset * t + t * (t + 1) // 2
    n = t // block_size  # block n's queries see n * block clean keys and their block's noisy keys
    return q_offset * t + block_size * block_size * (n * (n - 1) // 2) + t * block_size


def _cost(cfg: FlashConfig, q, operands, results, matmuls: int) -> pl.CostEstimate:
    """Analytic cost: ``matmuls`` [pairs x D] products (2 flops each) and one exp2 per visible pair."""
    B, tq, H, D = q.shape
    pairs = B * H * visible_pairs(cfg.stream, tq, cfg.block_size, cfg.q_offset)
    return pl.CostEstimate(flops=int(2 * matmuls * D * pairs + 6 * pairs), transcendentals=int(pairs),
                           bytes_accessed=nbytes(*operands) + nbytes(*results))
