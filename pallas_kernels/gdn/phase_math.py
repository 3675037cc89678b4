"""Per-chunk math of the chunked causal GDN split into phases (fla's ``chunk_gated_delta_rule`` plan):
only the state recurrence is sequential, everything that touches the triangular inverse is parallel.

Same conventions and inputs as :mod:`pallas_kernels.gdn.chunk_math` (one chunk of one (batch, value
head), 2-D arrays, ops that lower in Mosaic and the interpreter; ``aux_AC`` rows CUM, BETA, EIN,
EOUT, SDEC, RUN). Per chunk (s = scale, E the in-document decays, Dat / Dut causal / strict masks):

    phase a (parallel)   A = diag(beta) (k k^T) * E * Dut,  T = (I + A)^-1
                         u = T diag(beta) v,  w = T diag(beta ein) k               (WY form)
    phase b (sequential) delta = u - w S
                         o  = diag(ein) (q s) S + P delta,  P = ((q s) k^T) * E * Dat
                         S' = sdec S + (diag(eout) k)^T delta

On the state's critical path per chunk: w S, then kd^T delta (2 dependent matmuls); q S and P delta
hang off it. The backward mirrors this: one reverse sweep carries dS through
    ddelta = P^T dO + kd dS',  dS = sdec dS' + (diag(ein) q s)^T dO - w^T ddelta
(again 2 dependent matmuls: kd dS', w^T ddelta; it needs neither S nor delta) and writes dS' per
chunk; with the states S per chunk (a forward re-sweep) every other cotangent is parallel over
chunks, from the saved inverse T (no re-inversion):
    dA = -(T^T du) u^T - (T^T dw) w^T   (= -T^T dT T^T with dT = du (beta v)^T + dw (beta ein k)^T).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import chunk_math as cm
from .chunk_math import DIMS_NT, DIMS_TN, AUX_WIDTH, BETA, CUM, EIN, EOUT, RUN, SDEC, MatmulPolicy

f32 = jnp.float32


def _scalars(aux_AC: jax.Array) -> dict[str, jax.Array]:
    """Per-token columns [C, 1] (beta, ein, eout), sdec [1, 1] and the decays E_at, E_ut [C, C]."""
    C = aux_AC.shape[1]
    cum_r, run_r = cm.aux_row(aux_AC, CUM), cm.aux_row(aux_AC, RUN)
    cum, run, beta, ein, eout = (cm.row_to_col(r) for r in (
        cum_r, run_r, cm.aux_row(aux_AC, BETA), cm.aux_row(aux_AC, EIN), cm.aux_row(aux_AC, EOUT)))
    i, j = cm.iota2d((C, C), 0), cm.iota2d((C, C), 1)
    same = run == run_r
    m_at = same & (j <= i)
    # Masked exponents are zeroed before exp: a future / other-document entry can be positive.
    E_at = jnp.where(m_at, jnp.exp(jnp.where(m_at, cum - cum_r, 0.0)), 0.0)
    E_ut = jnp.where(same & (j < i), E_at, 0.0)
    sdec = jnp.max(cm.aux_row(aux_AC, SDEC), axis=1, keepdims=True)
    return dict(beta=beta, ein=ein, eout=eout, sdec=sdec, E_at=E_at, E_ut=E_ut)


# ------------------------------------------------------------------------------------------ phase a

def chunk_inverse(k_CK: jax.Array, aux_AC: jax.Array, mm: MatmulPolicy, inverse: str = "doubling") -> jax.Array:
    """T = (I + A)^-1 [C, C] fp32 (A = diag(beta) (k k^T) * E_ut); the inverse always at fp32 HIGHEST,
    by the method ``inverse`` of ``chunk_math.INVERSES``."""
    x = _scalars(aux_AC)
    k = k_CK.astype(f32)
    A = x["beta"] * mm.dot(k, k, DIMS_NT) * x["E_ut"]
    return cm.invert(A, mm, inverse)


def chunk_wy(k_CK, v_CW, aux_AC, T_CC, mm: MatmulPolicy) -> tuple[jax.Array, jax.Array]:
    """(w [C, K], u [C, W]) fp32: w = T diag(beta ein) k, u = T diag(beta) v."""
    x = _scalars(aux_AC)
    w = mm.dot(T_CC, (x["beta"] * x["ein"]) * k_CK.astype(f32))
    u = mm.dot(T_CC, x["beta"] * v_CW.astype(f32))
    return w, u


def chunk_intra(k_CK, v_CW, aux_AC, mm: MatmulPolicy,
                inverse: str = "doubling") -> tuple[jax.Array, jax.Array, jax.Array]:
    """Phase a of one chunk: (T, w, u)."""
    T = chunk_inverse(k_CK, aux_AC, mm, inverse)
    return (T,) + chunk_wy(k_CK, v_CW, aux_AC, T, mm)


# ------------------------------------------------------------------------------------------ phase b

def sweep_terms(q_CK, k_CK, w_CK, u_CW, aux_AC, S_KW, scale: float, mm: MatmulPolicy) -> dict[str, jax.Array]:
    """Phase b's per-chunk intermediates (scalars, q s, k, qe, kd, P, delta = u - w S), fp32."""
    x = _scalars(aux_AC)
    q = q_CK.astype(f32) * scale
    k = k_CK.astype(f32)
    x.update(q=q, k=k, qe=x["ein"] * q, kd=x["eout"] * k, P=mm.dot(q, k, DIMS_NT) * x["E_at"],
             delta=chunk_delta(w_CK, u_CW, S_KW, mm))
    return x


