"""The GDN layer's short causal convolutions over packed rows (shared by the layer, `gdn`, and its
context-parallel path, `gdn_context`, so that the context path never imports the layer back).

Shapes: K conv kernel, L = K-1 ring length, C channels. The conv never reads a tap from another
document (segment ids); with a cache it reads the ring of the last L pre-conv inputs. Block mode
reads, per block, the L tokens before the block (`block_rings`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CONV_PARTS = ("q", "k", "v")


def causal_conv(
    x_BTC: jax.Array, w_KC: jax.Array, ring_BLC: jax.Array, seg_BT: jax.Array, ring_seg_BL: jax.Array
) -> jax.Array:
    """Depthwise causal conv, no activation: `out_t = sum_j w[j] x~[t-K+1+j]` over x~ = ring || x.

    A tap contributes only if its token is in the same segment as t (ring slots carry the segment ids
    of the tokens they hold; an empty ring is zeros with segment -1).
    """
    k = w_KC.shape[0]
    t = x_BTC.shape[1]
    xx = jnp.concatenate([ring_BLC.astype(x_BTC.dtype), x_BTC], axis=1)
    seg = jnp.concatenate([ring_seg_BL, seg_BT], axis=1)
    out = jnp.zeros(x_BTC.shape, jnp.float32)
    for j in range(k):  # K = 4: a static unroll is cheaper than a conv with masks
        tap, same = xx[:, j:j + t], seg[:, j:j + t] == seg_BT
        out = out + jnp.where(same[..., None], tap.astype(jnp.float32) * w_KC[j].astype(jnp.float32), 0.0)
    return out.astype(x_BTC.dtype)


def right_conv(x_BKC: jax.Array, w_LC: jax.Array, seg_BK: jax.Array) -> jax.Array:
    """Block-mode right-context taps (docs/design.md 3.2 C), no activation, over whole blocks [B, K, C]:
    `out_t = sum_{d=1..L} w[d-1] x_{t+d}`, only where t + d is inside the block and in t's segment,
    so a tap never reads past the block end."""
    k = x_BKC.shape[1]
    out = jnp.zeros(x_BKC.shape, jnp.float32)
    for d in range(1, min(w_LC.shape[0], k - 1) + 1):
        tap = jnp.pad(x_BKC[:, d:], ((0, 0), (0, d), (0, 0)))
        same = jnp.pad(seg_BK[:, d:] == seg_BK[:, :-d], ((0, 0), (0, d)))
        out = out + jnp.where(same[..., None], tap.astype(jnp.float32) * w_LC[d - 1].astype(jnp.float32), 0.0)
    return out


def block_conv(
    x_BKC: jax.Array, w_KC: jax.Array, w_right_LC: jax.Array, ring_BLC: jax.Array, seg_BK: jax.Array,
    ring_seg_BL: jax.Array,
) -> jax.Array:
    """The noisy-stream conv of one block, no activation: left taps over ring || block (the ring holds
    the CLEAN pre-conv inputs before the block), right taps inside the block. Zero `w_right` gives
    exactly `causal_conv`."""
    left = causal_conv(x_BKC, w_KC, ring_BLC, seg_BK, ring_seg_BL).astype(jnp.float32)
    return (left + right_conv(x_BKC, w_right_LC, seg_BK)).astype(x_BKC.dtype)


def block_rings(x_BTC: jax.Array, seg_BT: jax.Array, block: int, lring: int, empty_seg: int,
                halo: tuple[jax.Array, jax.Array] | None = None):
    """For every row-grid block n, the L clean inputs before it and their segment ids:
    ([B*N, L, C], [B*N, L]); slots before the row start are zeros with segment `empty_seg`, or the
    given `halo` ([B, L, C], [B, L]: the tokens before a context shard)."""
    b, t, c = x_BTC.shape
    n = t // block
    if halo is None:
        x_pad = jnp.pad(x_BTC, ((0, 0), (lring, 0), (0, 0)))
        s_pad = jnp.pad(seg_BT, ((0, 0), (lring, 0)), constant_values=empty_seg)
    else:
        x_pad = jnp.concatenate([halo[0].astype(x_BTC.dtype), x_BTC], axis=1)
        s_pad = jnp.concatenate([halo[1].astype(seg_BT.dtype), seg_BT], axis=1)
    idx_NL = jnp.arange(n)[:, None] * block + jnp.arange(lring)[None, :]  # padded index of slot n*block - L + j
    rings = jnp.take(x_pad, idx_NL.reshape(-1), axis=1).reshape(b * n, lring, c)
    ring_seg = jnp.take(s_pad, idx_NL.reshape(-1), axis=1).reshape(b * n, lring)
    return rings, ring_seg
