"""bench/gdn_device.py, the prepared device check of the Pallas GDN kernels, in its --smoke mode.

The script is meant to run once, unattended, on a lent GPU/TPU machine with minutes of budget; this
runs the same code on CPU (kernels in interpret mode, tiny shapes) so that it cannot rot unnoticed.
The oracle is the script's own comparison against ``backend="reference"``: the interpret-mode
kernels must agree with it to fp32 round-off: every error (max |kernel - reference| / max |reference|)
at most FP32_REL = 1e-5 (tests/model/parity_utils.py; measured at most 1.3e-6).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.model.parity_utils import FP32_REL

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.bench.bench_import import bench_module  # noqa: E402


def test_device_check_smoke_runs_both_ops_and_matches_the_reference(tmp_path):
    gdn_device = bench_module("gdn_device")
    out = tmp_path / "gdn_device.json"
    report = gdn_device.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert [(r["T"], r["op"]) for r in report["rows"]] == [(256, "causal"), (256, "block")]
    assert not report["skipped"]
    causal, block = report["rows"]
    assert set(causal["errors"]) == {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "ds0"}
    assert set(block["errors"]) >= {"o_clean", "o_noisy", "dqn", "dkn", "dvn", "dscalars"}
    for r in report["rows"]:
        for name, err in r["errors"].items():
            assert err <= FP32_REL, (r["op"], name, err)
        assert set(r["time_s"]) == {f"{b}_{p}" for b in ("pallas", "reference") for p in ("fwd", "fwd_bwd")}
        assert all(t > 0 for t in r["time_s"].values())


def test_device_check_budget_skips_and_says_so(tmp_path):
    gdn_device = bench_module("gdn_device")
    report = gdn_device.main(["--smoke", "--budget-s", "-1", "--out", str(tmp_path / "r.json")])
    assert report["rows"] == []
    assert [(s["T"], s["op"]) for s in report["skipped"]] == [(256, "causal"), (256, "block")]


def test_device_check_rejects_a_length_block_mode_cannot_take(capsys):
    gdn_device = bench_module("gdn_device")
    with pytest.raises(SystemExit):
        gdn_device.main(["--seqs", "8192", "1000"])
    assert "--seqs [1000]" in capsys.readouterr().err


def test_device_check_launch_sweep_and_bf16_check(tmp_path):
    """--tune-seq times the six phase kernels under launch variants (interpreted here) and leaves the
    launch table as it found it; a variant whose value tile does not divide dv is not tried.
    --check-dtype bfloat16 checks the errors on the bf16 programs, against the kernels' bf16 bound;
    --fp32-fit compiles the fp32 kernel programs and says whether they fit."""
    gdn_device = bench_module("gdn_device")
    from pallas_kernels.gdn import gpu_calls as g
    before = dict(g.LAUNCH)
    report = gdn_device.main(["--smoke", "--ops", "causal", "--tune-seq", "256", "--tune-budget-s", "1",
                              "--check-dtype", "bfloat16", "--time-dtype", "bfloat16", "--no-phase-times",
                              "--fp32-fit", "--out", str(tmp_path / "r.json")])
    assert g.LAUNCH == before
    # the bf16 error check (what a device whose fp32 programs do not fit reports): the kernels' bf16 bound
    (row,) = report["rows"]
    assert report["meta"]["check_dtype"] == "bfloat16" and "gpu_kernel_time_s" not in row
    assert set(row["errors"]) == {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "ds0"}
    assert all(0 < err <= 4 * 2.0 ** -8 for err in row["errors"].values()), row["errors"]
    rows = report["tune"]["rows"]
    assert rows and report["tune"]["T"] == 256
    for row in rows:
        assert set(row["time_s"]) == {"intra", "wy", "sweep", "output", "state_bwd", "parallel_bwd"}
        assert row["total_s"] == pytest.approx(sum(row["time_s"].values()))
        assert 32 % row["launch"]["block_v"] == 0
    # --fp32-fit: the fp32 kernel programs compiled (here they fit: the interpreter has no shared memory)
    assert [(r["T"], r["op"], r["pass"], r["fits"]) for r in report["fp32_fit"]] == [
        (256, "causal", "fwd", True), (256, "causal", "fwd_bwd", True)]
