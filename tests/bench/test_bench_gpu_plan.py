"""bench/gpu_plan.py: a TPU plan's cost at a GPU's peaks, checked against hand-computed roofline
times, the memory verdict at the usable share of the GPU's memory, and a refused plan named."""

from __future__ import annotations

import pytest

from tests.bench.bench_import import bench_module

GiB = 1024**3


def _plan(total_gib: float, args_gib: float) -> dict:
    # per chip: 989e12 FLOPs (1 s at the H100's bf16 peak), 6.7e12 HBM bytes (2 s at 3350 GB/s),
    # 450e9 + 450e9 ICI bytes (1 s at 900 GB/s); 8 chips, model FLOPs = half the executed ones
    return {"topology": "v5p-16", "chips": 8, "mesh": {"fsdp": 8}, "micro_batches": 8, "micro_batch": 4,
            "seq_len": 8192, "argument_bytes": int(args_gib * GiB), "temp_bytes": int((total_gib - args_gib) * GiB),
            "total_bytes": int(total_gib * GiB), "compiled": True, "flops_per_chip": 989e12,
            "model_flops": 8 * 989e12 / 2, "tokens_per_step": 262144,
            "hlo_cost": {"hbm_bytes": 6.7e12, "ici_bytes": {"all-gather": 450e9, "reduce-scatter": 450e9}}}


def test_h100_roofline_and_memory_by_hand():
    mod = bench_module("gpu_plan")
    usable = 0.95 * 81559 * 1024**2 / GiB  # 75.67 GiB
    row = mod.gpu_plan(_plan(70.0, 20.0), "h100", "p.json[0]")
    r = row["roofline"]
    assert (r["compute_s"], r["hbm_s"], r["ici_s"]) == pytest.approx((1.0, 2.0, 1.0))
    assert r["step_s"] == pytest.approx(2.0) and r["bound"] == "HBM bandwidth"
    assert r["tokens_per_s"] == pytest.approx(262144 / 2.0)
    assert r["mfu"] == pytest.approx(0.25)  # half the executed FLOPs count, at half the compute-bound rate
    assert row["usable_bytes_per_device"] / GiB == pytest.approx(usable) and row["fits"] and row["state_fits"]
    over = mod.gpu_plan(_plan(usable + 0.5, 20.0), "h100", "p.json[0]")
    assert not over["fits"] and over["state_fits"]
    assert mod.gpu_plan(_plan(usable + 0.5, 20.0), "h200", "p.json[0]")["fits"]  # 141 GB holds it


def test_refuses_an_uncompiled_plan_and_an_unknown_chip():
    mod = bench_module("gpu_plan")
    with pytest.raises(ValueError, match=r"p\.json\[3\]: the plan was not compiled"):
        mod.gpu_plan({**_plan(70.0, 20.0), "compiled": False, "hlo_cost": None}, "h100", "p.json[3]")
    with pytest.raises(ValueError, match="known GPUs"):
        mod.gpu_plan(_plan(70.0, 20.0), "v5p", "p.json[0]")
