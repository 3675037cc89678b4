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
Then ``o = o0 + P S_in`` exactly: no second pass. Block mode reads the state entering every block;
those come from a state-only sweep with chunks of the block size (as ``block_gated_delta_rule_ref``
does) and are corrected the same way, ``S_n = B_n + A_n S_in``.

The per-shard bodies (``shard_*``) run inside a ``shard_map`` that is manual over the context axis
(other mesh axes stay automatic); the ``context_*`` entry points wrap them. Math per shard is the
jnp reference of ``gdn_reference`` / ``gdn_block_reference``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from .gdn_block_reference import block_gated_delta_rule_ref, block_masks, block_readout_ref
from .gdn_reference import chunk_gated_delta_rule_ref

CONTEXT_AXIS = "context"
_HI = lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------------------
# mesh helpers
def context_size(mesh=None, axis: str = CONTEXT_AXIS) -> int:
    """Size of the context axis of ``mesh`` (default: the one set by ``jax.set_mesh``); 1 when there
    is no mesh, no such axis, or the axis is already manual (we are inside its shard_map)."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", False) or axis not in getattr(mesh, "shape", {}):
        return 1
    if axis in set(getattr(mesh, "manual_axes", ())):
        return 1
    return int(mesh.shape[axis])


def over_context(body, in_specs: tuple, out_specs, *args, mesh=None, axis: str = CONTEXT_AXIS):
    """``shard_map(body)`` manual over ``axis`` only. ``check_vma=False``: the bodies mix per-shard
    and all-gathered values (their replicated outputs are equal on every shard by construction)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=frozenset({axis}), check_vma=False)(*args)


def from_previous_shard(x_BT: jax.Array, n: int, axis: str = CONTEXT_AXIS) -> jax.Array:
    """The last ``n`` entries along axis 1 of the previous shard's ``x`` (zeros on shard 0): the halo
    exchange. Inside a shard_map manual over ``axis``; the shard must hold at least ``n`` entries."""
    if x_BT.shape[1] < n:
        raise ValueError(f"context shard of {x_BT.shape[1]} tokens is shorter than the {n}-token halo")
    size = lax.axis_size(axis)
    return lax.ppermute(x_BT[:, x_BT.shape[1] - n:], axis, [(j, j + 1) for j in range(size - 1)])


def shard_continues(segment_ids_BT: jax.Array, has_initial_state: bool, axis: str = CONTEXT_AXIS) -> jax.Array:
    """[B] bool: the shard's first token continues the document of the token before it (for shard 0:
    whether the row has a carried-in initial state, which belongs to token 0's document)."""
    prev_B = from_previous_shard(segment_ids_BT, 1, axis)[:, 0]
    first = lax.axis_index(axis) == 0
    return jnp.where(first, jnp.full(prev_B.shape, has_initial_state), segment_ids_BT[:, 0] == prev_B)


# ---------------------------------------------------------------------------------------------
# per-shard math
def augmented_sweep(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, chunk_size: int,
                    return_chunk_states: bool = False):
    """One chunked pass on values [v | 0] from the entry state [0 | I] (see the module doc).
    Returns (o_aug [B, T, H, dv + dk], final_aug [B, H, dk, dv + dk]) fp32, plus the chunk-entry
    states [B, N, H, dk, dv + dk] with ``return_chunk_states``."""
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    f32 = jnp.float32
    v_aug = jnp.concatenate([v_BTHV.astype(f32), jnp.zeros((B, T, H, K), f32)], axis=-1)
    s0 = jnp.concatenate([jnp.zeros((B, H, K, V), f32), jnp.broadcast_to(jnp.eye(K, dtype=f32), (B, H, K, K))],
                         axis=-1)
    return chunk_gated_delta_rule_ref(q_BTHK, k_BTHK, v_aug, g_BTH, beta_BTH, initial_state=s0,
                                      segment_ids=segment_ids_BT, chunk_size=chunk_size,
                                      return_chunk_states=return_chunk_states)


