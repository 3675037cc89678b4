"""Plain-jnp reference of the Clover block-mode GDN (docs/design.md 3.2 B): the oracle of the kernels.

Two streams over the same T positions (argument convention of `gdn.reference`: q, k [B, T, HK, dk]
l2-normalised, HK = H or grouped (value head h reads key head h // (H / HK)), v [B, T, H, dv], g / beta [B, T, H], state
[B, H, dk, dv] fp32):

* the clean stream is the causal gated delta rule, unchanged (`chunk_gated_delta_rule_ref`);
* the noisy stream is cut into blocks of `block_size` positions on the ROW grid (block n =
  positions [n*Bk, (n+1)*Bk); block-aligned packing puts every document start on that grid). A
  noisy token t of block n, per value head, reads

      r_t      = S_n^T (q_t * dk^-0.5)            history readout, S_n = clean state entering block n
      l_tj     = alpha * (q_t . k_j)              every j of the block in t's document (no decay/causality)
      l_hist   = beta + gamma * log(Bk)           the history unit's logit (block-size calibration)
      o_t      = sum_j softmax(l)_tj v_j + softmax(l)_hist r_t      (one softmax over the Bk + 1 logits)

  with (alpha, beta, gamma) = `scalars_H3[h]`. The history unit exists only if t continues the
  document of the token before the block (a block that starts a document has no history; pads are
  their own document). The GDN gate g and step size beta are not used inside the block.

Documents are runs of equal segment id (as in `gdn.reference`: a reused id after a different one
is a new document), so masks compare run indices, never raw ids.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .inputs import repeat_key_heads, reset_flags
from .reference import chunk_gated_delta_rule_ref

_HI = lax.Precision.HIGHEST


def block_readout_ref(
    q_BNCHK: jax.Array,
    k_BNCHK: jax.Array,
    v_BNCHV: jax.Array,
    history_BNHKV: jax.Array,
    same_doc_BNCC: jax.Array,
    has_history_BNC: jax.Array,
    scalars_H3: jax.Array,
    block_size: int,
    *,
    return_history_prob: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """In-block bidirectional softmax with the history unit, for N blocks of C positions each.

    `same_doc_BNCC[i, j]`: key j is in query i's document; `has_history_BNC[i]`: query i continues
    the document that `history_BNHKV` belongs to. `block_size` sets the calibration term log(Bk)
    (the nominal block size, also for a partial block). Returns o [B, N, C, H, dv] fp32, and with
    `return_history_prob` also the history unit's softmax probability [B, N, C, H] (research stats).
    Every query sees at least itself, so no softmax row is empty.
    """
    f32 = jnp.float32
    q, k, v = q_BNCHK.astype(f32), k_BNCHK.astype(f32), v_BNCHV.astype(f32)
    alpha_H, beta_H, gamma_H = (scalars_H3[:, i].astype(f32) for i in range(3))
    logits_BNHCC = alpha_H[:, None, None] * jnp.einsum("bnihk,bnjhk->bnhij", q, k, precision=_HI)
    logits_BNHCC = jnp.where(same_doc_BNCC[:, :, None], logits_BNHCC, -jnp.inf)
    hist_H = beta_H + gamma_H * math.log(block_size)
    hist_BNHC1 = jnp.broadcast_to(hist_H[:, None, None], logits_BNHCC.shape[:-1] + (1,))
    hist_BNHC1 = jnp.where(has_history_BNC[:, :, None, :, None], hist_BNHC1, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([logits_BNHCC, hist_BNHC1], axis=-1), axis=-1)
    p_in_BNHCC, p_hist_BNHC = probs[..., :-1], probs[..., -1]
    scale = q.shape[-1] ** -0.5
    read_BNCHV = jnp.einsum("bnchk,bnhkv->bnchv", q * scale, history_BNHKV.astype(f32), precision=_HI)
    o_BNCHV = jnp.einsum("bnhij,bnjhv->bnihv", p_in_BNHCC, v, precision=_HI)
    p_hist_BNCH = jnp.moveaxis(p_hist_BNHC, 2, 3)
    o_BNCHV = o_BNCHV + p_hist_BNCH[..., None] * read_BNCHV
    return (o_BNCHV, p_hist_BNCH) if return_history_prob else o_BNCHV


def block_masks(segment_ids_BT: jax.Array | None, B: int, T: int, block_size: int,
                has_initial_state: bool) -> tuple[jax.Array, jax.Array]:
    """(same_doc [B, N, C, C], has_history [B, N, C]) for the row-grid blocks; T % block_size == 0."""
    n, c = T // block_size, block_size
    run_BT = jnp.cumsum(reset_flags(segment_ids_BT, B, T).astype(jnp.int32), axis=1)
    run_BNC = run_BT.reshape(B, n, c)
    same_doc_BNCC = run_BNC[..., :, None] == run_BNC[..., None, :]
    # the document the history belongs to: that of the token before the block (of token 0 for the
    # first block, whose history is the carried-in initial state)
    prev_BN = jnp.concatenate([run_BT[:, :1], run_BNC[:, :-1, -1]], axis=1)
    has_history_BNC = run_BNC == prev_BN[..., None]
    if not has_initial_state:
        has_history_BNC = has_history_BNC.at[:, 0].set(False)
    return same_doc_BNCC, has_history_BNC


def block_gated_delta_rule_ref(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHV: jax.Array,
    g_BTH: jax.Array,
    beta_BTH: jax.Array,
    q_noisy_BTHK: jax.Array,
    k_noisy_BTHK: jax.Array,
    v_noisy_BTHV: jax.Array,
    scalars_H3: jax.Array,
    /,
    *,
    block_size: int,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Both streams of a block-mode GDN layer. T must be a multiple of `block_size`.

    The clean output is exactly `chunk_gated_delta_rule_ref(..., chunk_size=chunk_size)` (so the
    clean stream equals the AR forward bit for bit); the block-entry states come from a second,
    state-only sweep with chunks of `block_size` (the kernels read them out of their one sweep).

    Returns (o_clean [B, T, H, dv] in v's dtype, o_noisy [B, T, H, dv] in v's dtype, final clean
    state [B, H, dk, dv] fp32).
    """
    B, T, _, K = q_BTHK.shape
    H, V = v_BTHV.shape[2:]
    if T % block_size:
        raise ValueError(f"block mode needs T ({T}) to be a multiple of block_size ({block_size})")
    for name, x, ref in (("q_noisy", q_noisy_BTHK, q_BTHK), ("k_noisy", k_noisy_BTHK, k_BTHK),
                         ("v_noisy", v_noisy_BTHV, v_BTHV)):
        if x.shape != ref.shape:
            raise ValueError(f"{name} must have the clean stream's shape {ref.shape}; got {x.shape}")
    if scalars_H3.shape != (H, 3):
        raise ValueError(f"scalars must be [H, 3] = {(H, 3)} (alpha, beta, gamma); got {scalars_H3.shape}")
    o_clean, final = chunk_gated_delta_rule_ref(
        q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, initial_state=initial_state, segment_ids=segment_ids,
        chunk_size=chunk_size)
    _, _, entry_BNHKV = chunk_gated_delta_rule_ref(
        q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, initial_state=initial_state, segment_ids=segment_ids,
        chunk_size=block_size, return_chunk_states=True)
    n = T // block_size
    blocks = lambda x: x.reshape((B, n, block_size) + x.shape[2:])  # noqa: E731
    same_doc, has_history = block_masks(segment_ids, B, T, block_size, initial_state is not None)
    o_noisy = block_readout_ref(blocks(repeat_key_heads(q_noisy_BTHK, H)), blocks(repeat_key_heads(k_noisy_BTHK, H)),
                                blocks(v_noisy_BTHV),
                                entry_BNHKV, same_doc, has_history, scalars_H3, block_size)
    return o_clean, o_noisy.reshape(B, T, H, V).astype(v_noisy_BTHV.dtype), final
