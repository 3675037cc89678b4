"""bench/gdn_kernel_report.py: the structure it reads from the kernel jaxprs, checked as properties.

Independent facts: the one-step-per-chunk kernels run the recursive-block inverse (2 log2(C) = 12
dependent C x C x C matmuls at C = 64) inside every sequential step; the phase split moves it to a
parallel kernel, so no sequential step holds a C x C x C matmul and the state path is a couple of
matmuls deep; the phase-split residual adds the inverse (C fp32 per token and value head) and
drops the repeated key heads (2 x dk bf16 per token for each of the H - HK extra heads). Block mode
(block 32): the fused kernels sweep chunks of 32 with the inverse inside every sequential step; the
phase kernels sweep chunks of 64 (half the sequential steps), the inverse only in the parallel one.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.bench.bench_import import bench_module  # noqa: E402


def test_report_reads_the_phase_split_from_the_kernels(tmp_path):
    rep = bench_module("gdn_kernel_report").main(["--T", "512", "--out", str(tmp_path / "r.json")])
    C = rep["shapes"]["C"]
    inverse = f"{C}x{C}x{C}"
    old_seq = [r for r in rep["before"] if r["sequential"]]
    new_seq = [r for r in rep["after"] if r["sequential"]]
    assert len(old_seq) == 3 and len(new_seq) == 3          # fwd, state recompute, reverse sweep
    for r in old_seq:
        assert inverse in r["matmul_shapes"] and r["dependent_matmuls_per_step"] >= 12, r
    for r in new_seq:
        assert inverse not in r["matmul_shapes"] and r["dependent_matmuls_per_step"] <= 3, r
    intra = next(r for r in rep["after"] if r["kernel"] == "gdn_intra")
    assert not intra["sequential"] and inverse in intra["matmul_shapes"]
    assert intra["steps_per_row_head"] * 4 == 512 // C      # 4 chunks per parallel grid step
    s = rep["shapes"]
    for t, r in rep["residual_bytes"].items():
        T = int(t[:-1]) * 1024
        added = s["H"] * T * C * 4 - 2 * T * (s["H"] - s["HK"]) * s["dk"] * 2
        assert r["after"]["residuals"] - r["before"]["residuals"] == added
        states = s["H"] * T * s["dk"] * s["dv"] * 4 // C      # fp32 [H, N * dk, dv]
        assert r["before"]["backward_states"] == states and r["after"]["backward_states"] == 2 * states


def test_report_reads_block_mode_from_the_kernels(tmp_path):
    rep = bench_module("gdn_kernel_report").main(["--T", "512", "--out", str(tmp_path / "r.json")])
    C, Bk = rep["shapes"]["C"], rep["shapes"]["block"]
    old_seq = [r for r in rep["block_before"] if r["sequential"]]
    new_seq = [r for r in rep["block_after"] if r["sequential"]]
    assert len(old_seq) == 3 and len(new_seq) == 3
    for r in old_seq:   # chunk forced to the block: T / 32 steps, the 32^3 inverse in each
        assert r["steps_per_row_head"] == 512 // Bk and f"{Bk}x{Bk}x{Bk}" in r["matmul_shapes"], r
    for r in new_seq:
        assert r["steps_per_row_head"] == 512 // C and f"{C}x{C}x{C}" not in r["matmul_shapes"], r
        assert r["dependent_matmuls_per_step"] <= 3, r
    names = {r["kernel"] for r in rep["block_after"]}
    assert {"gdn_block_sweep", "gdn_block_noisy", "gdn_block_state_bwd", "gdn_block_parallel_bwd"} <= names
    old, new = rep["block_before_sequential_per_64_tokens"], rep["block_after_sequential_per_64_tokens"]
    assert new["dependent"] * 4 <= old["dependent"] and new["matmuls"] * 4 <= old["matmuls"], (old, new)
