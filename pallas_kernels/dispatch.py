"""Single entry point for the chunked causal GDN: picks the Pallas kernel or the jnp reference.

Callers (the model's GDN layer) use only :func:`chunk_gated_delta_rule`; which implementation runs
is a backend choice, never a numerics choice (both must agree to fp32 round-off).
"""

from __future__ import annotations

import jax

from .gdn_reference import chunk_gated_delta_rule_ref

BACKENDS = ("auto", "pallas", "reference")


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Chunked causal gated delta rule (argument convention of transformers' ``torch_chunk_gated_delta_rule``).

    Args:
        q: [B, T, H, dk] queries, already l2-normalised and repeated to the value heads
            (the dk^-0.5 scale is applied inside).
        k: [B, T, H, dk] keys, same convention as q.
        v: [B, T, H, dv] values.
        g: [B, T, H] log-decay (<= 0).
        beta: [B, T, H] write strength in (0, 1).
        initial_state: optional [B, H, dk, dv] state carried in (belongs to token 0's segment).
        segment_ids: optional int [B, T]; the state resets wherever the id changes from the previous token.
        chunk_size: chunk length of the WY/UT form (any value gives the same result).
        backend: "auto" (best available; the reference until the kernel lands), "pallas" or "reference".
        interpret: Pallas interpret mode; None means interpret on CPU. Ignored by the reference.

    Returns:
        (o [B, T, H, dv] in v's dtype, final_state [B, H, dk, dv] fp32).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown GDN backend {backend!r}; expected one of {BACKENDS}")
    if backend == "pallas":
        raise NotImplementedError(
            "backend='pallas': the Pallas GDN kernel lands with the kernel issue; "
            "use backend='reference' (or 'auto') for now")
    del interpret  # only meaningful for the Pallas kernel
    return chunk_gated_delta_rule_ref(
        q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size)
