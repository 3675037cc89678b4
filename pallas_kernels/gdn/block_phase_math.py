"""Per-tile math of block mode on the phase split (Clover two-stream GDN, docs/design.md 3.2 B).

The clean stream is the causal phase split (:mod:`pallas_kernels.gdn.phase_math`). A noisy token i
of a block starting at row position s reads the clean state S_s after token s - 1. The sequential
sweep computes the history READOUT r_i = S_s^T (qn_i scale) while the chunk's state is in fast memory;
everything else of the noisy stream (the in-block softmax, its combination with r) is parallel.

Readout tile: R = max(Bk, C) rows starting at a chunk start. Bk >= C (a multiple): one block, the
readout of the block-start state, r = (qn s) S. Bk < C (a divisor): C / Bk blocks inside one chunk;
the state at a block start s inside the chunk comes from the chunk-start state S and the chunk's
delta rule updates (rows of delta = u - w S before s only depend on tokens before s: T is lower
triangular):

    S_s = hdec_i S + sum_{j < s, doc(j) = doc(s-1)} exp(cum_{s-1} - cum_j) k_j delta_j^T
    r   = diag(hdec) (qn s) S + Mn delta,   Mn = ((qn s) k^T) * En,  En_ij = exp(CUMB_i - cum_j) [...]

with hdec_i = ein_{s-1} (1 for the tile's first block), i.e. two matmuls per chunk for all its
readouts, the same form as the clean output (diag(ein) (q s) S + P delta).

``auxn`` fp32 [AUX_WIDTH, R] per tile: gdn.block_math's rows RUN_N (here a tile-local index of the
(block, document) piece, so one softmax tile may hold several blocks), ALPHA, LHIST, and per noisy
token BLK (the block's index in the tile), HDEC, CUMB (cum of token s - 1 in the chunk's cumsum),
RUNB (document index of token s - 1; -1 for the tile's first block).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import block_math as bm
from . import phase_math as pm
from .chunk_math import DIMS_NT, DIMS_TN, AUX_WIDTH, CUM, RUN, MatmulPolicy, iota2d, aux_row, col_to_row, row_to_col

BLK, HDEC, CUMB, RUNB = 3, 4, 5, 6
f32 = jnp.float32


def readout_decay(aux_AC, auxn_AC) -> jax.Array:
    """En [C, C]: exp(CUMB_i - cum_j) where clean token j precedes noisy row i's block start in the
    chunk and is in the document of the token before it (so it is in that block-start state)."""
    blk_r = aux_row(auxn_AC, BLK)
    cumb, runb, blk = (row_to_col(aux_row(auxn_AC, r)) for r in (CUMB, RUNB, BLK))
    m = (blk_r < blk) & (aux_row(aux_AC, RUN) == runb)
    return jnp.where(m, jnp.exp(jnp.where(m, cumb - aux_row(aux_AC, CUM), 0.0)), 0.0)


def before_block_start(auxn_AC) -> jax.Array:
    """[C, C] bool: clean token j is the token just before noisy row i's block start (j = s_i - 1,
    the s_i tokens of the blocks before i's own counted), whose En_ij = exp(CUMB_i - cum_j) is 1
    whatever g: CUMB_i is a copy of that token's cum."""
    blk_r = aux_row(auxn_AC, BLK)
    C = blk_r.shape[1]
    s_i = jnp.sum(jnp.where(blk_r < row_to_col(blk_r), 1.0, 0.0), axis=1, keepdims=True)
    return iota2d((C, C), 1).astype(f32) == s_i - 1.0


def readout_matrix(qn_CK, k_CK, aux_AC, auxn_AC, *, scale: float, mm: MatmulPolicy) -> jax.Array:
    """Mn [C, C] = ((qn s) k^T) * En: how each noisy row's block-start state reads the chunk's deltas."""
    return mm.dot(qn_CK.astype(f32) * scale, k_CK.astype(f32), DIMS_NT) * readout_decay(aux_AC, auxn_AC)


def tile_readout(qn_RK, auxn_AR, S_KW, *, scale: float, mm: MatmulPolicy, Mn=None, delta=None) -> jax.Array:
    """r [R, W] fp32: the readouts of a tile from the state at its start (``Mn``, ``delta``: Bk < C)."""
    hdec = row_to_col(aux_row(auxn_AR, HDEC))
    r = hdec * mm.dot(qn_RK.astype(f32) * scale, S_KW)
    return r if Mn is None else r + mm.dot(Mn, delta)


def readout_state_cotangents(qn_RK, auxn_AR, dr_RW, *, scale: float, mm: MatmulPolicy, Mn=None):
    """The readouts' share of the sequential backward: (dS [K, W] of the tile-start state, ddelta
    [C, W] or None)."""
    hdec = row_to_col(aux_row(auxn_AR, HDEC))
    dS = mm.dot((hdec * scale) * qn_RK.astype(f32), dr_RW, DIMS_TN)
    return dS, None if Mn is None else mm.dot(Mn, dr_RW, DIMS_TN)


