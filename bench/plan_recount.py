"""Saved compile plans against the current analytic step count: each plan JSON's compiled FLOPs
(`launch.py compile --json`, the optimized HLO walked per chip) over `sft.step_flops` recomputed
for its shape, without recompiling (a 35B plan takes 10-30 minutes on 2 cores).

The plans hold no model config: each is recounted for the Qwen3.6-35B-A3B architecture (what
configs/agent_mix.yaml compiles when `model.init_from` is not on the host), and the recount is
checked first by reproducing the analytic count the plan recorded (without the attention
kernels' recomputed scores, the term added after those plans were written); a plan of another
architecture is refused, naming its file.

    python bench/plan_recount.py bench/results/compile_agent_mix_*_splash*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clover_jax.config import ModelConfig  # noqa: E402
from sft.step_flops import sft_step_flops  # noqa: E402
from train.aot import parse_topology  # noqa: E402


def recount(plan: dict, where: str, cfg: ModelConfig, block_size: int = 32) -> dict:
    """One plan's compiled FLOPs (all chips) over the analytic count before and after the flash
    backward term. Raises ValueError when the recorded count is not this architecture's."""
    rows, t = plan["micro_batch"] * plan["micro_batches"], plan["seq_len"]
    chips = parse_topology(plan["topology"]).chips
    compiled = plan["flops_per_chip"] * chips
    before = sft_step_flops(cfg, rows=rows, seq_len=t, block_size=block_size)
    if abs(before.executed / plan["analytic_flops"] - 1) > 1e-9:
        raise ValueError(f"{where}: recorded analytic count {plan['analytic_flops']:.4e} is not the 35B "
                         f"architecture's {before.executed:.4e} at {rows} x {t}: another model, not recounted")
    after = sft_step_flops(cfg, rows=rows, seq_len=t, block_size=block_size, flash_backward=True)
    return {"file": where, "topology": plan["topology"], "seq_len": t, "rows": rows,
            "compiled_flops": compiled, "analytic_before": before.executed, "analytic_after": after.executed,
            "ratio_before": compiled / before.executed, "ratio_after": compiled / after.executed,
            "attention_recompute_share": after.attention_recompute / after.executed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plans", nargs="+", help="plan JSON files written by launch.py compile --json")
    args = ap.parse_args(argv)
    cfg = ModelConfig()
    print(f"{'plan':58s} {'seq':>6s} {'rows':>5s} {'ratio before':>12s} {'ratio now':>10s} {'attn recompute':>14s}")
    for path in args.plans:
        for i, plan in enumerate(json.loads(Path(path).read_text())):
            r = recount(plan, f"{path}[{i}]", cfg)
            print(f"{Path(path).name:58s} {r['seq_len']:6d} {r['rows']:5d} {r['ratio_before']:12.3f} "
                  f"{r['ratio_after']:10.3f} {r['attention_recompute_share']:13.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
