"""Context parallelism: the `context` mesh axis splits every row's sequence into shards (contiguous
pieces of the row, or two pieces each for `model.context_layout: zigzag`: pallas_kernels.context.layout).

`length -> context` in THE rule table (`parallel.sharding`) shards [B, T, ...] activations along
T. The sequence-mixing layers run per shard under a `shard_map`: the GDN, manual over every mesh
axis (rows and heads split as the rule table lays them out), folds each shard into an affine state
map and scans the maps across shards (`pallas_kernels.context.gdn_scan`); attention gathers K/V over the
axis (`pallas_kernels.context.attention`). Token-wise layers (projections, MoE, norms) need nothing.

The split must keep every block (block diffusion) and every GDN chunk inside one piece, and give
each piece at least the conv's K-1 left taps: `check_context_split` says so naming the config keys.
The axis name is `pallas_kernels.context.axis.CONTEXT_AXIS` (the mesh's `MESH_AXES` names the same one).
"""

from __future__ import annotations

from collections.abc import Sequence

def check_context_split(seq_len: int, context: int, block_sizes: Sequence[int] = (), gdn_chunk_size: int = 1,
                        conv_kernel: int = 1, *, where: str = "config", layout: str = "contiguous",
                        pieces: int = 1) -> int:
    """Validates that rows of `seq_len` tokens split into `context` shards whose `pieces` pieces each
    (1; 2 for the zigzag `layout`: `pallas_kernels.context.layout.pieces`) are a multiple of every
    block size and of the GDN chunk and hold the conv halo; returns the piece length. Errors name the
    keys (`mesh.context`, `data.seq_len`, `model.block_size`, `model.gdn_chunk_size`,
    `model.context_layout`)."""
    if context < 1:
        raise ValueError(f"{where}: mesh.context must be >= 1, got {context}")
    m = context * (pieces if context > 1 else 1)
    if seq_len % m:
        split = f"mesh.context={context} equal shards" if m == context else (
            f"{m} equal pieces (mesh.context={context}, model.context_layout={layout}: {pieces} pieces per shard)")
        raise ValueError(f"{where}: data.seq_len={seq_len} does not split into {split}")
    shard = seq_len // m
    if context == 1:
        return shard
    for bk in block_sizes:
        if shard % bk:
            raise ValueError(f"{where}: a context piece holds data.seq_len / {m} = {seq_len} / {m} = "
                             f"{shard} tokens (mesh.context={context}, model.context_layout={layout}), not a multiple "
                             f"of model.block_size={bk} (a block may not straddle two pieces)")
    if shard % gdn_chunk_size:
        raise ValueError(f"{where}: a context piece holds data.seq_len / {m} = {shard} tokens, not a "
                         f"multiple of model.gdn_chunk_size={gdn_chunk_size}")
    if shard < conv_kernel - 1:
        raise ValueError(f"{where}: a context piece holds {shard} tokens, fewer than the conv's "
                         f"model.linear_conv_kernel_dim - 1 = {conv_kernel - 1} left taps")
    return shard


__all__ = ["check_context_split"]
