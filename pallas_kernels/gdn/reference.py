"""Plain-jnp reference ops for the gated delta rule (GDN), the CPU path and the kernel oracle.

Argument convention (transformers' ``torch_*_gated_delta_rule`` with ``use_qk_l2norm_in_kernel=False``):

- ``q_BTHK``, ``k_BTHK``: [B, T, HK, dk], ALREADY l2-normalised; HK = H (repeated to the value
  heads) or a divisor of H (grouped: value head h reads key head h // (H / HK), repeated here);
- ``v_BTHV``: [B, T, H, dv];
- ``g_BTH``: [B, T, H] log-decay (<= 0), ``beta_BTH``: [B, T, H] write strength in (0, 1);
- state ``state_BHKV``: [B, H, dk, dv], always fp32;
- ``segment_ids_BT``: optional int [B, T]; documents are contiguous runs of equal id and the state
  resets wherever the id differs from the previous token's (never at t = 0: a carried-in
  ``initial_state`` belongs to the segment of token 0). An id that reappears after a different id
  starts a NEW document.

Per head the recurrence is ``S = exp(g_t) S; d = beta_t (v_t - S^T k_t); S = S + k_t d^T;
o_t = S^T (q_t * scale)`` with ``scale = dk ** -0.5`` by default. All math runs in fp32; the output
has the dtype of ``v``.

Both ops are pure jnp (jit/grad/vmap friendly). Matmuls request ``Precision.HIGHEST`` so the oracle
stays fp32-accurate on TPU/GPU where the default matmul precision is lower.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .inputs import check_inputs, repeat_key_heads, reset_flags

_HI = lax.Precision.HIGHEST


def _einsum(spec: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=_HI)


def tn(lhs_XKM: jax.Array, rhs_XKP: jax.Array) -> jax.Array:
    """``out[..., m, p] = sum_k lhs[..., k, m] rhs[..., k, p]``: [..., K, M] x [..., K, P] -> [..., M, P].

    Every matmul of the chunked op has this "TN" form, both operands with the contracted axis second
    to last. Why: XLA:CPU hands row-major small batched matmuls ([X, M, K] x [X, K, P]) to YNNPACK,
    which runs them at about half the speed of the Eigen batched GEMM it uses for this form
    (bench/gdn.py, bmm columns). On TPU/GPU the kernels run instead, and XLA lays out dots itself.
    """
    lead = lhs_XKM.shape[:-2]
    lhs = lhs_XKM.reshape((-1,) + lhs_XKM.shape[-2:])
    rhs = rhs_XKP.reshape((-1,) + rhs_XKP.shape[-2:])
    return _einsum("xkm,xkp->xmp", lhs, rhs).reshape(lead + (lhs.shape[-1], rhs.shape[-1]))


def masked_exp(x: jax.Array, mask: jax.Array) -> jax.Array:
    """exp(x) where mask else 0, with the masked exponent zeroed BEFORE exp.

    Masked entries (future positions, other documents) can have positive exponents that overflow;
    inf * 0 = nan would then leak into values and gradients, hence the double where.
    """
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def decay_to_last(cum: jax.Array, mask: jax.Array) -> jax.Array:
    """masked_exp(cum[..., -1:] - cum, mask): each token's decay to the end of its chunk.

    The last token's exponent is the constant 0, not cum_last - cum_last: both forms are exactly 0
    forward, but autodiff of the difference adds +d and -d to the last cum (cancelling only to fp32
    round-off), and the in-chunk cumsum's backward hands that residue to every token of the chunk.
    """
    last = jnp.arange(cum.shape[-1]) == cum.shape[-1] - 1
    return masked_exp(jnp.where(last, 0.0, cum[..., -1:] - cum), mask)


@jax.custom_vjp
def unit_lower_inverse(A_XCC: jax.Array) -> jax.Array:
    """``(I + A)^-1`` for the strictly-lower part of ``A`` [..., C, C] (entries on/above the
    diagonal are ignored), by recursive block inversion (log2 C rounds of small matmuls), fp32.

    Why not ``jax.scipy.linalg.solve_triangular``: on CPU it lowers to LAPACK trsm custom calls that
    fan out on XLA's intra-op pool and block a pool thread while waiting; two of them running at once
    (the GDN backward has several) park every thread of a 2-core pool forever (jaxlib 0.10.2).
    The VJP is closed form (``dT = -T dA T``), so no per-row residuals are stored.
    """
    return _unit_lower_inverse_fwd(A_XCC)[0]


def _unit_lower_inverse_fwd(A_XCC: jax.Array) -> tuple[jax.Array, jax.Array]:
    # Recursive 2x2 block inversion on the diagonal blocks: start from the 1x1 blocks (= 1) and
    # merge neighbours, [[T1, 0], [A21, .]] -> off-diagonal block -T2 A21 T1, log2(C) rounds of
    # batched small matmuls instead of C sequential row updates. Every intermediate is a block of
    # the true inverse (no Neumann-series cancellation), so it is as stable as substitution.
    C = A_XCC.shape[-1]
    Cp = 1 << max(C - 1, 0).bit_length()
    batch = A_XCC.shape[:-2]
    A = jnp.where(jnp.tril(jnp.ones((C, C), bool), k=-1), A_XCC.astype(jnp.float32), 0.0)
    if Cp != C:  # pad to a power of two with identity rows (zero coupling): exact
        A = jnp.pad(A, [(0, 0)] * len(batch) + [(0, Cp - C), (0, Cp - C)])
    D = jnp.ones(batch + (Cp, 1, 1), jnp.float32)       # inverses of the diagonal blocks, size b
    b = 1
    while b < Cp:
        m = Cp // (2 * b)
        # coupling block of pair p: rows of its second half, columns of its first half
        X = A.reshape(batch + (m, 2, b, m, 2, b))[..., :, 1, :, :, 0, :]      # [.., m, b, m, b]
        A21 = jnp.moveaxis(jnp.diagonal(X, axis1=-4, axis2=-2), -1, -3)        # [.., m, b, b]
        D2 = D.reshape(batch + (m, 2, b, b))
        T11, T22 = D2[..., 0, :, :], D2[..., 1, :, :]
        T21 = -_einsum("...ij,...jk->...ik", _einsum("...ij,...jk->...ik", T22, A21), T11)
        D = jnp.concatenate([jnp.concatenate([T11, jnp.zeros_like(T11)], axis=-1),
                             jnp.concatenate([T21, T22], axis=-1)], axis=-2)   # [.., m, 2b, 2b]
        b *= 2
    T = D[..., 0, :C, :C]
    return T, T


def _unit_lower_inverse_bwd(T: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    C = T.shape[-1]
    Tt = jnp.swapaxes(T, -1, -2)
    gA = -_einsum("...ij,...jk->...ik", _einsum("...ij,...jk->...ik", Tt, g), Tt)
    return (jnp.where(jnp.tril(jnp.ones((C, C), bool), k=-1), gA, 0.0),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def recurrent_gated_delta_rule_ref(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHV: jax.Array,
    g_BTH: jax.Array,
    beta_BTH: jax.Array,
    /,
    *,
    initial_state_BHKV: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The literal per-token recurrence (``lax.scan`` over T), fp32.

    Args: see the module docstring for shapes. ``initial_state_BHKV`` defaults to zeros.
    Returns: ``(o_BTHV in v's dtype, final_state_BHKV fp32)``.
    """
    B, T, H, K, V = check_inputs(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, initial_state_BHKV, segment_ids_BT)
    q_BTHK, k_BTHK = repeat_key_heads(q_BTHK, H), repeat_key_heads(k_BTHK, H)
    scale = K ** -0.5 if scale is None else scale
    f32 = jnp.float32
    state0_BHKV = (jnp.zeros((B, H, K, V), f32) if initial_state_BHKV is None
                   else initial_state_BHKV.astype(f32))
    reset_BT = reset_flags(segment_ids_BT, B, T)

    def time_major(x: jax.Array) -> jax.Array:  # [B, T, ...] -> [T, B, ...] for lax.scan
        return jnp.moveaxis(x if x.dtype == bool else x.astype(f32), 1, 0)

    xs = tuple(map(time_major, (q_BTHK.astype(f32) * scale, k_BTHK, v_BTHV, g_BTH, beta_BTH, reset_BT)))

    def step(S_BHKV, x):
        q_BHK, k_BHK, v_BHV, g_BH, beta_BH, reset_B = x
        # A document start forgets everything before it (a select, not g = -inf: see chunked op).
        S_BHKV = jnp.where(reset_B[:, None, None, None], 0.0, S_BHKV)
        S_BHKV = S_BHKV * jnp.exp(g_BH)[..., None, None]
        kv_mem_BHV = _einsum("bhkv,bhk->bhv", S_BHKV, k_BHK)
        delta_BHV = beta_BH[..., None] * (v_BHV - kv_mem_BHV)
        S_BHKV = S_BHKV + k_BHK[..., :, None] * delta_BHV[..., None, :]
        o_BHV = _einsum("bhkv,bhk->bhv", S_BHKV, q_BHK)
        return S_BHKV, o_BHV

    final_BHKV, o_TBHV = lax.scan(step, state0_BHKV, xs)
    return jnp.moveaxis(o_TBHV, 0, 1).astype(v_BTHV.dtype), final_BHKV


