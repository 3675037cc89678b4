"""bench/context.py at a small width: the TPU AOT compile of the context attention with splash per
shard (both streams, forward + backward, context 2 of a v5p slice), and the collective bytes it reads
from the HLO against counts made here from the shapes alone.

Independent facts: one layer's clean K/V [1, T, 2, 256] bf16 and ids [1, T] int32, gathered whole on
each chip, are what the forward must exchange (the two streams read the same clean keys: one gather
serves both); the backward returns dK and dV once, the full [1, T, 2, 256] on every chip before the
reduction (the streams' cotangents summed first); nothing else crosses chips (no permute, no all-to-all); the splash
kernels run per shard: forward, dq and dkv for each stream. The zig-zag layout exchanges exactly the
same bytes and runs no more splash FLOPs per chip."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.bench.bench_import import bench_module  # noqa: E402


def test_context_bench_reads_the_kv_exchange_from_the_hlo(tmp_path):
    t = 1024
    r, z = bench_module("context").main(["--seq", str(t), "--contexts", "2", "--out", str(tmp_path / "c.json")])["rows"]
    kv = 2 * t * 2 * 256 * 2  # K and V, bf16, the whole row
    got = r["hlo_collective_bytes"]
    assert got["all-gather"] == kv + t * 4
    assert got["reduce-scatter"] + got["all-reduce"] == kv  # XLA:TPU may write the scatter as an all-reduce
    assert got["collective-permute"] == got["all-to-all"] == 0
    assert r["analytic_bytes"] == {"all-gather": kv + t * 4, "reduce-scatter": kv}
    assert r["splash_calls"] == 6
    # zig-zag: the same exchange (the pieces put in row order on the chip), at most the same tiles
    assert z["layout"] == "zigzag" and z["hlo_collective_bytes"] == got and z["splash_calls"] == 6
    assert 0 < z["splash_flops"] <= r["splash_flops"]
