"""bench/gdn_kernel_report.py: the structure it reads from the kernel jaxprs, checked as properties.

Independent facts of the phase split (issue 17), in both forms (TPU Mosaic, GPU Triton): the
triangular inverse lives only in the parallel intra-chunk kernel (TPU: the doubling recursion, 2
log2(C) = 12 dependent C x C x C matmuls at C = 64; GPU: the blocked one, 16 x 16 diagonal tiles by
substitution merged by 2 matmuls per level on 16 and 32 wide blocks); no sequential kernel holds a
C x C x C matmul and each sequential step is at most 3 dependent matmuls deep. Block mode (block 32)
sweeps chunks of 64, not chunks forced to the block. The residual counts and the inverse's matmul
counts are checked against hand arithmetic.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.bench.bench_import import bench_module  # noqa: E402

T = 512


@pytest.fixture(scope="module")
def rep(tmp_path_factory):
    return bench_module("gdn_kernel_report").main(["--T", str(T), "--out", str(tmp_path_factory.mktemp("r") / "r.json")])


@pytest.mark.parametrize("side", ["tpu", "gpu", "block_tpu", "block_gpu"])
def test_only_the_parallel_kernel_inverts(rep, side):
    C = rep["shapes"]["C"]
    inverse = f"{C}x{C}x{C}"
    seq = [r for r in rep[side] if r["sequential"]]
    assert len(seq) == 3, [r["kernel"] for r in rep[side]]   # fwd sweep, state recompute, reverse dS sweep
    for r in seq:
        assert inverse not in r["matmul_shapes"] and r["dependent_matmuls_per_step"] <= 3, r
    intra = next(r for r in rep[side] if r["kernel"].endswith("intra"))
    assert not intra["sequential"]
    levels = C.bit_length() - 1                                          # log2(C)
    if side.endswith("tpu"):   # the doubling inverse: 2 log2(C) dependent C x C x C matmuls
        assert inverse in intra["matmul_shapes"] and intra["dependent_matmuls_per_step"] >= 2 * levels
    else:   # blocked: k k^T, 2 per merge level 16 -> C, then the WY product
        assert inverse not in intra["matmul_shapes"] and "16x16x16" in intra["matmul_shapes"]
        assert intra["dependent_matmuls_per_step"] == 1 + 2 * (levels - 4) + 1


def test_inverse_counts_by_hand(rep):
    """Per C x C chunk matrix: doubling, 2 log2(C) levels of 2 C x C x C matmuls, all dependent;
    blocked, per merge level of b-wide blocks (b = 16, 32, ...) C / 2b merges of 2 b x b x b matmuls,
    2 of them on the chain per level, after the 16 x 16 substitution's 15 row steps (+ the first
    row's extraction: 16 dependent reductions)."""
    C = rep["shapes"]["C"]
    inv, levels = rep["inverse"], C.bit_length() - 1
    d, b = inv["doubling"], inv["blocked"]
    assert d["forms"] == ["tpu"] and b["forms"] == ["gpu"]
    assert d["matmuls"] == d["dependent_matmuls"] == 2 * levels
    assert d["macs"] == d["dependent_macs"] == 2 * levels * C ** 3
    widths = [16 << i for i in range(levels - 4)]                       # 16, 32 at C = 64
    assert b["matmuls"] == sum(C // (2 * w) * 2 for w in widths) and b["dependent_matmuls"] == 2 * len(widths)
    assert b["macs"] == sum(C // (2 * w) * 2 * w ** 3 for w in widths)
    assert b["dependent_macs"] == sum(2 * w ** 3 for w in widths) and b["dependent_reductions"] == 16
    assert d["dependent_reductions"] == 0


def test_chunks_per_step(rep):
    C, N = rep["shapes"]["C"], T // rep["shapes"]["C"]
    tpu_intra = next(r for r in rep["tpu"] if r["kernel"] == "gdn_intra")
    assert tpu_intra["steps_per_row_head"] * 4 == N                      # 4 chunks per parallel grid step
    tiles = rep["shapes"]["dv"] // rep["shapes"]["gpu_dv_tile"]
    for side, sweep in (("tpu", "gdn_sweep"), ("block_tpu", "gdn_block_sweep"), ("gpu", "gdn_gpu_sweep")):
        r = next(r for r in rep[side] if r["kernel"] == sweep)
        assert r["steps_per_row_head"] == N * (tiles if side == "gpu" else 1), (side, r)  # chunks of 64 in block mode too
    names = {r["kernel"] for r in rep["block_tpu"]}
    assert {"gdn_block_sweep", "gdn_block_noisy", "gdn_block_state_bwd", "gdn_block_parallel_bwd"} <= names


def test_residual_bytes_by_hand(rep):
    s = rep["shapes"]
    H, HK, K, V, C = s["H"], s["HK"], s["dk"], s["dv"], s["C"]
    for t, r in rep["residual_bytes"].items():
        n = int(t[:-1]) * 1024
        states = H * (n // C) * K * V * 4                                   # fp32 [H, N, dk, dv]
        assert r["backward_states"] == 2 * states and r["gpu_forward_states"] == states
        inputs = n * H * V * 2 + 2 * n * HK * K * 2                         # v and the grouped q, k in bf16
        inverse = H * n * C * 4                                             # C fp32 per token and value head
        # plus the per-chunk gates (AUX_WIDTH x C fp32, small next to C x C) and the fp32 entry state
        assert inputs + inverse < r["residuals"] < inputs + inverse + 0.2 * inverse, (t, r)
