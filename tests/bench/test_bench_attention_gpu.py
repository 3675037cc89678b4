"""bench/attention_gpu.py, the prepared GPU device check of the flash kernel, in its --smoke mode.

The script is meant to run once, unattended, on a lent GPU with minutes of budget; this runs the
same code on CPU (the kernel in interpret mode, tiny shapes) so that it cannot rot unnoticed. The
oracle is the script's own comparison against the dense reference: the interpret-mode kernel must
agree with it as tightly as the kernel tests demand (fp32). The plain ``--smoke`` run is checked in
tests/bench/test_gpu_check.py (bench/gpu_check.py runs it as its part c); here, the options it
leaves out."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.bench.bench_import import bench_module  # noqa: E402


def test_device_check_skips_a_reference_that_would_not_fit_and_what_the_budget_leaves_out(tmp_path):
    attention_gpu = bench_module("attention_gpu")
    report = attention_gpu.main(["--smoke", "--no-model", "--dense-max-gib", "0", "--check-max-t", "0",
                                 "--out", str(tmp_path / "r.json")])
    [row] = report["rows"]
    assert not row["reference_run"] and row["errors"] is None
    assert set(row["time_s"]) == {"flash_fwd", "flash_fwd_bwd"}  # the reference only compiled
    assert set(row["temp_GiB"]) == {f"{b}_{p}" for b in ("flash", "reference") for p in ("fwd", "fwd_bwd")}
    report = attention_gpu.main(["--smoke", "--model", "--budget-s", "-1", "--out", str(tmp_path / "r.json")])
    assert report["rows"] == [] and report["skipped"] == [{"T": 256, "after_s": pytest.approx(0, abs=60)},
                                                          {"model": True}]


def test_device_check_rejects_a_length_off_the_block_grid(capsys):
    attention_gpu = bench_module("attention_gpu")
    with pytest.raises(SystemExit):
        attention_gpu.main(["--seqs", "8192", "1000"])
    assert "--seqs [1000]" in capsys.readouterr().err
