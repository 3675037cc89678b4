"""Gated DeltaNet over a sequence-sharded row (context parallelism): clean stream and block mode.

Each device of the ``context`` mesh axis holds one contiguous shard of every row (shard i = tokens
[i*Tl, (i+1)*Tl)). The delta rule is linear in the state and independent across the dv columns of
the state: per head, ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`` and
``o_t = scale * S_t^T q_t``. So ONE chunked pass per shard, on values ``[v | 0]`` (dv + dk
columns) from the entry state ``[0 | I]``, yields

- in the first dv columns: the outputs ``o0`` and final state ``B`` of a zero entry state;
- in the last dk columns: ``P_t = scale * q_t^T A_{<=t}`` (how the entry state reaches output t)
  and the shard's map ``A`` (dk x dk): ``S_out = A S_in + B``.

A document start inside the shard zeroes every column, so ``A = 0`` after one. The maps of all
shards are all-gathered over the axis and composed in row order from the row's initial state, which
gives each shard its true entry state ``S_in`` (zeroed when the shard's first token starts a
document: the segment id of the token before the shard comes from the neighbour by ``ppermute``).
Then ``o = o0 + P S_in`` exactly: no second pass. A layout with several pieces of the row per
shard (``context_layout``: zigzag, pieces i and 2n-1-i) runs them as rows of the same call, and the
maps of all 2n pieces are composed in row order (``in_row_order``); each piece continues (and reads
its conv halo from) the piece before it in the row, wherever that piece lives. Block mode runs the block op on ``[v | 0]`` and
``[v_noisy | 0]`` from ``[0 | I]`` the same way (the noisy readout is linear in the block-entry
state ``S_n = B_n + A_n S_in``), except the shard's first block: its history unit exists only where
the shard continues the document before it, which a per-row flag decides, so that one block is read
out again here from ``S_in`` (``block_readout_ref``, Bk tokens).

The per-shard bodies (``shard_*``) run inside a ``shard_map`` manual over EVERY mesh axis
(:func:`over_rows`): rows over the batch axes and key/value heads over the head axes that
``common.sharding.gdn_mesh_axes`` picks for the one-device kernels, tokens over ``context``. Left
automatic, the other axes let XLA re-lay the per-chunk tensors of the math inside (batch sharding
moved onto the chunk dim, then all-gathered: bench/gdn_context.py). Each shard calls the dispatch
entry points with the configured backend (TPU: the phase kernels per shard; CPU: the jnp
reference), keys grouped (HK key heads, not repeated).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ..gdn import ops as gdn_ops
from ..gdn.block_reference import block_masks, block_readout_ref
from ..gdn.inputs import repeat_key_heads
from .axis import (CONTEXT_AXIS, context_size, first_piece, from_previous_piece, in_row_order, my_pieces, over_rows,
                   pick_pieces, row_specs)
from .layout import from_piece_rows, pieces, to_piece_rows

_HI = lax.Precision.HIGHEST


def shard_continues(segment_ids_RT: jax.Array, has_initial_state: bool, axis: str = CONTEXT_AXIS,
                    layout: str = "contiguous") -> jax.Array:
    """[B * P] bool over the piece rows: the piece's first token continues the document of the token
    before it (for the row's first piece: whether the row has a carried-in initial state, which
    belongs to token 0's document)."""
    prev = from_previous_piece(segment_ids_RT, 1, layout, axis)[:, 0]
    first = first_piece(segment_ids_RT.shape[0], layout, axis)
    return jnp.where(first, jnp.full(prev.shape, has_initial_state), segment_ids_RT[:, 0] == prev)


# ---------------------------------------------------------------------------------------------
# per-shard math
def augment(v_BTHV: jax.Array, K: int) -> tuple[jax.Array, jax.Array]:
    """([v | 0] [B, T, H, dv + dk] in v's dtype, the entry state [0 | I] [B, H, dk, dv + dk] fp32).
    v's dtype, not fp32: the Pallas kernels' value tiles already hold twice the columns (an fp32
    [v | 0] overflows the TPU's scoped VMEM in the block-mode backward at 1024-token shards); the
    state stays fp32 inside the kernels, only the per-token outputs round to v's dtype."""
    B, T, H, V = v_BTHV.shape
    f32 = jnp.float32
    v_aug = jnp.concatenate([v_BTHV, jnp.zeros((B, T, H, K), v_BTHV.dtype)], axis=-1)
    s0 = jnp.concatenate([jnp.zeros((B, H, K, V), f32), jnp.broadcast_to(jnp.eye(K, dtype=f32), (B, H, K, K))],
                         axis=-1)
    return v_aug, s0


def augmented_sweep(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, chunk_size: int, *,
                    backend: str = "auto", interpret: bool | None = None):
    """One chunked pass on values [v | 0] from the entry state [0 | I] (see the module doc), through
    ``gdn_ops.chunk_gated_delta_rule`` (q, k may be grouped key heads). Returns (o_aug
    [B, T, H, dv + dk] in v's dtype, final_aug [B, H, dk, dv + dk] fp32)."""
    v_aug, s0 = augment(v_BTHV, q_BTHK.shape[-1])
    return gdn_ops.chunk_gated_delta_rule(q_BTHK, k_BTHK, v_aug, g_BTH, beta_BTH, initial_state=s0,
                                           segment_ids=segment_ids_BT, chunk_size=chunk_size, backend=backend,
                                           interpret=interpret)


def entry_states(A_RHKK: jax.Array, B_RHKV: jax.Array, continues_R: jax.Array, state0_BHKV: jax.Array,
                 axis: str = CONTEXT_AXIS, layout: str = "contiguous") -> tuple[jax.Array, jax.Array]:
    """Exclusive scan of the piece maps in row order: (each piece row's entry state, zero where its
    first token starts a document [B * P, H, dk, dv]; the row's final state [B, H, dk, dv], equal
    on every shard). Piece r maps S -> A_r (c_r S) + B_r with c_r = ``continues`` of piece r."""
    A_RHKK = A_RHKK * continues_R[:, None, None, None].astype(A_RHKK.dtype)
    maps = (in_row_order(A_RHKK, layout, axis), in_row_order(B_RHKV, layout, axis))  # [n P, B, H, ...]

    def step(S_BHKV, ab):
        a_BHKK, b_BHKV = ab
        return jnp.einsum("bhkj,bhjv->bhkv", a_BHKK, S_BHKV, precision=_HI) + b_BHKV, S_BHKV

    final_BHKV, entries_NBHKV = lax.scan(step, state0_BHKV.astype(jnp.float32), maps)
    mine = pick_pieces(entries_NBHKV, my_pieces(layout, axis))
    return mine * continues_R[:, None, None, None].astype(mine.dtype), final_BHKV


def _apply_entry(aug_BTHX: jax.Array, S_in_BHKV: jax.Array, V: int) -> jax.Array:
    """Augmented outputs [B, T, H, dv + dk] -> [B, T, H, dv] fp32: the zero-entry part + (entry-state
    reach) @ S_in."""
    aug = aug_BTHX.astype(jnp.float32)
    return aug[..., :V] + jnp.einsum("bthj,bhjv->bthv", aug[..., V:], S_in_BHKV, precision=_HI)


def shard_chunk_gdn(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, state0_BHKV, *,
                    has_initial_state: bool, chunk_size: int, backend: str = "auto", interpret: bool | None = None,
                    axis: str = CONTEXT_AXIS, layout: str = "contiguous"):
    """Per-shard body of the causal GDN (inside :func:`over_rows`): local shards of every [B, T, ...]
    input (q, k [B, Tl, HK, dk] with HK dividing H) in the context ``layout``, the row's ``state0``
    (zeros when ``has_initial_state`` is False). The shard's P pieces run as P rows of one call.
    Returns (o [B, Tl, H, dv] in v's dtype, the row's final state [B, H, dk, dv] fp32)."""
    p, V = pieces(layout), v_BTHV.shape[-1]
    q, k, v, g, beta, seg = (to_piece_rows(x, p) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT))
    o_aug, fin = augmented_sweep(q, k, v, g, beta, seg, chunk_size, backend=backend, interpret=interpret)
    cont = shard_continues(seg, has_initial_state, axis, layout)
    S_in, final = entry_states(fin[..., V:], fin[..., :V], cont, state0_BHKV, axis, layout)
    return from_piece_rows(_apply_entry(o_aug, S_in, V), p).astype(v_BTHV.dtype), final


