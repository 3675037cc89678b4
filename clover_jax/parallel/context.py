"""Context parallelism: the `context` mesh axis splits every row's sequence into contiguous shards.

`length -> context` in THE rule table (`parallel.sharding`) shards [B, T, ...] activations along
T. The sequence-mixing layers run per shard under a `shard_map`: the GDN, manual over every mesh
axis (rows and heads split as the rule table lays them out), folds each shard into an affine state
map and scans the maps across shards (`pallas_kernels.gdn_context`); attention gathers K/V over the
axis (`pallas_kernels.attention_context`). Token-wise layers (projections, MoE, norms) need nothing.

The split must keep every block (block diffusion) and every GDN chunk inside one shard, and give
each shard at least the conv's K-1 left taps: `check_context_split` says so naming the config keys.
"""

from __future__ import annotations

from collections.abc import Sequence

CONTEXT_AXIS = "context"


def check_context_split(seq_len: int, context: int, block_sizes: Sequence[int] = (), gdn_chunk_size: int = 1,
                        conv_kernel: int = 1, *, where: str = "config") -> int:
    """Validates that rows of `seq_len` tokens split into `context` shards whose length is a multiple
    of every block size and of the GDN chunk and holds the conv halo; returns the shard length.
    Errors name the keys (`mesh.context`, `data.seq_len`, `model.block_size`, `model.gdn_chunk_size`)."""
    if context < 1:
        raise ValueError(f"{where}: mesh.context must be >= 1, got {context}")
    if seq_len % context:
        raise ValueError(f"{where}: data.seq_len={seq_len} does not split into mesh.context={context} equal shards")
    shard = seq_len // context
    if context == 1:
        return shard
    for bk in block_sizes:
        if shard % bk:
            raise ValueError(f"{where}: a context shard holds data.seq_len / mesh.context = {seq_len} / {context} = "
                             f"{shard} tokens, not a multiple of model.block_size={bk} (a block may not straddle "
                             "two shards)")
    if shard % gdn_chunk_size:
        raise ValueError(f"{where}: a context shard holds data.seq_len / mesh.context = {shard} tokens, not a "
                         f"multiple of model.gdn_chunk_size={gdn_chunk_size}")
    if shard < conv_kernel - 1:
        raise ValueError(f"{where}: a context shard holds {shard} tokens, fewer than the conv's "
                         f"model.linear_conv_kernel_dim - 1 = {conv_kernel - 1} left taps")
    return shard


__all__ = ["CONTEXT_AXIS", "check_context_split"]
