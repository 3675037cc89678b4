"""Dense attention that skips the keys a training mask never shows (the CPU path of both streams).

The reference core (`attention.reference.attend`) scores every query against every key, then masks.
The training masks are mostly empty by structure: the clean stream is causal (half of [T, T] is
masked) and the noisy stream sees the clean keys before its block and the noisy keys of its own
block (about a quarter of [T, 2T] at T = 8 blocks). Softmax rows are independent, so the query rows
can be cut into chunks and each chunk attended against only the key intervals its rows can see:
the same numbers (each row's softmax runs over a superset of its visible keys, the rest masked as
before), fewer scores. A span is `(q_start, q_stop, ((k_start, k_stop), ...))`, all static.

With `c` query chunks the scored area is (c + 1) / 2c of [T, T] for the clean stream and
(c + 3) / 4c of [T, 2T] for the noisy one: at c = 8, 56% and 34%. The kernels (splash, flash) skip
masked tiles themselves; this is for the jnp path (issue 19: the score-sized elementwise work
of the softmax and its backward is what XLA:CPU spends its attention time on).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .reference import attend

Span = tuple[int, int, tuple[tuple[int, int], ...]]

#: query chunks per stream: enough to skip most masked scores, few enough that the per-chunk ops
#: stay large (bench/attention_spans.py: 8 beat 2 and 4 at T = 256 and 512)
DEFAULT_CHUNKS = 8


def _bounds(n_units: int, chunks: int, unit: int) -> list[int]:
    """Chunk edges on a grid of `unit` rows: `chunks` (at most `n_units`) nearly equal chunks."""
    c = max(1, min(chunks, n_units))
    return [unit * round(n_units * i / c) for i in range(c + 1)]


def causal_spans(t: int, chunks: int = DEFAULT_CHUNKS) -> tuple[Span, ...]:
    """Spans of a token-causal mask over [T, T]: rows [a, b) see at most keys [0, b)."""
    edges = _bounds(t, chunks, 1)
    return tuple((a, b, ((0, b),)) for a, b in zip(edges[:-1], edges[1:]))


def noisy_spans(t: int, block_size: int, chunks: int = DEFAULT_CHUNKS) -> tuple[Span, ...]:
    """Spans of the noisy stream's mask over keys clean slots 0..T-1 || noisy slots T..2T-1 (chunks on
    the block grid): rows [a, b) see clean keys before their block start (at most [0, b - block))
    and noisy keys of their own block (inside [T + a, T + b))."""
    if t % block_size:
        raise ValueError(f"noisy_spans: T = {t} is not a multiple of the block size {block_size}")
    edges = _bounds(t // block_size, chunks, block_size)
    spans = []
    for a, b in zip(edges[:-1], edges[1:]):
        clean = ((0, b - block_size),) if b > block_size else ()
        spans.append((a, b, clean + ((t + a, t + b),)))
    return tuple(spans)


def attend_spans(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, mask_BTS: jax.Array,
                 spans: Sequence[Span]) -> jax.Array:
    """`attend(q, k, v, mask)` computed chunk by chunk over `spans` (which must cover every True of
    `mask` and every query row once, in order). Returns [B, T, H, D] like `attend`."""
    t = q_BTHD.shape[1]
    if spans[0][0] != 0 or spans[-1][1] != t or any(s[1] != n[0] for s, n in zip(spans[:-1], spans[1:])):
        raise ValueError(f"attend_spans: query spans {[s[:2] for s in spans]} do not tile the {t} query rows")
    if len(spans) == 1 and spans[0][2] == ((0, k_BSKD.shape[1]),):
        return attend(q_BTHD, k_BSKD, v_BSKD, mask_BTS)
    outs = []
    for a, b, keys in spans:
        take = lambda x, axis: jnp.concatenate(  # noqa: E731
            [jax.lax.slice_in_dim(x, k0, k1, axis=axis) for k0, k1 in keys], axis=axis)
        outs.append(attend(q_BTHD[:, a:b], take(k_BSKD, 1), take(v_BSKD, 1), take(mask_BTS[:, a:b], 2)))
    return jnp.concatenate(outs, axis=1)


__all__ = ["DEFAULT_CHUNKS", "Span", "attend_spans", "causal_spans", "noisy_spans"]
