"""The `blocked` grouped expert FFN (the CPU path of `clover_jax.model.moe.grouped_ffn`).

Rows arrive sorted by expert. Each expert's group is padded to a multiple of a row block, and a
loop runs only the blocks in use (a dynamic trip count: no work on the padding blocks the static
bound allows), each block one SwiGLU against its expert's weights read in place:
`y = (silu(x Wg) * (x Wu)) Wo`, gate and up as one [D, 2I] matmul.

Why a loop, not one batched matmul over all blocks: the batched form gathers every block's
weights (`w[block_expert]`, [blocks, D, I], about 9x the weights at the small-cpu shapes) and its
autodiff saves those copies for the backward, writes their gradients block by block and
scatter-adds them back: on XLA:CPU that traffic cost more than the matmuls (bench/forward.py
--breakdown, issue 19). The custom VJP runs the backward as a second loop over the same blocks,
accumulating each expert's weight gradient in place; its residuals are the padded rows and the
gate/up pre-activations [R, 2I] (what autodiff of the unfused form would keep, minus the weight
copies).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["blocked_ffn", "block_rows", "swiglu_grad", "swiglu_rows", "swiglu_rows_grads"]


def block_rows(n: int, e: int) -> int:
    """Row block for `n` sorted rows over `e` experts: about a quarter of the mean group size, a power
    of two in [8, 128], so the padding (at most e * (block - 1) rows) stays a small fraction of n."""
    target = max(8, min(128, n // (4 * e)))
    return 1 << (target.bit_length() - 1)


def _layout(group_sizes_G: jax.Array, m: int, blk: int) -> tuple[int, jax.Array, jax.Array, jax.Array]:
    """Static block count N, each row's slot in the padded layout (N * blk for rows past the groups),
    the expert of each block [N] (blocks past the used ones: the last expert, never run), and the
    number of used blocks."""
    g = group_sizes_G.shape[0]
    nb = -(-(m + g * (blk - 1)) // blk)
    sizes = group_sizes_G.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    row = jnp.arange(m, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), g - 1).astype(jnp.int32)
    padded = -(-sizes // blk) * blk
    pends = jnp.cumsum(padded)
    dest = jnp.where(row < ends[-1], pends[group] - padded[group] + row - (ends[group] - sizes[group]), nb * blk)
    block_e = jnp.minimum(jnp.searchsorted(pends, jnp.arange(nb) * blk, side="right"), g - 1).astype(jnp.int32)
    return nb, dest, block_e, pends[-1] // blk


def blocked_ffn(xs_MD: jax.Array, group_sizes_G: jax.Array, wi_gate_GDI: jax.Array, wi_up_GDI: jax.Array,
                wo_GID: jax.Array) -> jax.Array:
    """SwiGLU expert g on rows [start_g, start_g + size_g) of `xs` (rows sorted by expert); rows past
    `sum(group_sizes)` come out as exact zeros (and get zero gradients). Returns [M, D] fp32."""
    m, d = xs_MD.shape
    blk = block_rows(m, wi_gate_GDI.shape[0])
    nb, dest, block_e, used = _layout(group_sizes_G, m, blk)
    xb = jnp.zeros((nb * blk, d), xs_MD.dtype).at[dest].set(xs_MD, mode="drop")
    wgu = jnp.concatenate([wi_gate_GDI, wi_up_GDI], axis=2)
    y = _block_loop(xb, block_e, used, wgu, wo_GID, blk)
    return jnp.take(y, dest, axis=0, mode="fill", fill_value=0.0)


def _dot(a: jax.Array, b: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return jnp.dot(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def swiglu_rows(x_RD: jax.Array, wgu_DJ: jax.Array, wo_ID: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """One expert's SwiGLU on a block of rows: (y [R, D] fp32, the gate|up pre-activations hu
    [R, 2I] fp32); operands in `dtype`, fp32 accumulation."""
    i = wo_ID.shape[0]
    hu = _dot(x_RD, wgu_DJ, dtype)
    return _dot((jax.nn.silu(hu[:, :i]) * hu[:, i:]).astype(dtype), wo_ID, dtype), hu


def swiglu_rows_grads(x_RD: jax.Array, hu_RJ: jax.Array, dy_RD: jax.Array, wgu_DJ: jax.Array, wo_ID: jax.Array,
                      dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The backward of `swiglu_rows` from its saved (or recomputed) `hu`: (dx [R, D], dwgu [D, 2I],
    dwo [I, D]), fp32."""
    i = wo_ID.shape[0]
    h, u = hu_RJ[:, :i], hu_RJ[:, i:]
    silu = jax.nn.silu(h)
    dhu = swiglu_grad(hu_RJ, _dot(dy_RD, wo_ID.T, dtype))
    return _dot(dhu, wgu_DJ.T, dtype), _dot(x_RD.T, dhu, dtype), _dot((silu * u).T, dy_RD, dtype)


