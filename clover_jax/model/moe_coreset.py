"""Block coreset routing: the MoE of a block's noisy tokens restricted to a few experts per block.

Why: at batch 1 decoding is memory bound, and a 32-token block whose tokens route freely over 256
experts (top 8) touches ~163 distinct experts per MoE layer (independent routing), against 8 for one
AR token: a block forward then reads ~20x the expert bytes of an AR forward. With a coreset of C
experts per block it reads at most C (`bench/decode_cost.py` measures both).

The rule (OUR READING: the official SFT code names "block coreset routing" in its `moe.py`, and a
third-party port restricts "the MoE ... to the block's expert coreset", but neither shows the
selection; docs/design.md 2.2 gives the sources): per (row, block), the block's router mass is the
sum over its non-pad tokens of the fp32 router softmax [E]; the C experts of largest mass (ties to the
lower expert index, as `lax.top_k`) are the coreset; every token of the block takes its top-k among
the coreset's experts, weights renormalised over those k as in free routing. The softmax the
load-balancing loss reads is the unrestricted one. Applied to the noisy stream of the training forward
and to the canvas of a decoding block step; the clean stream, AR decoding and the commit pass route
freely. With C = E the mask is all true and routing is free routing bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def block_coresets(probs_BNKE: jax.Array, valid_BNK: jax.Array, c: int) -> jax.Array:
    """Blocks of K tokens: probs [B, N, K, E] fp32, valid [B, N, K] bool -> the coreset of every
    block, core [B, N, C] int32: the C experts of largest block mass, largest first."""
    e = probs_BNKE.shape[-1]
    if not 1 <= c <= e:
        raise ValueError(f"moe_block_coreset {c} must be in [1, num_experts={e}]")
    mass_BNE = jnp.sum(jnp.where(valid_BNK[..., None], probs_BNKE, 0.0), axis=2)
    return jax.lax.top_k(mass_BNE, c)[1].astype(jnp.int32)


def mask_of(core_BNC: jax.Array, shape_BNKE: tuple[int, ...]) -> jax.Array:
    """Coresets [B, N, C] -> allowed [B, N, K, E] bool (every token of a block gets its block's row)."""
    e = shape_BNKE[-1]
    # a compare, not a scatter: elementwise over the (possibly sharded) block axis
    allowed_BNE = jnp.any(core_BNC[..., None] == jnp.arange(e, dtype=core_BNC.dtype), axis=-2)
    return jnp.broadcast_to(allowed_BNE[:, :, None, :], shape_BNKE)


def coreset_mask(probs_BNKE: jax.Array, valid_BNK: jax.Array, c: int) -> jax.Array:
    """`mask_of(block_coresets(...))`: allowed [B, N, K, E] bool."""
    return mask_of(block_coresets(probs_BNKE, valid_BNK, c), probs_BNKE.shape)


def blocks_of(a_BT: jax.Array, block_size: int, pieces: int = 1) -> jax.Array:
    """[B, T, ...] -> [B, T / block, block, ...]. The row may be split in `pieces` runs of equal
    length laid out in any order (the context layouts): each run must hold whole blocks, so a block
    never straddles two runs."""
    b, t = a_BT.shape[:2]
    if t % (pieces * block_size):
        raise ValueError(f"block coreset: {t} tokens in {pieces} context pieces do not hold whole blocks of "
                         f"{block_size} (each piece must be a multiple of the block size)")
    return a_BT.reshape((b, t // block_size, block_size) + a_BT.shape[2:])


def restrict(probs_BTE: jax.Array, valid_BT: jax.Array, c: int, block_size: int, pieces: int = 1) -> jax.Array:
    """The coreset mask of a stream whose T tokens lie in blocks of `block_size` (in `pieces` runs,
    see `blocks_of`): allowed [B, T, E] bool."""
    b, t, e = probs_BTE.shape
    allowed = coreset_mask(blocks_of(probs_BTE, block_size, pieces), blocks_of(valid_BT, block_size, pieces), c)
    return allowed.reshape(b, t, e)


__all__ = ["block_coresets", "blocks_of", "coreset_mask", "mask_of", "restrict"]
