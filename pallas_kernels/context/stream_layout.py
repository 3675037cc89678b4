"""The layout of the two training streams in one sequence axis: [B, 2T] laid out per context shard.

The model runs the clean and the noisy stream through every per-token op (projections, norms, MoE) as
ONE array [B, 2T, ...]. Its sequence axis is sharded over the ``context`` mesh axis in n contiguous
pieces, so the order of the 2T slots decides what each device holds. Plain ``clean || noisy`` puts
the clean stream on the first n/2 devices and the noisy one on the rest: every split into the two
streams (and every join back) re-lays each half over all n devices (collective-permutes of activation
size in every layer, forward and backward). Here the 2T slots are instead

    [clean piece 0 | noisy piece 0 | clean piece 1 | noisy piece 1 | ... ]   (pieces of T / n tokens)

so device i holds the clean and noisy tokens of the SAME positions, and `split_streams` /
`join_streams` are reshapes and slices that move nothing. With n = 1 (no context axis, or inside a
shard_map already manual over it, where each device sees its own ``[clean_i | noisy_i]``) the layout
is exactly ``clean || noisy``. A layout, not a semantic: code that needs the noisy stream's keys as
``clean || noisy`` (the block rule's key order) concatenates the split streams itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .axis import context_size


def _pieces(t: int, n: int | None) -> int:
    n = context_size() if n is None else n
    if t % n:
        raise ValueError(f"two-stream layout: T={t} does not split into context={n} pieces")
    return n


def join_streams(clean: jax.Array, noisy: jax.Array, n: int | None = None) -> jax.Array:
    """clean, noisy [B, T, ...] (same shape) -> [B, 2T, ...] in the per-shard layout of n pieces
    (default: the active mesh's context size)."""
    if clean.shape != noisy.shape:
        raise ValueError(f"two-stream layout: clean {clean.shape} and noisy {noisy.shape} differ")
    b, t, rest = clean.shape[0], clean.shape[1], clean.shape[2:]
    n = _pieces(t, n)
    if n == 1:
        return jnp.concatenate([clean, noisy], axis=1)
    pieces = [a.reshape((b, n, t // n) + rest) for a in (clean, noisy)]
    return jnp.concatenate(pieces, axis=2).reshape((b, 2 * t) + rest)


def split_streams(x: jax.Array, n: int | None = None) -> tuple[jax.Array, jax.Array]:
    """[B, 2T, ...] in the per-shard layout of n pieces -> (clean, noisy) [B, T, ...]; the inverse of
    `join_streams`."""
    b, s, rest = x.shape[0], x.shape[1], x.shape[2:]
    if s % 2:
        raise ValueError(f"two-stream layout: sequence axis {s} is not 2T")
    t = s // 2
    n = _pieces(t, n)
    if n == 1:
        return x[:, :t], x[:, t:]
    y = x.reshape((b, n, 2, t // n) + rest)
    return y[:, :, 0].reshape((b, t) + rest), y[:, :, 1].reshape((b, t) + rest)


__all__ = ["join_streams", "split_streams"]