def chunk_delta(w_CK, u_CW, S_KW, mm: MatmulPolicy) -> jax.Array:
    """delta [C, W] fp32 = u - w S: the chunk's delta-rule updates given the state before it."""
    return u_CW.astype(f32) - mm.dot(w_CK, S_KW)


def chunk_sweep(q_CK, k_CK, w_CK, u_CW, aux_AC, S_KW, *, scale: float, mm: MatmulPolicy):
    """Phase b of one chunk: (o [C, W] fp32, S' [K, W] fp32) from the state S before it."""
    return sweep_outputs(sweep_terms(q_CK, k_CK, w_CK, u_CW, aux_AC, S_KW, scale, mm), S_KW, mm)


def sweep_outputs(x: dict[str, jax.Array], S_KW, mm: MatmulPolicy) -> tuple[jax.Array, jax.Array]:
    """(o, S') from a chunk's ``sweep_terms``."""
    return sweep_output(x, S_KW, mm), next_state(x["sdec"], x["kd"], x["delta"], S_KW, mm)


def sweep_output(x: dict[str, jax.Array], S_KW, mm: MatmulPolicy) -> jax.Array:
    """o [C, W] fp32 = diag(ein) (q s) S + P delta from a chunk's ``sweep_terms``."""
    return mm.dot(x["qe"], S_KW) + mm.dot(x["P"], x["delta"])


def next_state(sdec_11, kd_CK, delta_CW, S_KW, mm: MatmulPolicy) -> jax.Array:
    """S' [K, W] fp32 = sdec S + kd^T delta (kd = diag(eout) k)."""
    return sdec_11 * S_KW + mm.dot(kd_CK, delta_CW, DIMS_TN)


def chunk_state_step(k_CK, w_CK, u_CW, aux_AC, S_KW, *, mm: MatmulPolicy) -> jax.Array:
    """Phase b's state step alone (the GPU sweep, whose output phase is a separate parallel kernel):
    S' [K, W] fp32 from the state S before the chunk. Two dependent matmuls: w S, then kd^T delta."""
    eout = cm.row_to_col(cm.aux_row(aux_AC, EOUT))
    sdec = jnp.max(cm.aux_row(aux_AC, SDEC), axis=1, keepdims=True)
    return next_state(sdec, eout * k_CK.astype(f32), chunk_delta(w_CK, u_CW, S_KW, mm), S_KW, mm)


def chunk_output(q_CK, k_CK, w_CK, u_CW, aux_AC, S_KW, *, scale: float, mm: MatmulPolicy) -> jax.Array:
    """Phase b's output alone, parallel over chunks once the states S are known: o [C, W] fp32."""
    return sweep_output(sweep_terms(q_CK, k_CK, w_CK, u_CW, aux_AC, S_KW, scale, mm), S_KW, mm)


