"""What the attention kernels (splash, flash) share about their inputs: the shape contract of one
training stream and the padding of a row to whole tiles.

A stream's inputs: q [B, T, H, D]; k, v [B, S, K, D] with S = T (clean) or 2T (noisy: clean slots
|| noisy slots); segment ids [B, T] (the noisy slots share them). Padding appends slots with a
segment id no document uses (each pad query still sees itself, so no softmax row is empty) and, for
the noisy keys, pads each half, so the clean / noisy split stays at the padded length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: segment id of the tile padding; documents and pads of the data pipeline use ids >= -1
LANE_PAD_SEGMENT = -(2**30)


def check_stream_inputs(who: str, q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, stream: str, block_size: int) -> None:
    """Raises ValueError naming ``who`` and the tensor when the shapes break the contract."""
    b, t, h, _ = q_BTHD.shape
    s, kv = k_BSKD.shape[1], k_BSKD.shape[2]
    if stream not in ("clean", "noisy"):
        raise ValueError(f"{who}: stream must be 'clean' or 'noisy', got {stream!r}")
    if h % kv:
        raise ValueError(f"{who}: {h} query heads are not a multiple of {kv} KV heads")
    want = t if stream == "clean" else 2 * t
    if s != want or v_BSKD.shape != k_BSKD.shape:
        raise ValueError(f"{who}: {stream} stream with {t} queries needs k and v of {want} keys, "
                         f"got k {k_BSKD.shape}, v {v_BSKD.shape}")
    if stream == "noisy" and t % block_size:
        raise ValueError(f"{who}: length {t} is not a multiple of block_size {block_size}")
    if segment_ids_BT.shape != (b, t):
        raise ValueError(f"{who}: segment_ids {segment_ids_BT.shape} must be [B, T] = {(b, t)}")


def pad_rows(x: jax.Array, tp: int, fill=0) -> jax.Array:
    """x [B, T, ...] -> [B, tp, ...]: slots T..tp-1 appended, holding ``fill``."""
    return jnp.pad(x, ((0, 0), (0, tp - x.shape[1])) + ((0, 0),) * (x.ndim - 2), constant_values=fill)


def pad_stream_rows(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, stream: str, tp: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Rows padded from T to ``tp`` slots: (q [B, tp, H, D], k, v [B, tp or 2 tp, K, D], q segment
    ids [B, tp] int32, kv segment ids [B, tp or 2 tp])."""
    t = q_BTHD.shape[1]
    pad = lambda x, fill=0: pad_rows(x, tp, fill)  # noqa: E731
    seg = pad(segment_ids_BT.astype(jnp.int32), LANE_PAD_SEGMENT)
    if stream == "clean":
        return pad(q_BTHD), pad(k_BSKD), pad(v_BSKD), seg, seg
    halves = lambda x: jnp.concatenate([pad(x[:, :t]), pad(x[:, t:])], axis=1)  # noqa: E731
    return pad(q_BTHD), halves(k_BSKD), halves(v_BSKD), seg, jnp.concatenate([seg, seg], axis=1)