def entry_states(A_BHKK: jax.Array, B_BHKV: jax.Array, continues_B: jax.Array, state0_BHKV: jax.Array,
                 axis: str = CONTEXT_AXIS) -> tuple[jax.Array, jax.Array]:
    """Exclusive scan of the shard maps over ``axis``: (this shard's entry state, zero where its first
    token starts a document [B, H, dk, dv]; the row's final state [B, H, dk, dv], equal on every
    shard). Shard j maps S -> A_j (c_j S) + B_j with c_j = ``continues`` of shard j."""
    A_BHKK = A_BHKK * continues_B[:, None, None, None].astype(A_BHKK.dtype)
    maps = (lax.all_gather(A_BHKK, axis), lax.all_gather(B_BHKV, axis))  # [n, B, H, ...] in row order

    def step(S_BHKV, ab):
        a_BHKK, b_BHKV = ab
        return jnp.einsum("bhkj,bhjv->bhkv", a_BHKK, S_BHKV, precision=_HI) + b_BHKV, S_BHKV

    final_BHKV, entries_NBHKV = lax.scan(step, state0_BHKV.astype(jnp.float32), maps)
    mine = entries_NBHKV[lax.axis_index(axis)]
    return mine * continues_B[:, None, None, None].astype(mine.dtype), final_BHKV


def _apply_entry(aug: jax.Array, S_in_BHKV: jax.Array, V: int, spec: str) -> jax.Array:
    """zero-entry part + (entry-state reach) @ S_in; `spec` names aug's dims, the last one contracted
    with S_in's dk ('bthj' for outputs, 'bnhkj' for block-entry states)."""
    out = spec[:-1] + "v"
    return aug[..., :V] + jnp.einsum(f"{spec},bhjv->{out}", aug[..., V:], S_in_BHKV, precision=_HI)


def shard_chunk_gdn(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, state0_BHKV, *,
                    has_initial_state: bool, chunk_size: int, axis: str = CONTEXT_AXIS):
    """Per-shard body of the causal GDN (inside a shard_map manual over ``axis``): local shards of
    every [B, T, ...] input, the row's ``state0`` (zeros when ``has_initial_state`` is False).
    Returns (o [B, Tl, H, dv] in v's dtype, the row's final state [B, H, dk, dv] fp32)."""
    V = v_BTHV.shape[-1]
    o_aug, fin = augmented_sweep(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, chunk_size)
    cont = shard_continues(segment_ids_BT, has_initial_state, axis)
    S_in, final = entry_states(fin[..., V:], fin[..., :V], cont, state0_BHKV, axis)
    return _apply_entry(o_aug, S_in, V, "bthj").astype(v_BTHV.dtype), final


def shard_block_gdn(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, qn_BTHK, kn_BTHK, vn_BTHV, scalars_H3,
                    segment_ids_BT, state0_BHKV, *, has_initial_state: bool, block_size: int, chunk_size: int,
                    axis: str = CONTEXT_AXIS):
    """Per-shard body of both block-mode streams (``block_gated_delta_rule_ref`` on a shard).
    The shard length must be a multiple of ``block_size``. Returns (o_clean, o_noisy [B, Tl, H, dv]
    in v's dtype, the row's final clean state [B, H, dk, dv] fp32)."""
    B, T, H, _ = q_BTHK.shape
    V = v_BTHV.shape[-1]
    if T % block_size:
        raise ValueError(f"context shard of {T} tokens is not a multiple of block_size {block_size}")
    if block_size == chunk_size:
        o_aug, fin, ent_aug = augmented_sweep(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT,
                                              chunk_size, return_chunk_states=True)
    else:
        o_aug, fin = augmented_sweep(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, chunk_size)
        ent_aug = augmented_sweep(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, block_size,
                                  return_chunk_states=True)[2]
    cont = shard_continues(segment_ids_BT, has_initial_state, axis)
    S_in, final = entry_states(fin[..., V:], fin[..., :V], cont, state0_BHKV, axis)
    o_clean = _apply_entry(o_aug, S_in, V, "bthj")
    entry_BNHKV = _apply_entry(ent_aug, S_in, V, "bnhkj")
    same_doc, has_history = block_masks(segment_ids_BT, B, T, block_size, True)
    # the shard's first block has history only if the shard continues the document before it
    has_history = has_history.at[:, 0].set(has_history[:, 0] & cont[:, None])
    n = T // block_size
    blocks = lambda x: x.reshape((B, n, block_size) + x.shape[2:])  # noqa: E731
    o_noisy = block_readout_ref(blocks(qn_BTHK), blocks(kn_BTHK), blocks(vn_BTHV), entry_BNHKV, same_doc,
                                has_history, scalars_H3, block_size)
    return (o_clean.astype(v_BTHV.dtype), o_noisy.reshape(B, T, H, V).astype(vn_BTHV.dtype), final)