def shard_block_gdn(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, qn_BTHK, kn_BTHK, vn_BTHV, scalars_H3,
                    segment_ids_BT, state0_BHKV, *, has_initial_state: bool, block_size: int, chunk_size: int,
                    backend: str = "auto", interpret: bool | None = None, axis: str = CONTEXT_AXIS,
                    layout: str = "contiguous"):
    """Per-shard body of both block-mode streams (``gdn_ops.block_gated_delta_rule`` on the shard's
    piece rows, keys grouped or not). Every piece's length must be a multiple of ``block_size``.
    Returns (o_clean, o_noisy [B, Tl, H, dv] in v's dtype, the row's final clean state [B, H, dk, dv]
    fp32)."""
    p = pieces(layout)
    q, k, v, g, beta, qn, kn, vn, seg = (to_piece_rows(x, p) for x in (
        q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, qn_BTHK, kn_BTHK, vn_BTHV, segment_ids_BT))
    R, T, H, V = v.shape
    if T % block_size:
        raise ValueError(f"context piece of {T} tokens is not a multiple of block_size {block_size}")
    v_aug, s0 = augment(v, q.shape[-1])
    vn_aug = augment(vn, q.shape[-1])[0]
    o_aug, on_aug, fin = gdn_ops.block_gated_delta_rule(
        q, k, v_aug, g, beta, qn, kn, vn_aug, scalars_H3, block_size=block_size, initial_state=s0, segment_ids=seg,
        chunk_size=chunk_size, backend=backend, interpret=interpret)
    cont = shard_continues(seg, has_initial_state, axis, layout)
    S_in, final = entry_states(fin[..., V:], fin[..., :V], cont, state0_BHKV, axis, layout)
    o_clean = _apply_entry(o_aug, S_in, V)
    o_noisy = _apply_entry(on_aug, S_in, V)
    # each piece's first block (entry state S_in): the op above gave it the history unit wherever it
    # continues token 0's document; it exists only where the piece also continues the one before it
    one = lambda x: repeat_key_heads(x[:, :block_size], H)[:, None]  # noqa: E731  [R, 1, Bk, H, d]
    same_doc, has_history = block_masks(seg[:, :block_size], R, block_size, block_size, True)
    first = block_readout_ref(one(qn), one(kn), one(vn), S_in[:, None], same_doc, has_history & cont[:, None, None],
                              scalars_H3, block_size)
    o_noisy = jnp.concatenate([first[:, 0], o_noisy[:, block_size:]], axis=1)
    return (from_piece_rows(o_clean, p).astype(v_BTHV.dtype), from_piece_rows(o_noisy, p).astype(vn_BTHV.dtype),
            final)