def segmented_cumsum(x: jax.Array, reset: jax.Array) -> jax.Array:
    """Inclusive cumsum over the last axis that restarts at every position where ``reset`` is True.

    Restarting (rather than differencing a global cumsum) keeps the exponents small: within a
    document cum_i - cum_j is exact-ish even when earlier documents decayed to -1e3.
    """
    def combine(a, b):
        a_val, a_reset = a
        b_val, b_reset = b
        return jnp.where(b_reset, b_val, a_val + b_val), a_reset | b_reset

    out, _ = lax.associative_scan(combine, (x, jnp.broadcast_to(reset, x.shape)), axis=x.ndim - 1)
    return out


def chunk_gated_delta_rule_ref(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHV: jax.Array,
    g_BTH: jax.Array,
    beta_BTH: jax.Array,
    /,
    *,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    return_chunk_states: bool = False,
) -> tuple[jax.Array, ...]:
    """Chunked WY/UT form of the gated delta rule: dense math inside a chunk, ``lax.scan`` over chunks.

    Equal to :func:`recurrent_gated_delta_rule_ref` for any ``chunk_size`` (fp32 round-off). T need
    not be a multiple of ``chunk_size``: the tail is padded with q = k = v = g = beta = 0 in the last
    token's segment (identity on the state) and dropped.

    Segments are handled with explicit masks (never g = -inf, which would turn cumsum differences
    into nan / destroy fp32 precision): per chunk, with ``run`` the document index of each token and
    ``prev`` that of the token before the chunk,
    pairwise terms use ``[run_i == run_j]``, the carried-in state reaches token i only if
    ``run_i == prev``, and the carried-out state keeps the old state only if the whole chunk is in
    ``prev`` and receives only tokens of the chunk's last document.

    Args: see the module docstring; ``chunk_size`` is a static int >= 1.
    Returns: ``(o_BTHV in v's dtype, final_state_BHKV fp32)``, plus with ``return_chunk_states`` the
    state carried INTO every chunk ``[B, N, H, dk, dv]`` fp32 (chunk n's entry = the state after
    tokens < n*C, still in the document of token n*C - 1; the block-mode GDN reads it as history).
    """
    B, T, H, K, V = check_inputs(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, initial_state, segment_ids)
    q_BTHK, k_BTHK = repeat_key_heads(q_BTHK, H), repeat_key_heads(k_BTHK, H)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    scale = K ** -0.5 if scale is None else scale
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    f32 = jnp.float32

    X = B * H  # batch rows and heads merged: one batch axis for every matmul
    # Document index per token (0, 1, 2, ... along T). Comparing run indices instead of raw ids
    # makes a reused id (e.g. pad id 0 between every pair of documents) a separate document.
    reset_BT = reset_flags(segment_ids, B, T)
    run_BT = jnp.cumsum(reset_BT.astype(jnp.int32), axis=1)
    # Pad tokens continue the last document (no reset) and are exact no-ops on the state.
    reset_BT = jnp.pad(reset_BT, ((0, 0), (0, pad)))
    run_BT = jnp.pad(run_BT, ((0, 0), (0, pad)), mode="edge")

    def chunked(x: jax.Array, feature_major: bool = False) -> jax.Array:
        """[B, T, H, ...] -> zero-padded fp32 [N, X, C, ...] (chunk-major: the layout the scan over
        chunks consumes), or [N, X, D, C] with ``feature_major`` (the left operand of :func:`tn`)."""
        x = jnp.pad(x.astype(f32), ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        x = jnp.moveaxis(x.reshape((B, N, C) + x.shape[2:]), (1, 3), (0, 2))   # [N, B, H, C, ...]
        x = x.reshape((N, X) + x.shape[3:])
        return jnp.swapaxes(x, -1, -2) if feature_major else x

    def per_row(m: jax.Array) -> jax.Array:
        """[N, B, ...] -> [N, X, ...]: a batch row's mask, shared by its heads."""
        return jnp.broadcast_to(m[:, :, None], (N, B, H) + m.shape[2:]).reshape((N, X) + m.shape[2:])

    q_NXKC = chunked(q_BTHK, feature_major=True) * scale
    k_NXCK = chunked(k_BTHK)
    k_NXKC = chunked(k_BTHK, feature_major=True)
    v_NXCV = chunked(v_BTHV)
    g_NXC = chunked(g_BTH)
    beta_NXC = chunked(beta_BTH)

    # ---- masks (per batch row, shared by all heads) ----
    run_NBC = jnp.moveaxis(run_BT.reshape(B, N, C), 1, 0)
    prev_NB = jnp.concatenate([run_NBC[:1, :, 0], run_NBC[:-1, :, -1]], axis=0)
    same_doc_NXCC = per_row(run_NBC[..., :, None] == run_NBC[..., None, :])
    # Transposed masks ([j, i]: key j, query i): the C x C products below come out transposed.
    causal_T_CC = jnp.triu(jnp.ones((C, C), bool))        # token i sees its own update (diagonal)
    strict_T_CC = jnp.triu(jnp.ones((C, C), bool), k=1)   # UT system: only earlier tokens
    from_prev_NXC = per_row(run_NBC == prev_NB[..., None])
    to_last_NXC = per_row(run_NBC == run_NBC[..., -1:])
    keep_prev_NX = per_row(run_NBC[..., -1] == prev_NB)

    # ---- intra-chunk quantities, all chunks at once ----
    if segment_ids is None:
        cum_NXC = jnp.cumsum(g_NXC, axis=-1)
    else:
        cum_NXC = segmented_cumsum(g_NXC, per_row(jnp.moveaxis(reset_BT.reshape(B, N, C), 1, 0)))
    diff_T_NXCC = cum_NXC[..., None, :] - cum_NXC[..., :, None]              # [j, i] = cum_i - cum_j
    # the diagonal's exponent as the constant 0 (E_ii = 1 whatever g): see decay_to_last
    diff_T_NXCC = jnp.where(jnp.eye(C, dtype=bool), 0.0, diff_T_NXCC)
    decay_attn_T_NXCC = masked_exp(diff_T_NXCC, same_doc_NXCC & causal_T_CC)  # same_doc is symmetric
    decay_ut_T_NXCC = jnp.where(strict_T_CC, decay_attn_T_NXCC, 0.0)         # same exponentials, diagonal off

    # Delta-rule coupling of the chunk: d_i + sum_{j<i} A_ij d_j = beta_i v_i - (decayed S0)^T beta_i k_i.
    # A^T and attn^T in one matmul: A^T[j, i] = k_j . (beta_i k_i), attn^T[j, i] = k_j . q_i.
    kk_T_NXCC2 = tn(k_NXKC, jnp.concatenate([k_NXKC * beta_NXC[..., None, :], q_NXKC], axis=-1))
    A_NXCC = jnp.swapaxes(kk_T_NXCC2[..., :C] * decay_ut_T_NXCC, -1, -2)
    attn_T_NXCC = kk_T_NXCC2[..., C:] * decay_attn_T_NXCC
    decay_in_NXC = masked_exp(cum_NXC, from_prev_NXC)
    T_T_NXCC = jnp.swapaxes(unit_lower_inverse(A_NXCC), -1, -2)               # ((I + A)^-1)^T
    u_NXCV = tn(T_T_NXCC, v_NXCV * beta_NXC[..., None])                       # T (beta v)
    w_NXKC = tn(k_NXCK * (beta_NXC * decay_in_NXC)[..., None], T_T_NXCC)      # (T beta k decay_in)^T; d = u - w S0
    q_dec_NXKC = q_NXKC * decay_in_NXC[..., None, :]
    cum_last_NX1 = cum_NXC[..., -1:]
    k_dec_NXCK = k_NXCK * decay_to_last(cum_NXC, to_last_NXC)[..., None]
    state_decay_NX = masked_exp(cum_last_NX1[..., 0], keep_prev_NX)
    wq_NXKC2 = jnp.concatenate([w_NXKC, q_dec_NXKC], axis=-1)                 # both read the state S

    # ---- sequential pass over chunks ----
    def step(S_XKV, x):
        u_XCV, wq_XKC2, attn_T_XCC, k_dec_XCK, state_decay_X = x
        wq_S_XC2V = tn(wq_XKC2, S_XKV)                                          # [w S ; q_dec S]
        delta_XCV = u_XCV - wq_S_XC2V[:, :C]
        o_XCV = wq_S_XC2V[:, C:] + tn(attn_T_XCC, delta_XCV)
        S_in_XKV = S_XKV
        S_XKV = S_XKV * state_decay_X[:, None, None] + tn(k_dec_XCK, delta_XCV)
        return S_XKV, ((o_XCV, S_in_XKV) if return_chunk_states else o_XCV)

    xs = (u_NXCV, wq_NXKC2, attn_T_NXCC, k_dec_NXCK, state_decay_NX)
    state0_XKV = (jnp.zeros((X, K, V), f32) if initial_state is None
                  else initial_state.astype(f32).reshape(X, K, V))
    final_XKV, ys = lax.scan(step, state0_XKV, xs)
    o_NXCV, states_NXKV = ys if return_chunk_states else (ys, None)

    o_BTHV = jnp.transpose(o_NXCV.reshape(N, B, H, C, V), (1, 0, 3, 2, 4)).reshape(B, N * C, H, V)[:, :T]
    final_BHKV = final_XKV.reshape(B, H, K, V)
    if return_chunk_states:
        states_BNHKV = jnp.moveaxis(states_NXKV.reshape(N, B, H, K, V), 0, 1)
        return o_BTHV.astype(v_BTHV.dtype), final_BHKV, states_BNHKV
    return o_BTHV.astype(v_BTHV.dtype), final_BHKV
