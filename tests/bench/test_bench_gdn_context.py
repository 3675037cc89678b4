"""bench/gdn_context.py at a small width: the TPU AOT compile of the context-parallel GDN op with the
Pallas (Mosaic) kernels per shard, both modes, forward + backward, on fsdp 2 x context 4 of a v5p
slice, and the collective bytes it reads from the HLO against counts made here from the shapes alone.

Independent facts: each chip holds one row's shard (rows over fsdp) of 32 value heads; the only
things that must cross chips are the shard's affine state map, A [1, 32, 128, 128] and
B [1, 32, 128, 128] fp32, gathered from the 4 context shards (forward) and its cotangent scattered
back (backward, the same bytes), the segment id of the token before the shard (one int32), and in
block mode the softmax scalars' gradient [32, 3] fp32 summed over the replicas. In particular no
all-gather of activation-sized tensors over fsdp (what the op's shard_map did while it left the
other mesh axes automatic: 440 MiB gathered per chip at T = 4096 for the clean stream instead of 32).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.bench.bench_import import bench_module  # noqa: E402


def test_gdn_context_bench_moves_only_the_state_maps(tmp_path):
    out = bench_module("gdn_context").main(["--seq", "512", "--backend", "pallas", "--out", str(tmp_path / "g.json"),
                                           "--before", ""])
    maps = 4 * 32 * 128 * (128 + 128) * 4  # 4 shards' A and B, fp32, one row
    for r in out["rows"]:
        got = r["hlo_collective_bytes"]
        assert got["all-gather"] == maps, r["mode"]
        assert got["reduce-scatter"] == maps, r["mode"]
        assert got["collective-permute"] == 4, r["mode"]
        assert got["all-reduce"] == (32 * 3 * 4 if r["mode"] == "block" else 0), r["mode"]
        assert got["all-to-all"] == 0, r["mode"]
        assert r["kernel_calls"] > 0, "no Pallas kernel per shard"