def swiglu_grad(hu_RJ: jax.Array, da_RI: jax.Array) -> jax.Array:
    """d(silu(h) * u) / d[h | u] applied to the cotangent `da` of the activation: [R, 2I] fp32
    from the gate|up pre-activations `hu` [R, 2I] (one elementwise pass: XLA writes the joined
    [R, 2I] gradient in one fusion, no separate dh and du buffers)."""
    i = da_RI.shape[-1]
    h, u = hu_RJ[..., :i].astype(jnp.float32), hu_RJ[..., i:].astype(jnp.float32)
    da = da_RI.astype(jnp.float32)
    sig = jax.nn.sigmoid(h)
    return jnp.concatenate([da * u * sig * (1.0 + h * (1.0 - sig)), da * h * sig], axis=-1)


def _forward(xb_RD, block_e_N, used, wgu_GDJ, wo_GID, blk: int, keep: bool):
    """Output [R, D] fp32 of the used blocks (zeros elsewhere) and, with `keep`, the gate|up
    pre-activations [R, 2I] fp32."""
    r, d = xb_RD.shape
    i = wo_GID.shape[1]
    dt = xb_RD.dtype

    def body(n, carry):
        y, hu_all = carry
        e = block_e_N[n]
        out, hu = swiglu_rows(jax.lax.dynamic_slice_in_dim(xb_RD, n * blk, blk), wgu_GDJ[e], wo_GID[e], dt)
        y = jax.lax.dynamic_update_slice_in_dim(y, out, n * blk, 0)
        if keep:
            hu_all = jax.lax.dynamic_update_slice_in_dim(hu_all, hu, n * blk, 0)
        return y, hu_all

    hu0 = jnp.zeros((r, 2 * i) if keep else (), jnp.float32)
    return jax.lax.fori_loop(0, used, body, (jnp.zeros((r, d), jnp.float32), hu0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _block_loop(xb_RD, block_e_N, used, wgu_GDJ, wo_GID, blk: int):
    return _forward(xb_RD, block_e_N, used, wgu_GDJ, wo_GID, blk, keep=False)[0]


def _block_loop_fwd(xb_RD, block_e_N, used, wgu_GDJ, wo_GID, blk):
    y, hu = _forward(xb_RD, block_e_N, used, wgu_GDJ, wo_GID, blk, keep=True)
    return y, (xb_RD, block_e_N, used, wgu_GDJ, wo_GID, hu)


def _block_loop_bwd(blk, res, dy_RD):
    xb_RD, block_e_N, used, wgu_GDJ, wo_GID, hu_RJ = res
    dt = xb_RD.dtype

    def body(n, carry):
        dx, dwgu, dwo = carry
        e = block_e_N[n]
        rows = lambda a: jax.lax.dynamic_slice_in_dim(a, n * blk, blk)  # noqa: E731
        gx, gwgu, gwo = swiglu_rows_grads(rows(xb_RD), rows(hu_RJ), rows(dy_RD), wgu_GDJ[e], wo_GID[e], dt)
        dx = jax.lax.dynamic_update_slice_in_dim(dx, gx, n * blk, 0)
        return dx, dwgu.at[e].add(gwgu), dwo.at[e].add(gwo)

    zeros = lambda a: jnp.zeros(a.shape, jnp.float32)  # noqa: E731
    dx, dwgu, dwo = jax.lax.fori_loop(0, used, body, (zeros(xb_RD), zeros(wgu_GDJ), zeros(wo_GID)))
    return dx.astype(xb_RD.dtype), None, None, dwgu.astype(wgu_GDJ.dtype), dwo.astype(wo_GID.dtype)


_block_loop.defvjp(_block_loop_fwd, _block_loop_bwd)