def chunk_state_backward(q_CK, k_CK, w_CK, aux_AC, dO_CW, dSn_KW, *, scale: float, mm: MatmulPolicy,
                         ddelta_extra=None):
    """Reverse step of phase b, the only sequential part of the backward: dS [K, W] fp32, the
    cotangent of the state before the chunk, from dS' after it. Needs neither S nor delta:
    ddelta = P^T dO + kd dS',  dS = sdec dS' + qe^T dO - w^T ddelta. ``ddelta_extra`` [C, W]: a
    further cotangent of delta (block mode's mid-chunk readouts)."""
    x = _scalars(aux_AC)
    q = q_CK.astype(f32) * scale
    k = k_CK.astype(f32)
    dO = dO_CW.astype(f32)
    ddelta = mm.dot(mm.dot(q, k, DIMS_NT) * x["E_at"], dO, DIMS_TN) + mm.dot(x["eout"] * k, dSn_KW)
    if ddelta_extra is not None:
        ddelta = ddelta + ddelta_extra
    return x["sdec"] * dSn_KW + mm.dot(x["ein"] * q, dO, DIMS_TN) - mm.dot(w_CK, ddelta, DIMS_TN)


def chunk_sweep_cotangents(q_CK, k_CK, w_CK, u_CW, aux_AC, S_KW, dO_CW, dSn_KW, *, scale: float,
                           mm: MatmulPolicy, x=None, ddelta_extra=None):
    """The cotangents of phase b's inputs given the state S before the chunk and dS' after it (both
    known once the two sweeps ran, so this is parallel over chunks).

    Returns (dq_p [C, K]: dq through ein q S; dk_p [C, K]: dk through S'; dw [C, K]; du [C, W];
    delta [C, W] (for the WY backward); daux_p [AUX, C] (EIN, EOUT rows per token, SDEC at token 0)),
    all fp32. ``x``: this chunk's ``sweep_terms`` if already computed; ``ddelta_extra`` as in
    :func:`chunk_state_backward`.
    """
    if x is None:
        x = sweep_terms(q_CK, k_CK, w_CK, u_CW, aux_AC, S_KW, scale, mm)
    dO = dO_CW.astype(f32)
    delta = x["delta"]
    ddelta = mm.dot(x["P"], dO, DIMS_TN) + mm.dot(x["kd"], dSn_KW)
    if ddelta_extra is not None:
        ddelta = ddelta + ddelta_extra
    dw = -mm.dot(ddelta, S_KW, DIMS_NT)
    dqe = mm.dot(dO, S_KW, DIMS_NT)                           # d(qe), qe = ein q s
    dkd = mm.dot(delta, dSn_KW, DIMS_NT)                      # d(kd), kd = eout k
    dq_p = (x["ein"] * scale) * dqe
    dk_p = x["eout"] * dkd
    dein = jnp.sum(x["q"] * dqe, axis=1, keepdims=True)
    deout = jnp.sum(x["k"] * dkd, axis=1, keepdims=True)
    dsdec = jnp.sum(jnp.sum(S_KW * dSn_KW, axis=1, keepdims=True), axis=0, keepdims=True)
    C = q_CK.shape[0]
    rows = cm.iota2d((AUX_WIDTH, C), 0)
    first = cm.iota2d((AUX_WIDTH, C), 1) == 0
    daux = (jnp.where(rows == EIN, cm.col_to_row(dein), 0.0) + jnp.where(rows == EOUT, cm.col_to_row(deout), 0.0)
            + jnp.where((rows == SDEC) & first, dsdec, 0.0))
    return dq_p, dk_p, dw, ddelta, delta, daux


