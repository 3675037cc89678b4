"""The `context` mesh axis (clover_jax/parallel/context.py, the `length -> context` rule of
parallel/sharding.py): rows split into contiguous shards, and the split's validation names the keys."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from clover_jax.parallel import sharding as sh
from clover_jax.parallel.context import check_context_split


def test_length_rule_shards_rows_into_contiguous_pieces():
    mesh = sh.make_mesh(sh.MeshConfig(fsdp=2, context=4))
    assert dict(mesh.shape)["context"] == 4
    spec = sh.logical_to_spec(("batch", "length", "act_embed"), sh.DEFAULT_RULES, mesh, (2, 32, 8))
    assert spec == jax.sharding.PartitionSpec("fsdp", "context", None)
    x = np.arange(2 * 32).reshape(2, 32)
    arr = jax.device_put(x, sh.batch_sharding(mesh, shape=x.shape))
    # each device holds one row's contiguous slice of 32 / 4 = 8 tokens, in row order along the axis
    for shard in arr.addressable_shards:
        rows, cols = shard.index
        assert cols.stop - cols.start == 8
        np.testing.assert_array_equal(np.asarray(shard.data), x[rows, cols])
    ctx_of = {dev: idx[sh.MESH_AXES.index("context")] for idx, dev in np.ndenumerate(mesh.devices)}
    for shard in arr.addressable_shards:
        assert shard.index[1].start == 8 * ctx_of[shard.device]


def test_context_split_validation_names_the_keys():
    assert check_context_split(32768, 8, (4, 32), 64, 4) == 4096
    assert check_context_split(100, 1, (32,), 64, 4) == 100  # no split: nothing to check
    with pytest.raises(ValueError, match=r"data.seq_len=100 does not split into mesh.context=8"):
        check_context_split(100, 8)
    with pytest.raises(ValueError, match=r"model.block_size=32"):
        check_context_split(64 * 3, 4, (4, 32))
    with pytest.raises(ValueError, match=r"model.gdn_chunk_size=64"):
        check_context_split(32 * 4, 4, (32,), 64)
    with pytest.raises(ValueError, match=r"linear_conv_kernel_dim"):
        check_context_split(8, 4, (1,), 1, 4)
    with pytest.raises(ValueError, match=r"mesh.context must be >= 1"):
        check_context_split(8, 0)