def noisy_tile_backward(qn_RK, kn_RK, vn_RW, auxn_AR, S_KW, dOn_RW, *, scale: float, mm: MatmulPolicy,
                        k_CK=None, aux_AC=None, delta=None):
    """Every parallel cotangent of a readout tile's noisy output (S = the state at the tile start;
    ``k_CK, aux_AC, delta`` of the chunk when Bk < C). Returns (dqn [R, K], dkn [R, K], dvn [R, W],
    dauxn [AUX, R], and with Bk < C the clean chunk's dk [C, K], daux [AUX, C] (CUM row) and ddelta
    [C, W], else three Nones), fp32."""
    mid = k_CK is not None
    qs = qn_RK.astype(f32) * scale
    En = readout_decay(aux_AC, auxn_AR) if mid else None
    QK = mm.dot(qs, k_CK.astype(f32), DIMS_NT) if mid else None
    Mn = QK * En if mid else None
    r = tile_readout(qn_RK, auxn_AR, S_KW, scale=scale, mm=mm, Mn=Mn, delta=delta)
    dqn, dkn, dvn, dauxn, dr = bm.readout_combine_backward(qn_RK, kn_RK, vn_RW, auxn_AR, r, dOn_RW, mm)
    # r = diag(hdec) (qn s) S + Mn delta
    hdec = row_to_col(aux_row(auxn_AR, HDEC))
    drS = mm.dot(dr, S_KW, DIMS_NT)                                 # [R, K]
    dqn = dqn + (hdec * scale) * drS
    R = qs.shape[0]
    rows = iota2d((AUX_WIDTH, R), 0)
    dauxn = dauxn + jnp.where(rows == HDEC, col_to_row(jnp.sum(qs * drS, axis=1, keepdims=True)), 0.0)
    if not mid:
        return dqn, dkn, dvn, dauxn, None, None, None
    dMn = mm.dot(dr, delta, DIMS_NT)                                # [R, C]
    dQK = dMn * En
    dqn = dqn + scale * mm.dot(dQK, k_CK.astype(f32))
    dk = mm.dot(dQK, qs, DIMS_TN)
    # dEn * En (En = exp(CUMB_i - cum_j)), without the token before the block start: its exponent is
    # exactly 0 (CUMB_i copies its cum), so its +F (CUMB) / -F (cum) pair would cancel only to fp32
    # round-off, a residue the in-chunk cumsum's backward spreads over the chunk (see phase_math).
    F = jnp.where(before_block_start(auxn_AR), 0.0, dQK * QK)
    dauxn = dauxn + jnp.where(rows == CUMB, col_to_row(jnp.sum(F, axis=1, keepdims=True)), 0.0)
    C = k_CK.shape[0]
    daux = jnp.where(iota2d((AUX_WIDTH, C), 0) == CUM, -jnp.sum(F, axis=0, keepdims=True), 0.0)
    return dqn, dkn, dvn, dauxn, dk, daux, mm.dot(Mn, dr, DIMS_TN)


# ------------------------------------------------------------------ per-step compositions (kernels)

def chunk_block_sweep(q_CK, k_CK, w_CK, u_CW, aux_AC, S_KW, qn_CK, auxn_AC, *, scale: float, mm: MatmulPolicy):
    """Bk < C: the sweep step with its readouts: (o [C, W], S' [K, W], r [C, W]), fp32."""
    x = pm.sweep_terms(q_CK, k_CK, w_CK, u_CW, aux_AC, S_KW, scale, mm)
    o, S_new = pm.sweep_outputs(x, S_KW, mm)
    Mn = readout_matrix(qn_CK, k_CK, aux_AC, auxn_AC, scale=scale, mm=mm)
    return o, S_new, tile_readout(qn_CK, auxn_AC, S_KW, scale=scale, mm=mm, Mn=Mn, delta=x["delta"])


def chunk_block_state_backward(q_CK, k_CK, w_CK, aux_AC, dO_CW, dSn_KW, qn_CK, auxn_AC, ph_1C, dOn_CW, *,
                               scale: float, mm: MatmulPolicy):
    """Bk < C: the reverse sweep step with the readouts' cotangents (dr = p_hist dOn): dS [K, W]."""
    dr = row_to_col(ph_1C) * dOn_CW.astype(f32)
    Mn = readout_matrix(qn_CK, k_CK, aux_AC, auxn_AC, scale=scale, mm=mm)
    dS_r, ddelta = readout_state_cotangents(qn_CK, auxn_AC, dr, scale=scale, mm=mm, Mn=Mn)
    return pm.chunk_state_backward(q_CK, k_CK, w_CK, aux_AC, dO_CW, dSn_KW, scale=scale, mm=mm,
                                   ddelta_extra=ddelta) + dS_r


def tile_state_backward(qn_RK, auxn_AR, ph_1R, dOn_RW, *, scale: float, mm: MatmulPolicy):
    """Bk >= C: the block readout's share of dS at the block start."""
    dr = row_to_col(ph_1R) * dOn_RW.astype(f32)
    return readout_state_cotangents(qn_RK, auxn_AR, dr, scale=scale, mm=mm)[0]


def chunk_block_parallel_backward(q_CK, k_CK, v_CW, aux_AC, T_CC, w_CK, u_CW, S_KW, dO_CW, dSn_KW,
                                  qn_CK, kn_CK, vn_CW, auxn_AC, dOn_CW, *, scale: float, mm: MatmulPolicy):
    """Bk < C: both streams' parallel backward of one chunk: (dq, dk, dv, daux, dqn, dkn, dvn, dauxn)."""
    x = pm.sweep_terms(q_CK, k_CK, w_CK, u_CW, aux_AC, S_KW, scale, mm)
    dqn, dkn, dvn, dauxn, dk_r, daux_r, ddelta = noisy_tile_backward(
        qn_CK, kn_CK, vn_CW, auxn_AC, S_KW, dOn_CW, scale=scale, mm=mm, k_CK=k_CK, aux_AC=aux_AC, delta=x["delta"])
    dq, dk, dv, daux = pm.chunk_parallel_backward(q_CK, k_CK, v_CW, aux_AC, T_CC, w_CK, u_CW, S_KW, dO_CW, dSn_KW,
                                                  scale=scale, mm=mm, x=x, ddelta_extra=ddelta)
    return dq, dk + dk_r, dv, daux + daux_r, dqn, dkn, dvn, dauxn