def chunk_parallel_backward(q_CK, k_CK, v_CW, aux_AC, T_CC, w_CK, u_CW, S_KW, dO_CW, dSn_KW, *, scale: float,
                            mm: MatmulPolicy, x=None, ddelta_extra=None):
    """The whole backward of one chunk but the dS recurrence: (dq, dk, dv, daux) fp32 (``x``,
    ``ddelta_extra`` as in :func:`chunk_sweep_cotangents`)."""
    dq_p, dk_p, dw, du, delta, daux_p = chunk_sweep_cotangents(
        q_CK, k_CK, w_CK, u_CW, aux_AC, S_KW, dO_CW, dSn_KW, scale=scale, mm=mm, x=x, ddelta_extra=ddelta_extra)
    dq, dk, dv, daux = chunk_intra_backward(q_CK, k_CK, v_CW, aux_AC, T_CC, w_CK, u_CW, dO_CW, delta, du, dw,
                                            scale=scale, mm=mm)
    return dq + dq_p, dk + dk_p, dv, daux + daux_p


# ------------------------------------------------------------------------------ parallel backward

def chunk_intra_backward(q_CK, k_CK, v_CW, aux_AC, T_CC, w_CK, u_CW, dO_CW, delta_CW, du_CW, dw_CK, *,
                         scale: float, mm: MatmulPolicy):
    """The parallel rest of the backward of one chunk: through P (the intra-chunk output term), the WY
    form and the inverse. Returns (dq, dk, dv, daux) fp32 (to be added to the sweep's partials)."""
    x = _scalars(aux_AC)
    beta, ein, E_at, E_ut = x["beta"], x["ein"], x["E_at"], x["E_ut"]
    q = q_CK.astype(f32) * scale
    k = k_CK.astype(f32)
    v = v_CW.astype(f32)
    dO = dO_CW.astype(f32)
    # P = (q s k^T) * E_at, output term P delta
    QK = mm.dot(q, k, DIMS_NT)
    dQK = mm.dot(dO, delta_CW, DIMS_NT) * E_at
    dq = mm.dot(dQK, k) * scale
    dk = mm.dot(dQK, q, DIMS_TN)
    # u = T (beta v), w = T (beta ein k): d(beta v) = T^T du, d(beta ein k) = T^T dw
    dbv = mm.dot(T_CC, du_CW, DIMS_TN)
    dbek = mm.dot(T_CC, dw_CK, DIMS_TN)
    dv = beta * dbv
    dk = dk + (beta * ein) * dbek
    dbeta = jnp.sum(dbv * v, axis=1, keepdims=True) + ein * jnp.sum(dbek * k, axis=1, keepdims=True)
    dein = beta * jnp.sum(dbek * k, axis=1, keepdims=True)
    # T = (I + A)^-1: dA = -T^T dT T^T = -(dbv u^T + dbek w^T)
    dA = -(mm.dot(dbv, u_CW, DIMS_NT) + mm.dot(dbek, w_CK, DIMS_NT))
    # A = beta G E_ut, G = k k^T
    G = mm.dot(k, k, DIMS_NT)
    dAE = dA * E_ut
    dbeta = dbeta + jnp.sum(dAE * G, axis=1, keepdims=True)
    dG = beta * dAE
    dk = dk + mm.dot(dG, k) + mm.dot(dG, k, DIMS_TN)
    # E_ij = exp(cum_i - cum_j): d cum_i += sum_j F_ij, d cum_j -= sum_i F_ij. The diagonal is left
    # out: E_ii = 1 whatever g, and its +F_ii / -F_ii (O(|dO| |delta|), large where the decay is fast
    # and the true dg tiny) would cancel only to fp32 round-off, a residue the reverse cumsum of dcum
    # then hands to every earlier token of the chunk (tests/kernels/gdn/test_grad_f64.py).
    C = q_CK.shape[0]
    F = jnp.where(cm.iota2d((C, C), 1) < cm.iota2d((C, C), 0), dQK * QK + dAE * beta * G, 0.0)
    dcum_r = cm.col_to_row(jnp.sum(F, axis=1, keepdims=True)) - jnp.sum(F, axis=0, keepdims=True)
    rows = cm.iota2d((AUX_WIDTH, C), 0)
    daux = (jnp.where(rows == CUM, dcum_r, 0.0) + jnp.where(rows == BETA, cm.col_to_row(dbeta), 0.0)
            + jnp.where(rows == EIN, cm.col_to_row(dein), 0.0))
    return dq, dk, dv, daux