# ---------------------------------------------------------------------------------------------
# entry points (the dispatch's argument convention)
def _prepare(q, v, initial_state, segment_ids, n: int, multiple: int):
    B, T, H, K = q.shape
    V = v.shape[-1]
    if T % n or (T // n) % multiple:
        raise ValueError(f"GDN context parallelism: sequence length {T} must split into {n} shards whose "
                         f"length is a multiple of {multiple} (mesh.context, model.block_size)")
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids).astype(jnp.int32)
    s0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    return seg, s0


_TOK4, _TOK3, _TOK2 = P(None, CONTEXT_AXIS, None, None), P(None, CONTEXT_AXIS, None), P(None, CONTEXT_AXIS)


def context_chunk_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, segment_ids=None, chunk_size: int = 64,
                                   mesh=None):
    """``chunk_gated_delta_rule_ref`` with T sharded over the mesh's ``context`` axis (same arguments
    and results; a mesh without that axis, or of size 1, runs the reference as is)."""
    n = context_size(mesh)
    if n == 1:
        return chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
                                          chunk_size=chunk_size)
    seg, s0 = _prepare(q, v, initial_state, segment_ids, n, 1)

    def body(q, k, v, g, beta, seg, s0):
        return shard_chunk_gdn(q, k, v, g, beta, seg, s0, has_initial_state=initial_state is not None,
                               chunk_size=chunk_size)

    return over_context(body, (_TOK4,) * 3 + (_TOK3,) * 2 + (_TOK2, P()), (_TOK4, P()),
                        q, k, v, g, beta, seg, s0, mesh=mesh)


def context_block_gated_delta_rule(q, k, v, g, beta, q_noisy, k_noisy, v_noisy, scalars_H3, *, block_size: int,
                                   initial_state=None, segment_ids=None, chunk_size: int = 64, mesh=None):
    """``block_gated_delta_rule_ref`` with T sharded over the ``context`` axis; every shard's length
    must be a multiple of ``block_size`` (no block straddles two shards)."""
    n = context_size(mesh)
    if n == 1:
        return block_gated_delta_rule_ref(q, k, v, g, beta, q_noisy, k_noisy, v_noisy, scalars_H3,
                                          block_size=block_size, initial_state=initial_state,
                                          segment_ids=segment_ids, chunk_size=chunk_size)
    seg, s0 = _prepare(q, v, initial_state, segment_ids, n, block_size)

    def body(q, k, v, g, beta, qn, kn, vn, sc, seg, s0):
        return shard_block_gdn(q, k, v, g, beta, qn, kn, vn, sc, seg, s0, has_initial_state=initial_state is not None,
                               block_size=block_size, chunk_size=chunk_size)

    return over_context(body, (_TOK4,) * 3 + (_TOK3,) * 2 + (_TOK4,) * 3 + (P(), _TOK2, P()), (_TOK4, _TOK4, P()),
                        q, k, v, g, beta, q_noisy, k_noisy, v_noisy, scalars_H3, seg, s0, mesh=mesh)


__all__ = [
    "CONTEXT_AXIS", "augmented_sweep", "context_block_gated_delta_rule", "context_chunk_gated_delta_rule",
    "context_size", "entry_states", "from_previous_shard", "over_context", "shard_block_gdn", "shard_chunk_gdn",
    "shard_continues",
]
