"""bench/plan_recount.py on the saved 35B plans: today's count adds the attention kernels' recomputed
scores, which the recorded one lacked, so every ratio falls; that term's share grows with the row
length (the attention is quadratic in it); a plan of another architecture is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clover_jax.config import ModelConfig
from tests.bench.bench_import import bench_module

PLANS = sorted((Path(__file__).resolve().parents[2] / "bench" / "results").glob("compile_agent_mix_*splash*.json"))


def test_recount_of_the_saved_plans():
    mod = bench_module("plan_recount")
    rows = [mod.recount(p, str(f), ModelConfig()) for f in PLANS for p in json.loads(f.read_text())]
    assert len(rows) >= 4
    for r in rows:
        assert r["analytic_now"] > r["analytic_recorded"] and r["ratio_now"] < r["ratio_recorded"], r
    by_len = sorted((r["seq_len"], r["attention_recompute_share"]) for r in rows if r["topology"] == "v5p-128")
    assert [s for _, s in by_len] == sorted(s for _, s in by_len) and by_len[0][0] < by_len[-1][0]
    plan = json.loads(PLANS[0].read_text())[0]
    with pytest.raises(ValueError, match="not recounted"):
        mod.recount({**plan, "params": plan["params"] + 1}, "x.json[0]", ModelConfig())
