"""Per-chunk building blocks of the chunked gated delta rule (the aux layout, the matmul policy, the
triangular inverse, row / column moves) and the one-step per-chunk forward, the oracle of the phase
split (:mod:`pallas_kernels.gdn.phase_math`) that the kernels run.

These functions work on plain 2-D arrays of ONE (batch, head, value-block) and one chunk, using only
ops that lower in every Pallas backend we target (Mosaic TPU, Triton GPU, interpret): 2-D dots
(NN, NT, TN), elementwise math, ``where``, 2-D iota and axis reductions. No slicing of values, no
transposes of vectors, no cumsum, no triangular solve. One exception, the GPU form's triangular
inverse (:func:`invert_unit_lower_blocked`): it splits and joins values in halves, as Triton and the
interpreter allow. The Pallas kernels call them (through the phase math) on the blocks they load.

Chunk inputs (C = chunk length, K = key dim, W = width of the value block, a slice of dv):

- ``q_CK`` (unscaled, the kernel applies ``scale``), ``k_CK``, ``v_CW``;
- ``aux_AC`` fp32 [AUX_WIDTH, C], per-token scalars precomputed outside the kernel (O(T) jnp, so
  autodiff of that prep chains the kernel's d_aux back to g, beta), one quantity per row (tokens on
  the lane axis: an [.., AUX_WIDTH, C] array tiles densely on TPU, a [.., C, AUX_WIDTH] one would
  pad 8 lanes to 128): rows
  ``CUM``   segment-restarting cumsum of g inside the chunk,
  ``BETA``  beta,
  ``EIN``   exp(cum) where the carried-in state reaches the token (same document as the token before
            the chunk), else 0,
  ``EOUT``  exp(cum_last - cum) where the token is in the chunk's last document, else 0,
  ``SDEC``  the chunk's decay of the carried-in state (exp(cum_last) if the whole chunk continues the
            previous document, else 0), the same value for every token,
  ``RUN``   document index of the token (a float holding a small int; masks only, no gradient);
- ``S_KW`` fp32: the state before the chunk.

Per chunk (all fp32; ``diag(x)`` scales rows):
    E_ij  = exp(cum_i - cum_j) on [same document], Dat = E * [j <= i], Dut = E * [j < i]
    A     = diag(beta) (k k^T) * Dut,  T = (I + A)^-1                 (UT transform)
    R     = diag(beta) (v - diag(ein) k S),  delta = T R               (the chunk's delta-rule updates)
    o     = diag(ein) (q s) S + ((q s) k^T * Dat) delta                (s = scale)
    S'    = sdec S + (diag(eout) k)^T delta
This equals the reference's u - w S form (u = T beta v, w = T beta ein k) with one C^2 K matmul less.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

AUX_WIDTH = 8
CUM, BETA, EIN, EOUT, SDEC, RUN = range(6)

_NN = (((1,), (0,)), ((), ()))
DIMS_NT = (((1,), (1,)), ((), ()))   # a @ b.T
DIMS_TN = (((0,), (0,)), ((), ()))   # a.T @ b


class MatmulPolicy:
    """How the chunk dots run: fp32 at HIGHEST precision (fp32 inputs) or with operands cast to the
    low-precision input dtype and fp32 accumulation (bf16 inputs). The triangular inverse itself
    always runs in fp32 at HIGHEST precision (``exact``): it is the ill-conditioned step. Applying it
    (T R, and T^T / delta in the backward) takes the low-precision path, as fla applies its fp32
    inverse stored in the input dtype: measured on near-repeated keys with beta ~ 1, the bf16 error
    is the same either way (it comes from rounding the inputs)."""

    def __init__(self, low_dtype: jnp.dtype | None):
        self.low_dtype = low_dtype

    def dot(self, a: jax.Array, b: jax.Array, dims=_NN, exact: bool = False) -> jax.Array:
        if self.low_dtype is None or exact:
            return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32)
        # Explicit DEFAULT: a global jax_default_matmul_precision="highest" would otherwise ask
        # Mosaic for an fp32 contraction of bf16 operands, which it rejects.
        return lax.dot_general(a.astype(self.low_dtype), b.astype(self.low_dtype), dims,
                               precision=lax.Precision.DEFAULT, preferred_element_type=jnp.float32)


def iota2d(shape: tuple[int, int], axis: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def aux_row(aux_AC: jax.Array, r: int) -> jax.Array:
    """Row ``r`` of aux as [1, C] (a masked sublane sum: value slicing does not lower everywhere)."""
    return jnp.sum(jnp.where(iota2d(aux_AC.shape, 0) == r, aux_AC, 0.0), axis=0, keepdims=True)


def col_to_row(x_C1: jax.Array) -> jax.Array:
    """[C, 1] -> [1, C] exactly (masked sublane sum: no vector transpose needed)."""
    n = x_C1.shape[0]
    return jnp.sum(jnp.where(iota2d((n, n), 0) == iota2d((n, n), 1), x_C1, 0.0), axis=0, keepdims=True)


def row_to_col(x_1C: jax.Array) -> jax.Array:
    """[1, C] -> [C, 1] exactly."""
    n = x_1C.shape[1]
    return jnp.sum(jnp.where(iota2d((n, n), 0) == iota2d((n, n), 1), x_1C, 0.0), axis=1, keepdims=True)


def invert_unit_lower(A_CC: jax.Array, mm: MatmulPolicy) -> jax.Array:
    """(I + A)^-1 for strictly lower-triangular A [C, C], by recursive block inversion.

    Start from the inverse of the 1x1 diagonal blocks (I) and repeatedly merge neighbouring blocks of
    size b into blocks of size 2b: [[T1, 0], [A21, I + ...]]^-1 has off-diagonal block -T2 A21 T1,
    i.e. T <- T - T (A masked to those blocks) T while T is block diagonal. 2 ceil(log2 C) matmuls.
    Unlike the Neumann product (I - A)(I + A^2)(I + A^4)..., whose powers of A blow up and cancel when
    keys repeat (beta ~ 1, g ~ 0), every intermediate here is a block of the true inverse.
    """
    n = A_CC.shape[0]
    i, j = iota2d((n, n), 0), iota2d((n, n), 1)
    T = jnp.where(i == j, 1.0, 0.0).astype(jnp.float32)
    s = 0  # block size b = 2**s; shifts, not floor division (jnp's // lowers through sign on Mosaic)
    while (1 << s) < n:
        bi, bj = lax.shift_right_logical(i, s), lax.shift_right_logical(j, s)
        off = (lax.shift_right_logical(bi, 1) == lax.shift_right_logical(bj, 1)) & ((bi & 1) == 1) & ((bj & 1) == 0)
        T = T - mm.dot(mm.dot(T, jnp.where(off, A_CC, 0.0), exact=True), T, exact=True)
        s += 1
    return T


#: the triangular inverses of the chunk matrix (``KernelConfig.inverse``): one interface, (A, mm) -> T
INVERSES = ("doubling", "blocked")
#: diagonal tile of the blocked inverse: fla's solve_tril tile, the smallest Triton dot operand
LEAF = 16


def _halves(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """Two equal halves along ``axis`` (lax.split: Triton lowers equal power-of-two splits)."""
    a, b = jnp.split(x, 2, axis=axis)
    return a, b


def _join(a: jax.Array, b: jax.Array, axis: int) -> jax.Array:
    """[a; b] (axis 0) or [a, b] (axis 1) for equal 2-D blocks. Triton lowers a concatenation only of
    [..., 1] pieces, so: stack on a new last axis (its 2-way join), move that axis in front of
    ``axis`` and merge the two."""
    n, m = a.shape
    s = jnp.stack([a, b], axis=-1)                                   # [n, m, 2]
    if axis == 0:
        return jnp.transpose(s, (2, 0, 1)).reshape(2 * n, m)
    return jnp.transpose(s, (0, 2, 1)).reshape(n, 2 * m)


def invert_unit_lower_leaf(A_nn: jax.Array) -> jax.Array:
    """(I + A)^-1 of a small strictly lower-triangular A [n, n] by forward substitution, no matmul:
    row r of T is e_r - sum_{m<r} A[r, m] T[m, :] (rows m < r are final by then), n - 1 dependent
    row steps of elementwise work and one sublane reduction each. Stable like any substitution: no
    power of A is formed."""
    n = A_nn.shape[0]
    i, j = iota2d((n, n), 0), iota2d((n, n), 1)
    At = jnp.transpose(A_nn)   # column r of A^T = row r of A laid along the sublanes, as the step needs
    e_1n = iota2d((1, n), 1)
    T = jnp.where(i == j, 1.0, 0.0).astype(jnp.float32)
    for r in range(1, n):
        a_n1 = jnp.sum(jnp.where(j == r, At, 0.0), axis=1, keepdims=True)   # A[r, m] at row m: off the chain
        row = jnp.where(e_1n == r, 1.0, 0.0) - jnp.sum(a_n1 * T, axis=0, keepdims=True)
        T = jnp.where(i == r, row, T)
    return T


def invert_unit_lower_blocked(A_CC: jax.Array, mm: MatmulPolicy) -> jax.Array:
    """(I + A)^-1 for strictly lower-triangular A [C, C], blocked as fla's solve_tril: the LEAF x LEAF
    diagonal tiles by substitution (:func:`invert_unit_lower_leaf`, all tiles independent), then
    merged pairwise, LEAF -> 2 LEAF -> ... -> C, by [[A11, 0], [A21, A22]] -> [[T11, 0], [-T22 A21 T11,
    T22]]: 2 dependent matmuls per merge level on the blocks themselves (16 x 16, 32 x 32, ...), where
    :func:`invert_unit_lower` runs all 2 log2(C) of its matmuls at C x C x C on masked full matrices.
    Same interface and the same true-inverse blocks at every step. Value splits and joins: lowers in
    Triton and the interpreter (the GPU form's default); the TPU form keeps the doubling inverse.
    C must halve down to <= LEAF (a power of two times at most LEAF, as Triton needs anyway)."""
    n = A_CC.shape[0]
    while n > LEAF:
        if n % 2:
            raise ValueError(f"blocked inverse: chunk size {A_CC.shape[0]} does not halve to tiles of <= {LEAF}")
        n //= 2
    return _blocked(A_CC, mm)


def _blocked(A_CC: jax.Array, mm: MatmulPolicy) -> jax.Array:
    if A_CC.shape[0] <= LEAF:
        return invert_unit_lower_leaf(A_CC)
    top, bottom = _halves(A_CC, 0)
    A11, _ = _halves(top, 1)
    A21, A22 = _halves(bottom, 1)
    T11, T22 = _blocked(A11, mm), _blocked(A22, mm)
    T21 = -mm.dot(mm.dot(T22, A21, exact=True), T11, exact=True)
    return _join(_join(T11, jnp.zeros_like(T11), 1), _join(T21, T22, 1), 0)


def invert(A_CC: jax.Array, mm: MatmulPolicy, inverse: str = "doubling") -> jax.Array:
    """T = (I + A)^-1 by the named method of :data:`INVERSES` (both exact up to fp32 round-off)."""
    if inverse == "doubling":
        return invert_unit_lower(A_CC, mm)
    if inverse == "blocked":
        return invert_unit_lower_blocked(A_CC, mm)
    raise ValueError(f"inverse must be one of {INVERSES}; got {inverse!r}")


def _chunk_common(q_CK, k_CK, v_CW, aux_AC, S_KW, scale: float, mm: MatmulPolicy):
    """Recomputable intermediates shared by forward and backward."""
    f32 = jnp.float32
    C = q_CK.shape[0]
    q = q_CK.astype(f32) * scale
    k = k_CK.astype(f32)
    v = v_CW.astype(f32)
    cum_r, run_r = aux_row(aux_AC, CUM), aux_row(aux_AC, RUN)
    cum, run, beta, ein, eout = (row_to_col(r) for r in (
        cum_r, run_r, aux_row(aux_AC, BETA), aux_row(aux_AC, EIN), aux_row(aux_AC, EOUT)))
    sdec_11 = jnp.max(aux_row(aux_AC, SDEC), axis=1, keepdims=True)
    i, j = iota2d((C, C), 0), iota2d((C, C), 1)
    same = run == run_r
    m_at = same & (j <= i)
    m_ut = same & (j < i)
    diff = cum - cum_r
    # Masked exponents are zeroed before exp: a future / other-document entry can be positive.
    E_at = jnp.where(m_at, jnp.exp(jnp.where(m_at, diff, 0.0)), 0.0)
    E_ut = jnp.where(m_ut, E_at, 0.0)
    G = mm.dot(k, k, DIMS_NT)
    A = beta * G * E_ut
    T = invert_unit_lower(A, mm)
    KS = mm.dot(k, S_KW)
    R = beta * (v - ein * KS)
    delta = mm.dot(T, R)
    QK = mm.dot(q, k, DIMS_NT)
    P = QK * E_at
    return dict(q=q, k=k, v=v, beta=beta, ein=ein, eout=eout, sdec=sdec_11, E_at=E_at, E_ut=E_ut,
                G=G, T=T, KS=KS, delta=delta, QK=QK, P=P)


def chunk_forward(q_CK, k_CK, v_CW, aux_AC, S_KW, *, scale: float, mm: MatmulPolicy):
    """One chunk in one step: returns (o_CW fp32, S'_KW fp32). See the module docstring for the math.
    The kernels run the phase split of :mod:`pallas_kernels.gdn.phase_math`; this one-step form is
    its per-chunk oracle (tests/kernels/gdn/test_phase_math.py)."""
    x = _chunk_common(q_CK, k_CK, v_CW, aux_AC, S_KW, scale, mm)
    o = x["ein"] * mm.dot(x["q"], S_KW) + mm.dot(x["P"], x["delta"])
    S_new = x["sdec"] * S_KW + mm.dot(x["eout"] * x["k"], x["delta"], DIMS_TN)
    return o, S_new
