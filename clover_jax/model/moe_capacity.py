"""The `capacity` grouped expert FFN (the CPU path of `clover_jax.model.moe`): batched matmuls over a
fixed per-expert capacity, with an exact overflow.

Rows are sorted by expert (N of them; row r reads source row `src_N[r]` of x, e.g. its token). Each
expert's first C rows go to a [G, C, D] buffer that runs as one batched SwiGLU over all experts
(`y = (silu(x Wg) * (x Wu)) Wo`, gate and up as one [D, 2I] product). Rows past an expert's capacity
run in a loop over row blocks of that expert (a dynamic trip count: a balanced routing runs none),
each block gathering its rows straight from x and writing its outputs into the sorted output in
place. Nothing is dropped and no buffer is sized for the worst case but the [N, D] output itself.
Empty capacity slots hold zero rows, whose outputs and weight-gradient contributions are exactly 0.

Why: on XLA:CPU one batched dot over [G, C, D] runs near the measured matmul peak, a loop of
per-block dots at about half of it, and every worst-case-sized buffer costs its memory traffic even
when it stays empty (issue 19; `python bench/forward.py --breakdown`, rows "moe routed experts").

Row movement is by gathers only: `gather_rows`'s custom VJP gathers the cotangent back through the
inverse map (summing a token's k copies) where autodiff would emit a scatter-add; the overflow
loop's VJP recomputes its blocks' gate/up products instead of keeping an [N, 2I] residual.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.model.moe_blocked import swiglu_rows, swiglu_rows_grads

__all__ = ["CAPACITY_FACTOR", "capacity_rows", "Plan", "plan", "gather_rows", "sorted_ffn", "capacity_ffn",
           "experts_capacity"]

#: capacity per expert as a multiple of the mean rows per expert: 1.1 keeps a balanced routing's
#: largest groups (about mean + 2 sqrt(mean) at small-cpu) inside the batched part
CAPACITY_FACTOR = 1.1


def capacity_rows(rows: int, g: int, factor: float = CAPACITY_FACTOR) -> int:
    """C = `factor` x the mean rows per expert (`rows / g`), rounded up to a multiple of 8."""
    return max(8, -(-math.ceil(factor * rows / g) // 8) * 8)


def overflow_block(c: int) -> int:
    """Row block of the overflow loop: an eighth of the capacity, a power of two in [8, 128]."""
    target = max(8, min(128, c // 8))
    return 1 << (target.bit_length() - 1)


class Plan(NamedTuple):
    """Where N sorted rows go. Capacity slots: `row_C` [G*C] the row in slot (g, j) (N: empty),
    `slot_N` [N] the slot of row r (G*C: an overflow row or a row past the groups). Overflow blocks:
    `block_row0` / `block_end` / `block_e` [NB] (rows [row0, end) of expert e, at most blk), `used`
    of them in use; `over_N` [N] marks the overflow rows."""

    row_C: jax.Array
    slot_N: jax.Array
    block_row0: jax.Array
    block_end: jax.Array
    block_e: jax.Array
    used: jax.Array
    over_N: jax.Array
    capacity: int
    blk: int


def plan(group_sizes_G: jax.Array, n: int, capacity: int, blk: int) -> Plan:
    """The layout of `n` rows sorted by expert with `group_sizes` (sum <= n)."""
    g, c = group_sizes_G.shape[0], capacity
    blk = min(blk, n)
    sizes = group_sizes_G.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    s = jnp.arange(g * c, dtype=jnp.int32)
    sg, sj = s // c, s % c
    row_C = jnp.where(sj < sizes[sg], starts[sg] + sj, n)
    r = jnp.arange(n, dtype=jnp.int32)
    rg = jnp.minimum(jnp.searchsorted(ends, r, side="right"), g - 1).astype(jnp.int32)
    rj = r - starts[rg]
    real = r < ends[-1]
    slot_N = jnp.where(real & (rj < c), rg * c + rj, g * c)
    # blocks: sum_g ceil(over_g / blk) <= (n - c) / blk + (groups that overflow, < n / c + 1)
    nb = max(1, -(-max(n - c, 0) // blk) + min(g, n // c + 1))
    nblk = -(-jnp.maximum(sizes - c, 0) // blk)
    bends = jnp.cumsum(nblk)
    b = jnp.arange(nb, dtype=jnp.int32)
    be = jnp.minimum(jnp.searchsorted(bends, b, side="right"), g - 1).astype(jnp.int32)
    row0 = starts[be] + c + (b - (bends[be] - nblk[be])) * blk
    return Plan(row_C, slot_N, row0, ends[be], be, bends[-1], real & (rj >= c), c, blk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_rows(x_AD: jax.Array, idx_B: jax.Array, inv_AK: jax.Array, in_bounds: bool = False) -> jax.Array:
    """`out[b] = x[idx[b]]`, zero where `idx[b]` is out of range. `inv_AK[a]` lists the K positions b
    that read row a (out of range: unused); the two maps must be each other's inverse (the VJP
    gathers the cotangent through `inv` and sums over K, in fp32). `in_bounds`: the caller promises
    every index of both maps is in range (no select pass for out-of-range rows). [B, D]."""
    return _take_rows(x_AD, idx_B, in_bounds)


def _take_rows(x: jax.Array, idx: jax.Array, in_bounds: bool) -> jax.Array:
    if in_bounds:
        return x.at[idx].get(mode="promise_in_bounds")
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


def _gather_rows_fwd(x_AD, idx_B, inv_AK, in_bounds):
    return gather_rows(x_AD, idx_B, inv_AK, in_bounds), inv_AK


def _gather_rows_bwd(in_bounds, inv_AK, ct_BD):
    a, k = inv_AK.shape
    got = _take_rows(ct_BD, inv_AK.reshape(-1), in_bounds)
    return got.reshape(a, k, -1).astype(jnp.float32).sum(axis=1).astype(ct_BD.dtype), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _block(p: Plan, src_N: jax.Array, n_rows: int, nsrc: int, b):
    """Block b: its first row (moved back so the window fits in [0, N)), its expert, the window's
    source rows (`nsrc`, out of range, where a row is not the block's) and that validity [blk]."""
    row0 = jnp.minimum(p.block_row0[b], n_rows - p.blk)
    rows = row0 + jnp.arange(p.blk, dtype=jnp.int32)
    ok = (rows >= p.block_row0[b]) & (rows < p.block_end[b])
    return row0, p.block_e[b], jnp.where(ok, src_N[rows], nsrc), ok


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _overflow(x_AD, src_N, y_ND, wgu_GDJ, wo_GID, p_arrays, p_static):
    """`y` with each overflow row r replaced by its expert's SwiGLU of `x[src[r]]`. [N, D] fp32."""
    p = Plan(*p_arrays, *p_static)
    n, dt = y_ND.shape[0], x_AD.dtype

    def body(b, y):
        row0, e, src, ok = _block(p, src_N, n, x_AD.shape[0], b)
        out, _ = swiglu_rows(jnp.take(x_AD, src, axis=0, mode="fill", fill_value=0), wgu_GDJ[e], wo_GID[e], dt)
        old = jax.lax.dynamic_slice_in_dim(y, row0, p.blk)
        return jax.lax.dynamic_update_slice_in_dim(y, jnp.where(ok[:, None], out, old), row0, 0)

    return jax.lax.fori_loop(0, p.used, body, y_ND.astype(jnp.float32))


def _overflow_fwd(x_AD, src_N, y_ND, wgu_GDJ, wo_GID, p_arrays, p_static):
    return _overflow(x_AD, src_N, y_ND, wgu_GDJ, wo_GID, p_arrays, p_static), (x_AD, src_N, wgu_GDJ, wo_GID, p_arrays)


def _overflow_bwd(p_static, res, ct_ND):
    x_AD, src_N, wgu_GDJ, wo_GID, p_arrays = res
    p = Plan(*p_arrays, *p_static)
    n, dt = ct_ND.shape[0], x_AD.dtype

    def body(b, carry):  # the forward's block, recomputed; then its SwiGLU backward
        dx, dwgu, dwo = carry
        row0, e, src, ok = _block(p, src_N, n, x_AD.shape[0], b)
        x = jnp.take(x_AD, src, axis=0, mode="fill", fill_value=0)
        _, hu = swiglu_rows(x, wgu_GDJ[e], wo_GID[e], dt)
        dy = jnp.where(ok[:, None], jax.lax.dynamic_slice_in_dim(ct_ND, row0, p.blk), 0.0)
        gx, gwgu, gwo = swiglu_rows_grads(x, hu, dy, wgu_GDJ[e], wo_GID[e], dt)
        return dx.at[src].add(gx, mode="drop"), dwgu.at[e].add(gwgu), dwo.at[e].add(gwo)

    zeros = lambda a: jnp.zeros(a.shape, jnp.float32)  # noqa: E731
    dx, dwgu, dwo = jax.lax.fori_loop(0, p.used, body, (zeros(x_AD), zeros(wgu_GDJ), zeros(wo_GID)))
    dy_init = jnp.where(p.over_N[:, None], 0.0, ct_ND)
    return (dx.astype(x_AD.dtype), None, dy_init, dwgu.astype(wgu_GDJ.dtype), dwo.astype(wo_GID.dtype), None)


_overflow.defvjp(_overflow_fwd, _overflow_bwd)


def sorted_ffn(x_AD: jax.Array, src_N: jax.Array, rows_AK: jax.Array, group_sizes_G: jax.Array,
               wi_gate_GDI: jax.Array, wi_up_GDI: jax.Array, wo_GID: jax.Array, rows_hint: int | None = None
               ) -> jax.Array:
    """SwiGLU of expert g on sorted rows [start_g, start_g + size_g), row r reading `x[src_N[r]]`;
    `rows_AK[a]` lists the K sorted rows that read source a (the inverse of `src`). Rows past
    `sum(group_sizes)` come out as exact zeros. `rows_hint`: the expected number of real rows, which
    sizes the capacity (default N). [N, D] fp32."""
    n, (g, _, i) = src_N.shape[0], wi_gate_GDI.shape
    d, dt = x_AD.shape[1], x_AD.dtype
    c = capacity_rows(rows_hint or n, g)
    p = plan(group_sizes_G, n, c, overflow_block(c))
    nsrc = x_AD.shape[0]
    wgu = jnp.concatenate([wi_gate_GDI, wi_up_GDI], axis=2)
    src_C = jnp.take(src_N, p.row_C, mode="fill", fill_value=nsrc)
    x_C = gather_rows(x_AD, src_C, jnp.take(p.slot_N, rows_AK, mode="fill", fill_value=g * c))
    hu = jnp.einsum("gcd,gdj->gcj", x_C.reshape(g, c, d), wgu, preferred_element_type=jnp.float32)
    a = (jax.nn.silu(hu[..., :i]) * hu[..., i:]).astype(dt)
    y_C = jnp.einsum("gci,gid->gcd", a, wo_GID, preferred_element_type=jnp.float32).reshape(g * c, d)
    y_N = gather_rows(y_C, p.slot_N, p.row_C[:, None])
    return _overflow(x_AD, src_N, y_N, wgu, wo_GID, tuple(p[:7]), (p.capacity, p.blk))


def capacity_ffn(xs_MD: jax.Array, group_sizes_G: jax.Array, wi_gate_GDI: jax.Array, wi_up_GDI: jax.Array,
                 wo_GID: jax.Array, rows_hint: int | None = None) -> jax.Array:
    """`sorted_ffn` of rows already sorted by expert (`moe.grouped_ffn`'s contract). [M, D] fp32."""
    r = jnp.arange(xs_MD.shape[0], dtype=jnp.int32)
    return sorted_ffn(xs_MD, r, r[:, None], group_sizes_G, wi_gate_GDI, wi_up_GDI, wo_GID, rows_hint)


def experts_capacity(x_TD, weights_TK, experts_TK, wi_gate_EDI, wi_up_EDI, wo_EID) -> jax.Array:
    """Routed experts of T tokens (top-k `experts`, combine `weights`): the sorted rows read their
    tokens directly (no [T*k, D] copy of x), the k outputs of a token are gathered back from the
    sorted output and weighted. Exact, dropless. [T, D] fp32."""
    t, k = experts_TK.shape
    n = t * k
    flat_e = experts_TK.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # sorted row -> assignment (token * k + choice)
    rank = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))  # its inverse
    sizes = jnp.bincount(flat_e, length=wi_gate_EDI.shape[0])
    y_N = sorted_ffn(x_TD, order // k, rank.reshape(t, k), sizes, wi_gate_EDI, wi_up_EDI, wo_EID)
    y_A = gather_rows(y_N, rank, order[:, None], True)  # two permutations: every index in range
    return jnp.einsum("tkd,tk->td", y_A.reshape(t, k, -1), weights_TK.astype(jnp.float32))
