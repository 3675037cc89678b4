"""Saved compile plans against the current analytic step count: each plan JSON's compiled FLOPs
(`launch.py compile --json`, the optimized HLO walked per chip) over `sft.step_flops` recomputed
for its shape, without recompiling (a 35B plan takes 10-30 minutes on 2 cores).

The plans hold no model config: each is recounted for the Qwen3.6-35B-A3B architecture (what
configs/agent_mix.yaml compiles when `model.init_from` is not on the host), checked by the plan's
parameter count; a plan of another architecture is refused, naming its file. The count now is the
one `launch.py compile` prints today (the attention kernels' recomputed scores, the GDN phase
kernels' own backward on 128 lanes); the saved programs ran the GDN kernels of their day (the
fused block kernel), a few percent of the step at 35B (the ``gdn_share`` column).

    python bench/plan_recount.py bench/results/compile_agent_mix_*_splash*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clover_jax.config import ModelConfig, param_count  # noqa: E402
from sft.step_flops import sft_step_flops  # noqa: E402
from train.aot import parse_topology  # noqa: E402


def recount(plan: dict, where: str, cfg: ModelConfig, block_size: int = 32) -> dict:
    """One plan's compiled FLOPs (all chips) over the analytic count it recorded and over today's.
    Raises ValueError when the plan is not of this architecture (by its parameter count)."""
    if plan.get("params") != param_count(cfg):
        raise ValueError(f"{where}: {plan.get('params')} parameters, not the 35B architecture's "
                         f"{param_count(cfg)}: another model, not recounted")
    rows, t = plan["micro_batch"] * plan["micro_batches"], plan["seq_len"]
    compiled = plan["flops_per_chip"] * parse_topology(plan["topology"]).chips
    now = sft_step_flops(cfg, rows=rows, seq_len=t, block_size=block_size, gdn_lanes=128, flash_backward=True)
    gdn = (2 + (now.recompute > 0)) * now.gdn + now.gdn_executed_extra
    return {"file": where, "topology": plan["topology"], "seq_len": t, "rows": rows, "compiled_flops": compiled,
            "analytic_recorded": plan["analytic_flops"], "analytic_now": now.executed,
            "ratio_recorded": compiled / plan["analytic_flops"], "ratio_now": compiled / now.executed,
            "attention_recompute_share": now.attention_recompute / now.executed, "gdn_share": gdn / now.executed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plans", nargs="+", help="plan JSON files written by launch.py compile --json")
    args = ap.parse_args(argv)
    cfg = ModelConfig()
    print(f"{'plan':52s} {'seq':>6s} {'rows':>5s} {'ratio then':>10s} {'ratio now':>10s} {'attn recompute':>14s} "
          f"{'gdn share':>9s}")
    for path in args.plans:
        for i, plan in enumerate(json.loads(Path(path).read_text())):
            r = recount(plan, f"{path}[{i}]", cfg)
            print(f"{Path(path).name:52s} {r['seq_len']:6d} {r['rows']:5d} {r['ratio_recorded']:10.3f} "
                  f"{r['ratio_now']:10.3f} {r['attention_recompute_share']:14.1%} {r['gdn_share']:9.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
