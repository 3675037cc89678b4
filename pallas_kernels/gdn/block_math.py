"""Per-block math of the Clover block-mode GDN readout (docs/design.md 3.2 B), forward and backward.

Same rules as :mod:`pallas_kernels.gdn.chunk_math` (2-D arrays of one (batch, head, value-block),
ops that lower on Mosaic, Triton and the interpreter). For one noisy block of Bk tokens:

- ``qn_BK``, ``kn_BK`` (l2-normalised, unscaled), ``vn_BW``;
- ``auxn_AB`` fp32 [AUX_WIDTH, Bk], rows ``RUN_N`` (document index, masks only), ``ALPHA`` (the
  head's alpha, the same for every token), ``LHIST`` (the history logit beta + gamma log Bk where
  the token continues the document the history state belongs to, else ``HIST_OFF``);
- ``S_KW`` fp32: the clean-stream state entering the block.

    L    = alpha (qn kn^T) on [same document], lh = LHIST           (no decay, no causal mask)
    p    = softmax over [L_i., lh_i]  (the history unit only where LHIST is on)
    o    = p_in vn + p_hist (qn scale) S
"""

from __future__ import annotations

import jax.numpy as jnp

from .chunk_math import DIMS_NT, DIMS_TN, AUX_WIDTH, MatmulPolicy, iota2d, aux_row, col_to_row, row_to_col

RUN_N, ALPHA, LHIST = range(3)
HIST_OFF = -1e30     # LHIST sentinel: no history unit for this token
_NEG = -1e30         # masked logit (finite: exp underflows to exactly 0, no inf - inf)


def _probs(qn, kn, auxn, mm: MatmulPolicy):
    """Normalised in-block probabilities [Bk, Bk], history probabilities [Bk, 1], and q.k [Bk, Bk]."""
    run_r = aux_row(auxn, RUN_N)
    run = row_to_col(run_r)
    alpha = jnp.max(aux_row(auxn, ALPHA), axis=1, keepdims=True)          # (1, 1)
    lh = row_to_col(aux_row(auxn, LHIST))
    hist_on = lh > 0.5 * HIST_OFF
    G = mm.dot(qn, kn, DIMS_NT)
    same = run == run_r
    L = jnp.where(same, alpha * G, _NEG)
    lh = jnp.where(hist_on, lh, _NEG)
    m = jnp.maximum(jnp.max(L, axis=1, keepdims=True), lh)
    P = jnp.where(same, jnp.exp(L - m), 0.0)
    ph = jnp.where(hist_on, jnp.exp(lh - m), 0.0)
    inv_z = 1.0 / (jnp.sum(P, axis=1, keepdims=True) + ph)
    return P * inv_z, ph * inv_z, G, alpha


def readout_combine(qn_BK, kn_BK, vn_BW, auxn_AB, r_BW, mm: MatmulPolicy):
    """Noisy-block output from its history readout r = (qn scale) S given: (o [Bk, W], the history
    probability as a row [1, Bk]), fp32. Blocks may share the tile when RUN_N never matches across them."""
    f32 = jnp.float32
    P, ph, _, _ = _probs(qn_BK.astype(f32), kn_BK.astype(f32), auxn_AB, mm)
    return mm.dot(P, vn_BW.astype(f32)) + ph * r_BW, col_to_row(ph)


def readout_combine_backward(qn_BK, kn_BK, vn_BW, auxn_AB, r_BW, dO_BW, mm: MatmulPolicy):
    """Reverse-mode of :func:`readout_combine` (its o) given the readout r: (dqn, dkn, dvn, dauxn
    [AUX_WIDTH, Bk], dr [Bk, W]), fp32; dqn holds only the softmax's share (not the readout's)."""
    f32 = jnp.float32
    qn, kn, vn = qn_BK.astype(f32), kn_BK.astype(f32), vn_BW.astype(f32)
    dO = dO_BW.astype(f32)
    Bk = qn.shape[0]
    P, ph, G, alpha = _probs(qn, kn, auxn_AB, mm)
    o = mm.dot(P, vn) + ph * r_BW
    dvn = mm.dot(P, dO, DIMS_TN)
    # softmax over [L, lh]: dlogit = p (dp - rho), rho = sum_j p_j dp_j = dO . o
    rho = jnp.sum(dO * o, axis=1, keepdims=True)
    dL = P * (mm.dot(dO, vn, DIMS_NT) - rho)
    dlh = ph * (jnp.sum(dO * r_BW, axis=1, keepdims=True) - rho)
    dq = alpha * mm.dot(dL, kn)
    dk = alpha * mm.dot(dL, qn, DIMS_TN)
    dalpha = jnp.sum(dL * G, axis=1, keepdims=True)
    rows = iota2d((AUX_WIDTH, Bk), 0)
    dauxn = jnp.where(rows == ALPHA, col_to_row(dalpha), 0.0) + jnp.where(rows == LHIST, col_to_row(dlh), 0.0)
    return dq, dk, dvn, dauxn, ph * dO
