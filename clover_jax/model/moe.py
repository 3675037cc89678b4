"""Dropless mixture of experts with a sigmoid-gated shared expert (Qwen3.5 `SparseMoeBlock`).

Router: fp32 softmax over all experts, top-k, renormalise the k weights to sum 1. Expert paths that
compute the same function (`ModelConfig.moe_impl`):

* `ragged`: sort the T*k assignments by expert and run grouped matmuls (`gmm`: `jax.lax.ragged_dot`
  forward and input gradient, the weight gradient by `tgmm`: the megablox kernel on TPU, where
  JAX's own transpose of `ragged_dot` would multiply every row by every local expert's mask; gate
  and up fused into one n = 2I projection); no capacity, so no token is ever dropped. In bf16 no
  [T*k, D] buffer is fp32: the kernels write bf16 (fp32 accumulation inside), the routing weight
  scales each row before the down projection (`_swiglu_rows`), and the k rows of a token are
  gathered and summed in fp32 in one pass (`_combine`), forward and backward;
* `blocked`: the same sort, then each expert's group is padded to a multiple of a row block and a
  loop runs the used blocks against their expert's weights, with a custom VJP
  (`clover_jax.model.moe_blocked`; the path on GPU, where `ragged_dot` expands to a dense
  masked product);
* `capacity`: each expert's first C rows as one batched matmul over all experts, the rows past C by
  a loop over row blocks (`clover_jax.model.moe_capacity`; the path on CPU, where a loop of small
  dots runs at half the batched dot's speed);
* `dense`: every token through every expert, weighted by a dense [T, E] combine matrix: the plain
  reference (E/k times the FLOPs).

`auto` picks `ragged` on TPU, `blocked` on GPU and `capacity` on CPU (`moe_platform` says why).

Expert parallelism (`experts_parallel`) takes over inside `sharding.use_sharding(mesh)` on a
multi-device mesh: tokens stay sharded over the batch axes, experts over `expert`, and the
dispatch is `ModelConfig.moe_dispatch` (ragged all-to-all or ring). Routing, the load-balancing
loss and the per-expert counts are computed outside it on the global token set, so they are the
same numbers with or without a mesh.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.parallel import remat, sharding
from clover_jax.config import ModelConfig
from clover_jax.model.moe_blocked import blocked_ffn, swiglu_grad
from clover_jax.model.moe_capacity import capacity_ffn, experts_capacity, gather_rows
from clover_jax.model import moe_coreset
from clover_jax.model.lora import expert_weight
from clover_jax.model.moe_platform import resolve_impl, tgmm_tiling
from clover_jax.model.nn import Dense, dtype_of, make_param, normal
from pallas_kernels.context.stream_layout import join_streams, split_streams


def route(logits_TE: jax.Array, k: int, allowed: Callable[[jax.Array], jax.Array] | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (probs_TE fp32 softmax, weights_TK renormalised top-k, experts_TK int32); any leading token
    dims. `allowed(probs)` (bool, probs' shape) restricts each token's top-k to its true experts
    (the block coreset, `moe_coreset`); probs stay the unrestricted softmax."""
    probs = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    # -1 is below every probability: a disallowed expert is never picked while k experts are allowed
    choose = probs if allowed is None else jnp.where(allowed(probs), probs, -1.0)
    weights, experts = jax.lax.top_k(choose, k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, experts.astype(jnp.int32)


def load_balancing_loss(probs_TE: jax.Array, experts_TK: jax.Array, valid_T: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Switch-style loss `E * sum_e f_e P_e` over valid tokens (f_e: share of the T*k assignments that
    go to e, P_e: mean router probability), and the per-expert assignment counts [E]."""
    e = probs_TE.shape[-1]
    w = valid_T.astype(jnp.float32)  # any leading token dims ([T] or [B, T]), as probs / experts
    counts = jnp.zeros((e,), jnp.float32).at[experts_TK].add(jnp.broadcast_to(w[..., None], experts_TK.shape))
    n = jnp.maximum(jnp.sum(w), 1.0)
    frac = counts / (n * experts_TK.shape[-1])
    mean_prob = jnp.sum(probs_TE * w[..., None], axis=tuple(range(w.ndim))) / n
    return e * jnp.sum(frac * mean_prob), counts


# ---------------------------------------------------------------------------------------------
# grouped expert FFN on rows already sorted by expert
def _swiglu(h: jax.Array, u: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return (jax.nn.silu(h) * u).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _swiglu_rows(hu_MJ: jax.Array, w_M: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`w[:, None] * silu(h) * u` in `dtype` from the gate|up pre-activations hu [M, 2I] and a weight
    per row (the token's routing weight: applied before the down projection, which is linear, so
    the combine is a plain sum). Custom VJP: the joined [M, 2I] gradient and the weights' gradient
    in one elementwise pass (autodiff writes dh and du apart, then pads and adds them)."""
    i = hu_MJ.shape[-1] // 2
    return (jax.nn.silu(hu_MJ[:, :i].astype(jnp.float32)) * hu_MJ[:, i:] * w_M[:, None]).astype(dtype)


def _swiglu_rows_fwd(hu_MJ, w_M, dtype):
    return _swiglu_rows(hu_MJ, w_M, dtype), (hu_MJ, w_M)


def _swiglu_rows_bwd(dtype, res, ct_MI):
    hu_MJ, w_M = res
    i = hu_MJ.shape[-1] // 2
    ct = ct_MI.astype(jnp.float32)
    act = jax.nn.silu(hu_MJ[:, :i].astype(jnp.float32)) * hu_MJ[:, i:].astype(jnp.float32)
    return swiglu_grad(hu_MJ, ct * w_M[:, None]).astype(hu_MJ.dtype), jnp.sum(ct * act, axis=-1).astype(w_M.dtype)


_swiglu_rows.defvjp(_swiglu_rows_fwd, _swiglu_rows_bwd)


def _precision(dtype: jnp.dtype) -> jax.lax.Precision | None:
    """bf16 operands: default precision, whatever the global setting (TPU's ragged-dot kernel
    rejects an fp32 contract precision on bf16 inputs; the products are exact in bf16 anyway)."""
    return None if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def tgmm(lhs_MK: jax.Array, rhs_MN: jax.Array, group_sizes_G: jax.Array, platform: str,
         interpret: bool = False, out_dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Per-group `lhs[rows_g].T @ rhs[rows_g]` -> [G, K, N] in `out_dtype` (the weight gradient of
    a grouped matmul; accumulated in fp32 whatever `out_dtype`). TPU: the megablox `tgmm` Pallas
    kernel (only each group's rows are multiplied; M is zero-padded to its row tile). Elsewhere:
    JAX's transpose of `ragged_dot` (a masked dense product: G times the FLOPs, fine for CPU
    tests)."""
    g = group_sizes_G.shape[0]
    m, k = lhs_MK.shape
    n = rhs_MN.shape[1]
    if platform == "tpu":
        from jax.experimental.pallas.ops.tpu.megablox.gmm import tgmm as megablox_tgmm

        tiling = tgmm_tiling(m, k, n)
        pad = -m % tiling[0]
        lhs_p = jnp.pad(lhs_MK, ((0, pad), (0, 0)))
        rhs_p = jnp.pad(rhs_MN.astype(lhs_MK.dtype), ((0, pad), (0, 0)))
        # the kernel's dots take the global matmul precision; Mosaic rejects fp32 contraction on bf16
        prec = contextlib.nullcontext() if lhs_MK.dtype == jnp.float32 else jax.default_matmul_precision("default")
        with prec:
            return megablox_tgmm(lhs_p.T, rhs_p, group_sizes_G.astype(jnp.int32), out_dtype, tiling,
                                 interpret=interpret)
    zero = jnp.zeros((g, k, n), lhs_MK.dtype)
    _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(lhs_MK, w, group_sizes_G, preferred_element_type=jnp.float32,
                                                  precision=_precision(lhs_MK.dtype)), zero)
    return vjp(rhs_MN.astype(jnp.float32))[0].astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gmm(lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array, platform: str) -> jax.Array:
    """Grouped matmul `out[rows_g] = lhs[rows_g] @ rhs[g]` (rows sorted by group; rows past the
    groups: unspecified on TPU, 0 elsewhere), [M, N] in lhs' dtype, accumulated in fp32 (a bf16
    product leaves the kernel in bf16: no fp32 [M, N] buffer and no convert pass over it). Custom
    VJP: JAX's own transpose computes the weight gradient as a masked dense product over all G
    groups (on TPU too: G times the FLOPs); here it is `tgmm`, in the weights' dtype."""
    return jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=lhs_MK.dtype,
                              precision=_precision(lhs_MK.dtype))


def _gmm_fwd(lhs_MK, rhs_GKN, group_sizes_G, platform):
    return gmm(lhs_MK, rhs_GKN, group_sizes_G, platform), (lhs_MK, rhs_GKN, group_sizes_G)


def _gmm_bwd(platform, res, ct_MN):
    lhs_MK, rhs_GKN, group_sizes_G = res
    ct = ct_MN.astype(lhs_MK.dtype)
    # the input gradient contracts rhs' N dim in place (no [G, N, K] transposed copy of the weights)
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    d_lhs = jax.lax.ragged_dot_general(ct, rhs_GKN, group_sizes_G, dims, precision=_precision(lhs_MK.dtype),
                                       preferred_element_type=lhs_MK.dtype)
    d_rhs = tgmm(lhs_MK, ct, group_sizes_G, platform, out_dtype=rhs_GKN.dtype)
    return d_lhs, d_rhs, None


gmm.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_ffn(xs_MD: jax.Array, group_sizes_G: jax.Array, wi_gate_GDI: jax.Array, wi_up_GDI: jax.Array,
                wo_GID: jax.Array, impl: str, platform: str | None = None, rows_hint: int | None = None,
                padded: bool = True) -> jax.Array:
    """SwiGLU expert g on rows [start_g, start_g + size_g) of `xs` (rows sorted by expert). Rows past
    `sum(group_sizes)` (buffer padding) come out as exact zeros. Returns [M, D] in xs' dtype.

    `impl`: "ragged" (`gmm`: `ragged_dot` with the `tgmm` weight gradient), "blocked" (padded row
    blocks, `moe_blocked.blocked_ffn`), "capacity" (`moe_capacity.capacity_ffn`; `rows_hint`, the
    expected number of real rows of a worst-case-sized buffer, sizes its capacity) or "dense" (every
    row through every expert, masked: the reference). `platform` (default: JAX's backend) picks the
    `tgmm` implementation. `padded=False` promises that the groups cover all M rows (no buffer
    tail to zero)."""
    wgu = jnp.concatenate([wi_gate_GDI, wi_up_GDI], axis=-1)
    return grouped_ffn_fused(xs_MD, group_sizes_G, wgu, wo_GID, impl, platform, rows_hint, padded)


def grouped_ffn_fused(xs_MD: jax.Array, group_sizes_G: jax.Array, wgu_GDJ: jax.Array, wo_GID: jax.Array, impl: str,
                      platform: str | None = None, rows_hint: int | None = None, padded: bool = True,
                      row_weights_M: jax.Array | None = None) -> jax.Array:
    """`grouped_ffn` with gate and up as one [G, D, 2I] weight (gate columns first), each row's output
    scaled by `row_weights_M` [M] when given. [M, D] in xs' dtype: a bf16 product stays bf16
    between the grouped matmuls (fp32 accumulation inside each)."""
    m, d = xs_MD.shape
    g, i = wgu_GDJ.shape[0], wo_GID.shape[1]
    dt = xs_MD.dtype
    if impl == "ragged":
        platform = platform or jax.default_backend()
        gs = group_sizes_G.astype(jnp.int32)
        # gate and up as one n = 2I grouped matmul: one pass over the rows, and a tgmm whose n axis
        # splits over both TensorCores of a megacore chip (moe_platform.tgmm_tiling)
        hu = gmm(xs_MD, wgu_GDJ, gs, platform)
        w = jnp.ones((m,), jnp.float32) if row_weights_M is None else row_weights_M.astype(jnp.float32)
        y = gmm(_swiglu_rows(hu, w, dt), wo_GID, gs, platform)
        if not padded:  # every row belongs to a group: nothing to zero (no select pass over [M, D])
            return y
        valid = jnp.arange(m, dtype=jnp.int32) < jnp.sum(gs)
        return jnp.where(valid[:, None], y, jnp.zeros((), dt))
    if row_weights_M is not None:
        y = grouped_ffn_fused(xs_MD, group_sizes_G, wgu_GDJ, wo_GID, impl, platform, rows_hint, padded)
        return (y * row_weights_M[:, None]).astype(dt)
    wg, wu = wgu_GDJ[..., :i], wgu_GDJ[..., i:]
    if impl == "dense":
        ends = jnp.cumsum(group_sizes_G)
        group = jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right")  # G for padding rows
        onehot_MG = (group[:, None] == jnp.arange(g)[None]).astype(jnp.float32)
        h = jnp.einsum("md,gdi->mgi", xs_MD, wg, preferred_element_type=jnp.float32)
        u = jnp.einsum("md,gdi->mgi", xs_MD, wu, preferred_element_type=jnp.float32)
        y = jnp.einsum("mgi,gid->mgd", _swiglu(h, u, dt), wo_GID, preferred_element_type=jnp.float32)
        return jnp.einsum("mgd,mg->md", y, onehot_MG).astype(dt)
    if impl == "capacity":
        return capacity_ffn(xs_MD, group_sizes_G, wg, wu, wo_GID, rows_hint).astype(dt)
    if impl != "blocked":
        raise ValueError(f"unknown grouped_ffn impl {impl!r}")
    return blocked_ffn(xs_MD, group_sizes_G, wg, wu, wo_GID).astype(dt)


def combine(y_rows_ND: jax.Array, order_N: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """Rows in sorted order (`order_N[r]`: the assignment token * k + choice of sorted row r) ->
    per-token weighted sum over the k choices, [T, D] fp32 (`_combine`)."""
    t, k = weights_TK.shape
    return _combine(y_rows_ND, order_N, _inverse(order_N).reshape(t, k), weights_TK.astype(jnp.float32))


def _inverse(order_N: jax.Array) -> jax.Array:
    """The inverse permutation: assignment -> its sorted row."""
    n = order_N.shape[0]
    return jnp.zeros((n,), jnp.int32).at[order_N].set(jnp.arange(n, dtype=jnp.int32))


@jax.custom_vjp
def _combine(y_ND: jax.Array, order_N: jax.Array, rank_TK: jax.Array, w_TK: jax.Array | None) -> jax.Array:
    """`out[t] = sum_j w[t, j] y[rank[t, j]]` (w None: a plain sum), fp32 [T, D]: each token gathers
    its k rows and sums them in fp32 in one pass; no [N, D] unsorted copy. Custom VJP, by gathers
    too: a sorted row reads its token's cotangent (autodiff would write the [T, K, D] cotangent out
    and scatter it back to sorted order)."""
    y = y_ND.at[rank_TK].get(mode="promise_in_bounds").astype(jnp.float32)  # [T, K, D], fused
    return jnp.sum(y if w_TK is None else y * w_TK[..., None], axis=1)


def _combine_fwd(y_ND, order_N, rank_TK, w_TK):
    return _combine(y_ND, order_N, rank_TK, w_TK), (y_ND, order_N, rank_TK, w_TK)


def _combine_bwd(res, g_TD):
    y_ND, order_N, rank_TK, w_TK = res
    k = rank_TK.shape[1]
    tok = order_N // k
    if w_TK is None:  # the cotangent rows as they are: gathered in y's dtype, nothing else to compute
        return g_TD.astype(y_ND.dtype).at[tok].get(mode="promise_in_bounds"), None, None, None
    w_N = w_TK.reshape(-1)[order_N]
    dy = (g_TD.at[tok].get(mode="promise_in_bounds") * w_N[:, None]).astype(y_ND.dtype)
    y = y_ND.at[rank_TK].get(mode="promise_in_bounds").astype(jnp.float32)
    return dy, None, None, jnp.einsum("tkd,td->tk", y, g_TD)


_combine.defvjp(_combine_fwd, _combine_bwd)


def experts_sorted(x_TD, weights_TK, experts_TK, wi_gate_EDI, wi_up_EDI, wo_EID, *, impl: str,
                   platform: str | None = None) -> jax.Array:
    """Sort the T*k assignments by expert, grouped FFN, unsort, combine: exact, dropless. [T, D] fp32."""
    wgu = jnp.concatenate([wi_gate_EDI, wi_up_EDI], axis=-1)
    return _experts_sorted_fused(x_TD, weights_TK, experts_TK, wgu, wo_EID, impl=impl, platform=platform)


def _experts_sorted_fused(x_TD, weights_TK, experts_TK, wgu_EDJ, wo_EID, *, impl: str,
                          platform: str | None = None) -> jax.Array:
    """`experts_sorted` with gate and up as one [E, D, 2I] weight. The sorted rows are gathered from
    x (`gather_rows`: their gradient is gathered back too, each token summing its k rows); every
    sorted row belongs to an expert, so the grouped FFN has no padding to zero. [T, D] fp32."""
    t, k = experts_TK.shape
    flat_e = experts_TK.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    rank = _inverse(order).reshape(t, k)
    sizes = jnp.bincount(flat_e, length=wgu_EDJ.shape[0]).astype(jnp.int32)
    xs = gather_rows(x_TD, order // k, rank, True)
    # each row's routing weight applied inside the FFN (before the down projection), so the combine
    # is a plain sum whose backward is one gather
    w_N = weights_TK.astype(jnp.float32).reshape(-1)[order]
    y = grouped_ffn_fused(xs, sizes, wgu_EDJ, wo_EID, impl, platform, padded=False, row_weights_M=w_N)
    return _combine(y, order, rank, None)


def experts_ragged(x_TD, weights_TK, experts_TK, wi_gate_EDI, wi_up_EDI, wo_EID) -> jax.Array:
    """Sorted grouped matmuls with `ragged_dot`. Returns [T, D] fp32."""
    return experts_sorted(x_TD, weights_TK, experts_TK, wi_gate_EDI, wi_up_EDI, wo_EID, impl="ragged")


def experts_blocked(x_TD, weights_TK, experts_TK, wi_gate_EDI, wi_up_EDI, wo_EID) -> jax.Array:
    """Sorted grouped matmuls by padded row blocks. Returns [T, D] fp32."""
    return experts_sorted(x_TD, weights_TK, experts_TK, wi_gate_EDI, wi_up_EDI, wo_EID, impl="blocked")


def experts_dense(x_TD, weights_TK, experts_TK, wi_gate_EDI, wi_up_EDI, wo_EID) -> jax.Array:
    """Reference: all experts on all tokens, combined with a dense [T, E] weight matrix."""
    e = wi_gate_EDI.shape[0]
    combine_TE = jnp.einsum("tk,tke->te", weights_TK, jax.nn.one_hot(experts_TK, e, dtype=jnp.float32))
    h = jnp.einsum("td,edi->tei", x_TD, wi_gate_EDI, preferred_element_type=jnp.float32)
    u = jnp.einsum("td,edi->tei", x_TD, wi_up_EDI, preferred_element_type=jnp.float32)
    y = jnp.einsum("tei,eid->ted", _swiglu(h, u, x_TD.dtype), wo_EID, preferred_element_type=jnp.float32)
    return jnp.einsum("ted,te->td", y, combine_TE)


EXPERT_IMPLS = {"ragged": experts_ragged, "blocked": experts_blocked, "capacity": experts_capacity,
                "dense": experts_dense}
DISPATCHES = ("ragged_a2a", "ring")


# ---------------------------------------------------------------------------------------------
# expert parallelism (inside jax.shard_map)
#
# Buffers are sized for the worst case, never by a capacity factor (dropless): one device sends at
# most `n * min(k, E_local)` rows to one expert rank (a token's k experts are distinct), so a rank
# receives at most `ep * n * min(k, E_local)` rows (n = tokens per device). The exact per-chunk
# sizes and offsets come from an all-gather of the per-(destination, expert) counts, so nothing is
# computed on padding except the grouped matmul's buffer tail, which `grouped_ffn` zeroes.


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, max_chunk: int):
    """`jax.lax.ragged_all_to_all` semantics from a dense `all_to_all` of [peers, max_chunk] slabs,
    for backends without the collective (XLA:CPU). `max_chunk` bounds every send size."""
    n = operand.shape[0]
    peers = input_offsets.shape[0]
    col = jnp.arange(max_chunk, dtype=jnp.int32)[None, :]
    src_rows = jnp.clip(input_offsets[:, None] + col, 0, n - 1)
    keep = (col < send_sizes[:, None]).reshape((peers, max_chunk) + (1,) * (operand.ndim - 1))
    slab = jnp.where(keep, operand[src_rows], 0)
    slab = slab.reshape((peers * max_chunk,) + operand.shape[1:])
    got = jax.lax.all_to_all(slab, axis_name, 0, 0, tiled=True).reshape((peers, max_chunk) + operand.shape[1:])
    where_ = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # senders' offsets here
    dest = jnp.where(col < recv_sizes[:, None], where_[:, None] + col, output.shape[0])
    return output.at[dest.reshape(-1)].set(got.reshape((-1,) + operand.shape[1:]), mode="drop")


def _a2a(real: bool, max_chunk: int, axis_name):
    if real:
        return lambda *a: jax.lax.ragged_all_to_all(*a, axis_name=axis_name)
    return lambda *a: ragged_all_to_all_emulated(*a, axis_name=axis_name, max_chunk=max_chunk)


def _dispatch_a2a(x_ND, w_NK, e_NK, wgu, wo, *, axes, ep: int, impl: str, platform: str) -> jax.Array:
    """Tokens sharded over the expert axes: sort by expert, ragged all-to-all to the owning rank,
    regroup by local expert, grouped FFN, all-to-all back, combine. [N, D] fp32."""
    n, k = e_NK.shape
    el, d = wgu.shape[0], x_ND.shape[1]
    rank = jax.lax.axis_index(axes)
    flat_e = e_NK.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # by expert, hence by destination rank
    counts = jnp.bincount(flat_e, length=ep * el).astype(jnp.int32).reshape(ep, el)  # [dst, local e]
    everyone = jax.lax.all_gather(counts, axes)  # [src, dst, local e]
    s_SD = everyone.sum(-1)
    send_sizes = s_SD[rank]
    recv_sizes = s_SD[:, rank]
    cap = n * min(k, el)
    a2a = _a2a(platform != "cpu", cap, axes)
    recv = a2a(x_ND[order // k], jnp.zeros((ep * cap, d), x_ND.dtype), _exclusive_cumsum(send_sizes),
               send_sizes, _exclusive_cumsum(s_SD, 0)[rank], recv_sizes)
    # received rows: source-major, each source's rows sorted by local expert -> regroup by expert
    mine = everyone[:, rank, :]  # [src, local e]
    key = jnp.searchsorted(jnp.cumsum(mine.reshape(-1)), jnp.arange(ep * cap), side="right")
    local_e = jnp.where(key < ep * el, key % el, el)
    perm = jnp.argsort(local_e, stable=True)
    y = grouped_ffn_fused(recv[perm], mine.sum(0), wgu, wo, impl, platform, rows_hint=n * k)  # mean fill
    y_recv = jnp.zeros_like(y).at[perm].set(y).astype(x_ND.dtype)
    back = a2a(y_recv, jnp.zeros((n * k, d), x_ND.dtype), _exclusive_cumsum(recv_sizes), recv_sizes,
               _exclusive_cumsum(s_SD, 1)[:, rank], send_sizes)
    return combine(back, order, w_NK)


def _dispatch_ring(x_ND, w_NK, e_NK, wgu, wo, *, axes, ep: int, impl: str, platform: str, gather: bool
                   ) -> jax.Array:
    """Ring of experts: all-gather the tokens over the expert axes (skipped when they are already
    replicated there), run the local experts on their assignments, reduce-scatter (or psum) the
    weighted outputs back. [N, D] fp32."""
    dt = x_ND.dtype
    if gather:
        x_ND, w_NK, e_NK = (jax.lax.all_gather(a, axes, axis=0, tiled=True) for a in (x_ND, w_NK, e_NK))
    n, k = e_NK.shape
    el, d = wgu.shape[0], x_ND.shape[1]
    local_e = e_NK.reshape(-1) - jax.lax.axis_index(axes) * el
    local_e = jnp.where((local_e >= 0) & (local_e < el), local_e, el)
    sel = jnp.argsort(local_e, stable=True)[: n * min(k, el)]  # local assignments first
    sizes = jnp.bincount(local_e, length=el + 1)[:el].astype(jnp.int32)
    y = grouped_ffn_fused(x_ND[sel // k], sizes, wgu, wo, impl, platform, rows_hint=max(1, n * k // ep))  # mean fill
    y_tok = jnp.zeros((n, d), jnp.float32).at[sel // k].add(y * w_NK.reshape(-1)[sel][:, None])
    y_tok = y_tok.astype(dt)
    if gather:
        return jax.lax.psum_scatter(y_tok, axes, scatter_dimension=0, tiled=True).astype(jnp.float32)
    return jax.lax.psum(y_tok, axes).astype(jnp.float32)


def _embed_axes(ctx: sharding.ShardingContext, logical: tuple[str, ...], shape: tuple[int, ...],
                taken: tuple[str, ...]) -> tuple[str, ...]:
    """Mesh axes the rule table splits an expert weight's `embed` dim over (FSDP), minus axes the
    experts / expert_mlp dims already use inside the MoE's shard_map."""
    spec = ctx.spec(logical, shape, what="MoE expert weight")
    return tuple(a for a in sharding.spec_axes(spec[logical.index("embed")]) if a not in taken)


def experts_parallel(x_BTD, weights_BTK, experts_BTK, wi_gate_EDI, wi_up_EDI, wo_EID, *,
                     ctx: sharding.ShardingContext, impl: str = "auto", dispatch: str = "ragged_a2a") -> jax.Array:
    """Routed experts under a mesh, [B, T, D] fp32.

    Inside one `shard_map` over the whole mesh: tokens keep the `batch`/`length` sharding, expert
    weights are split over the `experts` rule's axes (E/ep local experts) and their `expert_mlp`
    dim over its axes (partial sums, psum'd at the end); the embed dim enters FSDP-sharded and is
    all-gathered inside, so its gradient leaves reduce-scattered onto the parameter's shards.
    Tokens sharded over the expert axes go through `dispatch`; tokens replicated there (a batch too
    small to split) run the local experts and psum. Without expert axes every device runs all
    experts on its own tokens."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"unknown moe_dispatch {dispatch!r}; expected one of {DISPATCHES}")
    mesh = ctx.mesh
    b, t, d = x_BTD.shape
    e, _, i = wi_gate_EDI.shape
    tok = ctx.spec(("batch", "length"), (b, t), what="MoE tokens")
    tok_axes = set(sharding.spec_axes(tok[0])) | set(sharding.spec_axes(tok[1]))
    ep_axes = sharding.spec_axes(ctx.spec(("experts",), (e,), what="MoE experts")[0])
    mlp_axes = tuple(a for a in sharding.spec_axes(ctx.spec(("expert_mlp",), (i,), what="MoE expert_mlp")[0])
                     if a not in tok_axes and a not in ep_axes)
    ep = 1
    for a in ep_axes:
        ep *= mesh.shape[a]
    over_ep = [a in tok_axes for a in ep_axes]
    if any(over_ep) and not all(over_ep):
        raise NotImplementedError(f"tokens sharded over only some expert axes {ep_axes} (token axes {sorted(tok_axes)})")
    platform = mesh.devices.flat[0].platform
    impl = resolve_impl(impl, platform, rows=b * t * weights_BTK.shape[-1], experts=e)
    x_spec = jax.sharding.PartitionSpec(tok[0], tok[1], None)
    e_ax, m_ax = (ep_axes or None), (mlp_axes or None)
    # the embed dim enters sharded as the parameter is (FSDP) and is all-gathered inside: the
    # transpose of that all-gather is a reduce-scatter of the weight gradient onto the parameter's
    # shards. Entering replicated instead, shard_map's transpose psums the whole [E, D, I]
    # cotangent over every axis the spec leaves out: an all-reduce per weight, per layer, per
    # micro-batch (~1.2 TB/chip/step in the agent_long 32K plan).
    gi = _embed_axes(ctx, ("experts", "embed", "expert_mlp"), wi_gate_EDI.shape, ep_axes + mlp_axes)
    go = _embed_axes(ctx, ("experts", "expert_mlp", "embed"), wo_EID.shape, ep_axes + mlp_axes)
    w_in = jax.sharding.PartitionSpec(e_ax, gi or None, m_ax)
    w_out = jax.sharding.PartitionSpec(e_ax, m_ax, go or None)

    def body(x, w, ex, wg, wu, wo):
        bl, tl, _ = x.shape
        k, il = ex.shape[-1], wg.shape[-1]
        # gate and up joined on this device's shard, then gathered as one [E, D, 2I] weight: the
        # concat moves 1/FSDP of the weights (its transpose splits the reduce-scattered shard), not a
        # whole gathered copy per call
        wgu = jnp.concatenate([wg, wu], axis=-1)
        if gi:
            wgu = jax.lax.all_gather(wgu, gi, axis=1, tiled=True)
        if go:
            wo = jax.lax.all_gather(wo, go, axis=2, tiled=True)
        args = (x.reshape(bl * tl, d), w.reshape(bl * tl, k), ex.reshape(bl * tl, k), wgu, wo)
        if ep == 1:
            y = (EXPERT_IMPLS[impl](*args[:3], wgu[..., :il], wgu[..., il:], wo) if impl in ("dense", "capacity")
                 else _experts_sorted_fused(*args, impl=impl, platform=platform))
        elif not all(over_ep):
            y = _dispatch_ring(*args, axes=ep_axes, ep=ep, impl=impl, platform=platform, gather=False)
        elif dispatch == "ring":
            y = _dispatch_ring(*args, axes=ep_axes, ep=ep, impl=impl, platform=platform, gather=True)
        else:
            y = _dispatch_a2a(*args, axes=ep_axes, ep=ep, impl=impl, platform=platform)
        if mlp_axes:
            y = jax.lax.psum(y, mlp_axes)
        return y.reshape(bl, tl, d)

    # check_vma=False: the megablox `tgmm` pallas_call declares no varying-axes type (and with
    # check_vma=True, jax 0.10.2 also drops the psum from the cotangent of an invariant operand
    # gathered with per-device indices: wrong token gradients when tokens are replicated over the
    # expert axis). The output spec is honest: the body psums over every axis the tokens are
    # replicated on and the weights are split over.
    fn = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, w_in, w_in, w_out), out_specs=x_spec,
                       check_vma=False)
    return fn(x_BTD, weights_BTK, experts_BTK, wi_gate_EDI, wi_up_EDI, wo_EID)


class MoE(nnx.Module):
    """Routed experts + shared expert: `moe(x) = sum_k w_k E_k(x) + sigmoid(x W_sg) S(x)`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd, dt = dtype_of(cfg.param_dtype), dtype_of(cfg.dtype)
        d, e, i, si = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        kw = dict(rngs=rngs, param_dtype=pd, dtype=dt)
        self.router = Dense(d, e, ("embed", "router_experts"), **kw)
        self.wi_gate = make_param(rngs, normal(), (e, d, i), ("experts", "embed", "expert_mlp"), pd)
        self.wi_up = make_param(rngs, normal(), (e, d, i), ("experts", "embed", "expert_mlp"), pd)
        self.wo = make_param(rngs, normal(), (e, i, d), ("experts", "expert_mlp", "embed"), pd)
        self.shared_gate_proj = Dense(d, si, ("embed", "mlp"), **kw)
        self.shared_up_proj = Dense(d, si, ("embed", "mlp"), **kw)
        self.shared_down_proj = Dense(si, d, ("mlp", "embed"), **kw)
        self.shared_gate = Dense(d, 1, ("embed", None), **kw)
        self.top_k, self.impl, self.dtype = cfg.num_experts_per_tok, cfg.moe_impl, dt
        self.coreset = cfg.moe_block_coreset
        self.dispatch = getattr(cfg, "moe_dispatch", "ragged_a2a")

    def _allowed(self, ctx: dict[str, Any], used: dict[str, jax.Array]) -> Callable[[jax.Array], jax.Array] | None:
        """The block coreset of this forward's noisy tokens (`moe_coreset`), or None (free routing):
        on with `moe_block_coreset` in the two-stream training forward (the noisy half, blocks of
        `ctx["moe"]["block_size"]` in `ctx["moe"]["pieces"]` context runs) and in a block step (the
        canvas is one block per row; `ctx["moe"]["core"]` [B, C], where `ctx["moe"]["use_core"]` is
        true, replaces the canvas' own coreset: decoding's `coreset: first_step`); the clean stream
        and AR forwards route freely. A block step's coresets [B, C] land in `used["core"]`."""
        stream = ctx.get("stream", "ar")
        if self.coreset is None or stream == "ar":
            return None
        c, valid, moe_ctx = self.coreset, ctx["valid"], ctx.get("moe", {})

        def allowed(probs_BSE: jax.Array) -> jax.Array:
            if stream == "block_step":
                blocks = probs_BSE[:, None]  # [B, 1, K, E]: the canvas is one block
                core = moe_coreset.block_coresets(blocks, valid[:, None], c)[:, 0]
                if "core" in moe_ctx:
                    core = jnp.where(moe_ctx["use_core"], moe_ctx["core"], core)
                used["core"] = core
                return moe_coreset.mask_of(core[:, None], blocks.shape)[:, 0]
            bk, pieces = moe_ctx["block_size"], moe_ctx["pieces"]
            _, noisy = split_streams(probs_BSE)
            _, noisy_valid = split_streams(valid)
            free = jnp.ones(noisy.shape, bool)
            return join_streams(free, moe_coreset.restrict(noisy, noisy_valid, c, bk, pieces))

        return allowed

    def __call__(self, x_BTD: jax.Array, ctx: dict[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B, T, D] -> ([B, T, D], aux {"lb_loss": scalar, "expert_counts": [E]}, plus "coreset"
        [B, C] in a block step with the coreset on).
        `ctx["valid"]` [B, T] excludes pad tokens from the load statistics (and from a block's
        coreset mass); `ctx["stream"]` and `ctx["moe"]` say where the block coreset applies."""
        b, t, d = x_BTD.shape
        w = lambda name: expert_weight(self, name, self.dtype)  # noqa: E731  (LoRA merged, if any)
        used: dict[str, jax.Array] = {}  # the block step's coresets, filled while routing
        mesh_ctx = sharding.current()
        if mesh_ctx is not None and mesh_ctx.mesh.size > 1:
            # [B, T] kept apart: with rows over the batch axes and T over `context`, flattening to
            # [B*T] is no sharding XLA can hold once a device has more than one row, so it would
            # all-gather every row's whole sequence over `context` (bf16 and fp32 [rows, 2T, D]
            # per layer in the agent_long plans)
            x = x_BTD.astype(self.dtype)
            probs, weights, experts = route(self.router(x), self.top_k, self._allowed(ctx, used))
            routed = experts_parallel(x, weights, experts, w("wi_gate"), w("wi_up"), w("wo"), ctx=mesh_ctx,
                                      impl=self.impl, dispatch=self.dispatch)
            valid = ctx["valid"]
        else:
            x = x_BTD.astype(self.dtype)
            # routed per row ([B, T]: a block coreset needs the blocks), then flat: [B*T] rows
            probs, weights, experts = route(self.router(x), self.top_k, self._allowed(ctx, used))
            x, probs, weights, experts = (a.reshape((b * t,) + a.shape[2:]) for a in (x, probs, weights, experts))
            impl = resolve_impl(self.impl, rows=experts.size, experts=self.wi_gate[...].shape[0])
            routed = EXPERT_IMPLS[impl](x, weights, experts, w("wi_gate"), w("wi_up"), w("wo"))
            valid = ctx["valid"].reshape(-1)
        lk = ctx.get("lora_key")  # the shared expert's adapters' dropout (training)
        shared = self.shared_down_proj(jax.nn.silu(self.shared_gate_proj(x, lk)) * self.shared_up_proj(x, lk), lk)
        gate = jax.nn.sigmoid(self.shared_gate(x).astype(jnp.float32))
        y = remat.tag(routed + gate * shared.astype(jnp.float32), remat.MOE_OUT)
        lb, counts = load_balancing_loss(probs, experts, valid)
        aux = {"lb_loss": lb, "expert_counts": counts} | ({"coreset": used["core"]} if "core" in used else {})
        return y.astype(x_BTD.dtype).reshape(b, t, d), aux
