"""bench/gpu_check_sft.py, part a of the GPU check: the chip and roofline bookkeeping beside the measured
step, and the step's retry at half the length when the device runs out of memory (what an H100 may do
at 4096 tokens). Its whole run is tests/bench/test_gpu_check.py's smoke."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.bench.bench_import import bench_module  # noqa: E402

sft_check = bench_module("gpu_check_sft")


def test_chips_and_predictions_without_figures():
    assert [sft_check.chip_of(k) for k in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "TPU v5p", "TPU v5 lite", "cpu")] \
        == ["h100", "h200", "v5p", "v5e", None]
    flops = SimpleNamespace(model=2e12, executed=3e12)
    cost = {"hlo_flops": 5e11, "hlo_hbm_bytes": 3.35e9, "hlo_ici_bytes": 0.0}
    # on an H100: compute 5e11 / 989e12 s vs HBM 3.35e9 / 3350e9 = 1 ms: HBM bound, measured 2 ms = 2x
    p = sft_check.predictions("h100", 2e-3, cost, flops, 4096, "NVIDIA H100 80GB HBM3")
    assert p["roofline"]["bound"] == "HBM bandwidth" and p["roofline"]["measured_over_predicted"] == pytest.approx(2.0)
    assert p["roofline_analytic_flops"]["compute_s"] == pytest.approx(3e12 / 989e12)
    assert p["mfu"] == pytest.approx(2e12 / 2e-3 / 989e12) and p["tokens_per_s"] == pytest.approx(4096 / 2e-3)
    # a chip the table lacks: MFU from the recipe's known peaks, the prediction unavailable and why
    p = sft_check.predictions(None, 2e-3, cost, flops, 4096, "NVIDIA A100-SXM4-80GB")
    assert p["mfu"] == pytest.approx(2e12 / 2e-3 / 312e12) and "A100" in p["roofline"]["unavailable"]
    assert "HLO walk failed" in sft_check.predictions("h100", 2e-3, None, flops, 4096, "x")["roofline"]["unavailable"]


def step_check(errors: dict[int, str]) -> tuple:
    """An SftCheck with only what `step` reads, whose `step_row` raises errors[t] at length t."""
    chk = object.__new__(sft_check.SftCheck)
    chk.args, chk.res, chk.save = SimpleNamespace(seq=128, block=32), {"failed": {}}, lambda: None
    calls: list[int] = []

    def step_row(name: str, t: int) -> dict:
        calls.append(t)
        if t in errors:
            raise RuntimeError(errors[t])
        return {"step_s": 0.5, "tokens_per_s": t / 0.5, "mfu": None, "roofline": {"unavailable": "no figures"}}

    chk.step_row = step_row
    return chk, calls


def test_a_step_out_of_device_memory_runs_again_at_half_the_length():
    chk, calls = step_check({128: "RESOURCE_EXHAUSTED: Out of memory allocating 9.1GiB"})
    summary = chk.step("kernels", time.perf_counter() + 60)
    assert calls == [128, 64] and summary.startswith("seq 64: 500.0 ms")
    assert "RESOURCE_EXHAUSTED" in chk.res["failed"]["kernels_step_seq128"]


def test_a_step_that_fails_otherwise_or_twice_or_late_raises():
    for errors, deadline, tried in (({128: "INVALID_ARGUMENT: bad"}, 60, [128]),
                                    ({128: "RESOURCE_EXHAUSTED", 64: "RESOURCE_EXHAUSTED"}, 60, [128, 64]),
                                    ({128: "RESOURCE_EXHAUSTED"}, -1, [128])):
        chk, calls = step_check(errors)
        with pytest.raises(RuntimeError):
            chk.step("reference", time.perf_counter() + deadline)
        assert calls == tried and set(chk.res["failed"]) == {f"reference_step_seq{t}" for t in tried}
