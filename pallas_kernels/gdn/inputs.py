"""The inputs of the GDN ops, shared by the references and the kernel ops: the shape checks of the
transformers argument convention (q, k [B, T, HK, dk]; v [B, T, H, dv]; g, beta [B, T, H];
initial_state [B, H, dk, dv]; segment_ids [B, T]), grouped key heads, and the document resets the
segment ids imply.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_inputs(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
    initial_state: jax.Array | None, segment_ids: jax.Array | None,
) -> tuple[int, int, int, int, int]:
    """Validates shapes; returns (B, T, H, dk, dv) with H the VALUE heads. q and k may carry fewer key
    heads HK (grouped queries: value head h reads key head h // (H / HK)) when HK divides H."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, HK, dk]; got q {q.shape}, k {k.shape}")
    B, T, HK, K = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, T) or v.shape[2] % HK:
        raise ValueError(f"v must be [B, T, H, dv] = [{B}, {T}, H, dv] with H a multiple of q/k's {HK} "
                         f"heads; got {v.shape}")
    H, V = v.shape[2], v.shape[-1]
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, H):
            raise ValueError(f"{name} must be [B, T, H] = {(B, T, H)}; got {x.shape}")
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(f"initial_state must be [B, H, dk, dv] = {(B, H, K, V)}; got {initial_state.shape}")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"segment_ids must be [B, T] = {(B, T)}; got {segment_ids.shape}")
    return B, T, H, K, V


def repeat_key_heads(q_BTHK: jax.Array, H: int) -> jax.Array:
    """[B, T, HK, dk] -> [B, T, H, dk]: value head h reads key head h // (H / HK) (HF repeat_interleave)."""
    rep = H // q_BTHK.shape[2]
    return q_BTHK if rep == 1 else jnp.repeat(q_BTHK, rep, axis=2)


def reset_flags(segment_ids_BT: jax.Array | None, B: int, T: int) -> jax.Array:
    """[B, T] bool: True where the state must be zeroed before token t (id differs from t - 1)."""
    if segment_ids_BT is None:
        return jnp.zeros((B, T), bool)
    seg = jnp.asarray(segment_ids_BT)
    changed_BT = seg[:, 1:] != seg[:, :-1]
    return jnp.concatenate([jnp.zeros((B, 1), bool), changed_BT], axis=1)
