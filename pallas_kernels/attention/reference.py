"""The jnp reference of full attention (the CPU path and the oracle of the kernels): the mask
builders of the two training streams (docs/design.md 3.1) and dense GQA softmax attention.

The masks are pure functions of slots, segment ids and the block size; `attend` takes an explicit
boolean mask [B, Tq, Tk], so every caller (training streams, prefill, decoding) shares one core.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_segment_mask(
    q_slot_BT: jax.Array, q_seg_BT: jax.Array, k_slot_BS: jax.Array, k_seg_BS: jax.Array
) -> jax.Array:
    """[B, Tq, Tk] bool: key visible iff it is not later than the query and in the same document.

    Slots are indices in the (cached) sequence, not RoPE positions, so causality stays right when
    positions restart per packed document. Pads are their own segment and never meet a document.
    """
    causal = k_slot_BS[:, None, :] <= q_slot_BT[:, :, None]
    same_doc = k_seg_BS[:, None, :] == q_seg_BT[:, :, None]
    return causal & same_doc


def noisy_query_mask(
    q_start_BT: jax.Array, q_seg_BT: jax.Array, k_slot_BS: jax.Array, k_seg_BS: jax.Array,
    k_start_BS: jax.Array, k_noisy_S: jax.Array,
) -> jax.Array:
    """[B, Tq, S] bool, the block-diffusion rule for NOISY queries (docs/design.md 3.1): a clean key is
    visible iff it is in the query's document and strictly before the query's block start; a noisy
    key iff it is in the query's document and in the same block. `*_start`: slot of the first
    position of the token's block; `k_noisy_S`: which keys are noisy-stream tokens."""
    same_doc = k_seg_BS[:, None, :] == q_seg_BT[:, :, None]
    clean_ok = ~k_noisy_S[None, None, :] & (k_slot_BS[:, None, :] < q_start_BT[:, :, None])
    noisy_ok = k_noisy_S[None, None, :] & (k_start_BS[:, None, :] == q_start_BT[:, :, None])
    return same_doc & (clean_ok | noisy_ok)


def clean_stream_mask(segment_ids_BT: jax.Array) -> jax.Array:
    """[B, T, T] bool: the clean stream's (and the AR forward's) token-causal in-document mask."""
    slots = jax.lax.broadcasted_iota(jnp.int32, segment_ids_BT.shape, 1)
    return causal_segment_mask(slots, segment_ids_BT, slots, segment_ids_BT)


def two_stream_masks(segment_ids_BT: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """(clean [B, T, T], noisy [B, T, 2T]) training masks; keys of the noisy rows are clean slots
    0..T-1 then noisy slots T..2T-1. Blocks are on the row grid (slot // block_size)."""
    b, t = segment_ids_BT.shape
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    start = slots - slots % block_size
    clean = clean_stream_mask(segment_ids_BT)
    both = lambda a: jnp.concatenate([a, a], axis=1)  # noqa: E731
    noisy = noisy_query_mask(start, segment_ids_BT, both(slots), both(segment_ids_BT), both(start),
                             jnp.arange(2 * t) >= t)
    return clean, noisy


def attend(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, mask_BTS: jax.Array) -> jax.Array:
    """Softmax attention with GQA (query head h = k * G + g uses KV head k), fp32 softmax.

    A query with no visible key (never the case for real tokens: each sees itself) gets zeros.
    Returns [B, T, H, D] in the dtype of v. The G query heads of a KV head are folded into the query
    rows ([B, K, G*T, D] against [B, K, S, D]): two batch dims per product instead of three, which
    XLA:CPU runs faster (issue 19: the core alone at 4 x 512, 8 / 2 heads, fwd+bwd 1.5-1.6x).
    """
    b, t, h, d = q_BTHD.shape
    s, kv = k_BSKD.shape[1], k_BSKD.shape[2]
    g = h // kv
    q_BKQD = q_BTHD.reshape(b, t, kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, d)  # Q = G*T rows
    k_BKSD, v_BKSD = k_BSKD.transpose(0, 2, 1, 3), v_BSKD.transpose(0, 2, 1, 3)
    scores = jnp.einsum("bkqd,bksd->bkqs", q_BKQD, k_BKSD, preferred_element_type=jnp.float32)
    mask_B1QS = jnp.broadcast_to(mask_BTS[:, None, None], (b, 1, g, t, s)).reshape(b, 1, g * t, s)
    probs = jax.nn.softmax(jnp.where(mask_B1QS, scores * (d ** -0.5), -jnp.inf), axis=-1)
    probs = jnp.where(mask_B1QS, probs, 0.0)  # rows with no visible key: 0 instead of NaN
    out_BKQD = jnp.einsum("bkqs,bksd->bkqd", probs.astype(v_BSKD.dtype), v_BKSD, preferred_element_type=jnp.float32)
    return out_BKQD.reshape(b, kv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(v_BSKD.dtype)


def clean_attention_ref(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array,
                        segment_ids_BT: jax.Array) -> jax.Array:
    """The clean stream (and the AR forward): token-causal within each packed document."""
    return attend(q_BTHD, k_BTKD, v_BTKD, clean_stream_mask(segment_ids_BT))


def noisy_attention_ref(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, segment_ids_BT: jax.Array,
                        block_size: int) -> jax.Array:
    """The noisy stream: noisy queries [B, T] over keys [B, 2T] = clean slots || noisy slots, with the
    block rule of `noisy_query_mask` on the row grid of `block_size`."""
    _, noisy = two_stream_masks(segment_ids_BT, block_size)
    return attend(q_BTHD, k_BSKD, v_BSKD, noisy)