# ---------------------------------------------------------------------------------------------
# entry points (the dispatch's argument convention)
def _prepare(q, v, initial_state, segment_ids, n: int, multiple: int, layout: str = "contiguous"):
    B, T, _, K = q.shape
    H, V = v.shape[2:]
    m = n * pieces(layout)
    if T % m or (T // m) % multiple:
        raise ValueError(f"GDN context parallelism: sequence length {T} must split into {m} pieces ({layout} "
                         f"layout over {n} shards) whose length is a multiple of {multiple} (mesh.context, "
                         f"model.block_size)")
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids).astype(jnp.int32)
    s0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    return seg, s0


def context_chunk_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, segment_ids=None, chunk_size: int = 64,
                                   backend: str = "auto", interpret: bool | None = None, mesh=None,
                                   batch_axes: Sequence[str] | None = None, head_axes: Sequence[str] | None = None,
                                   layout: str = "contiguous"):
    """``gdn_ops.chunk_gated_delta_rule`` with T sharded over the mesh's ``context`` axis (same
    arguments and results, every [B, T] array in the ``layout``'s order: ``context_layout.to_layout``;
    a mesh without that axis, or of size 1, runs the dispatch as is on row order). Rows and heads
    over ``batch_axes`` / ``head_axes`` (:func:`row_specs`)."""
    n = context_size(mesh)
    kw = dict(chunk_size=chunk_size, backend=backend, interpret=interpret)
    if n == 1:
        return gdn_ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
                                               mesh=mesh, batch_axes=batch_axes, head_axes=head_axes, **kw)
    seg, s0 = _prepare(q, v, initial_state, segment_ids, n, 1, layout)
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    sp = row_specs(mesh, q.shape[0], q.shape[2], batch_axes, head_axes)

    def body(q, k, v, g, beta, seg, s0):
        return shard_chunk_gdn(q, k, v, g, beta, seg, s0, has_initial_state=initial_state is not None, layout=layout,
                               **kw)

    return over_rows(body, (sp.tok_h,) * 5 + (sp.tok, sp.state), (sp.tok_h, sp.state),
                     q, k, v, g, beta, seg, s0, mesh=mesh)


def context_block_gated_delta_rule(q, k, v, g, beta, q_noisy, k_noisy, v_noisy, scalars_H3, *, block_size: int,
                                   initial_state=None, segment_ids=None, chunk_size: int = 64, backend: str = "auto",
                                   interpret: bool | None = None, mesh=None, batch_axes: Sequence[str] | None = None,
                                   head_axes: Sequence[str] | None = None, layout: str = "contiguous"):
    """``gdn_ops.block_gated_delta_rule`` with T sharded over the ``context`` axis, arrays in the
    ``layout``'s order; every piece's length must be a multiple of ``block_size`` (no block
    straddles two pieces)."""
    n = context_size(mesh)
    kw = dict(block_size=block_size, chunk_size=chunk_size, backend=backend, interpret=interpret)
    if n == 1:
        return gdn_ops.block_gated_delta_rule(q, k, v, g, beta, q_noisy, k_noisy, v_noisy, scalars_H3,
                                               initial_state=initial_state, segment_ids=segment_ids, mesh=mesh,
                                               batch_axes=batch_axes, head_axes=head_axes, **kw)
    seg, s0 = _prepare(q, v, initial_state, segment_ids, n, block_size, layout)
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    sp = row_specs(mesh, q.shape[0], q.shape[2], batch_axes, head_axes)

    def body(q, k, v, g, beta, qn, kn, vn, sc, seg, s0):
        return shard_block_gdn(q, k, v, g, beta, qn, kn, vn, sc, seg, s0, has_initial_state=initial_state is not None,
                               layout=layout, **kw)

    return over_rows(body, (sp.tok_h,) * 8 + (sp.per_head, sp.tok, sp.state), (sp.tok_h, sp.tok_h, sp.state),
                     q, k, v, g, beta, q_noisy, k_noisy, v_noisy, scalars_H3, seg, s0, mesh=mesh)


__all__ = [
    "augment", "augmented_sweep", "context_block_gated_delta_rule", "context_chunk_gated_delta_rule", "entry_states",
    "shard_block_gdn", "shard_chunk_gdn", "shard_continues",
]
