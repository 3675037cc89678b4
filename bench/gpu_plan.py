"""A TPU-compiled SFT step plan read at a GPU's roofline and memory: the one-host GPU plan without a
GPU compiler (`launch.py compile` compiles for TPU slices only, through libtpu's compile-only devices).

    python launch.py compile --config configs/agent_mix_lora.yaml --topology v5p-16 train.micro_batches=8 --json P.json
    python bench/gpu_plan.py P.json --chip h100 --out bench/results/gpu_plan_agent_mix_lora_8xh100_seq8192.json

Input: plans written by `launch.py compile --json`, compiled for a TPU slice with as many chips as the
GPU host has devices and under the mesh the GPU run uses (v5p-16 = 8 chips, fsdp 8, for an 8-GPU
host). Output, per plan: the program's per-chip memory against the GPU's memory, and
`train.roofline` of the program's per-chip FLOPs, HBM bytes and collective bytes at the GPU's peaks.

What it can tell: whether the train state fits (the argument bytes are the same shapes and shardings
on any backend) with the step's buffers, as XLA sized them for TPU; and a lower bound on the step
time from the work the program does. What it cannot: XLA's GPU compiler fuses, schedules and assigns
buffers differently (the temporaries are the TPU program's), the kernels differ (Triton GDN and
flash attention instead of Mosaic GDN and splash, `ragged_dot` instead of megablox gmm / tgmm), and
collectives run over NVLink with NCCL instead of the ICI torus. Every number is a prediction.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train import roofline as roofline_lib  # noqa: E402

GiB = 1024**3
MiB = 1024**2

#: Device memory CUDA reports (`nvidia-smi`, total): H100 SXM5 80 GB 81559 MiB, H200 SXM 143771 MiB.
GPU_MEMORY_BYTES = {"h100": 81559 * MiB, "h200": 143771 * MiB}
#: The share of it a plan may use: JAX preallocates 75% by default; these plans assume the run sets
#: XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (as bench/gpu_check.py does), the rest is CUDA's and NCCL's.
MEM_FRACTION = 0.95


def gpu_plan(plan: dict, chip: str, where: str) -> dict:
    """One TPU plan (a `MemoryPlan.as_dict()`) at `chip`'s roofline and usable memory (`MEM_FRACTION`
    of its total; `fits`: the program's total per chip within it). Raises ValueError
    naming `where` when the plan was not compiled (XLA refused it: no cost to read)."""
    if chip not in GPU_MEMORY_BYTES:
        raise ValueError(f"--chip {chip!r}: known GPUs {', '.join(GPU_MEMORY_BYTES)}")
    if not plan.get("compiled") or not plan.get("hlo_cost"):
        raise ValueError(f"{where}: the plan was not compiled (XLA refused it), so it has no cost to read")
    cost, mem = plan["hlo_cost"], MEM_FRACTION * GPU_MEMORY_BYTES[chip]
    r = roofline_lib.roofline(chip, flops=plan["flops_per_chip"], hbm_bytes=cost["hbm_bytes"],
                              ici_bytes=sum(cost["ici_bytes"].values()), chips=plan["chips"],
                              tokens_per_step=plan["tokens_per_step"], model_flops=plan["model_flops"])
    return {"source": where, "gpu": r.chip.name, "devices": plan["chips"],
            "tpu_program": f"{plan['topology']} ({plan['chips']} chips)", "mesh": plan["mesh"],
            "micro_batches": plan["micro_batches"], "micro_batch": plan["micro_batch"], "seq_len": plan["seq_len"],
            "usable_bytes_per_device": mem, "argument_bytes": plan["argument_bytes"],
            "temp_bytes": plan["temp_bytes"], "total_bytes": plan["total_bytes"],
            "fits": plan["total_bytes"] <= mem, "state_fits": plan["argument_bytes"] <= mem,
            "flops_per_device": plan["flops_per_chip"], "model_flops": plan["model_flops"],
            "tokens_per_step": plan["tokens_per_step"], "roofline": r.as_dict()}


def describe(row: dict) -> str:
    r = row["roofline"]
    return (f"{row['devices']} x {row['gpu']} (the {row['tpu_program']} TPU program, "
            f"{row['micro_batches']} x {row['micro_batch']} rows x {row['seq_len']}): "
            f"{row['total_bytes'] / GiB:.1f} GiB/device of {row['usable_bytes_per_device'] / GiB:.1f} usable "
            f"({'fits' if row['fits'] else 'DOES NOT FIT'}; state {row['argument_bytes'] / GiB:.1f} GiB); roofline "
            f"compute {r['compute_s']:.2f} s | HBM {r['hbm_s']:.2f} s | interconnect {r['ici_s']:.2f} s -> step >= "
            f"{r['step_s']:.2f} s ({r['bound']}), {r['tokens_per_s']:,.0f} tokens/s, MFU <= {100 * r['mfu']:.1f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plans", nargs="+", help="plan JSON files written by launch.py compile --json")
    ap.add_argument("--chip", default="h100", choices=sorted(GPU_MEMORY_BYTES))
    ap.add_argument("--out", type=Path, default=None, help="write {meta, rows} as JSON")
    args = ap.parse_args(argv)
    rows = []
    for path in args.plans:
        for i, plan in enumerate(json.loads(Path(path).read_text())):
            rows.append(gpu_plan(plan, args.chip, f"{Path(path).name}[{i}]"))
            print(describe(rows[-1]))
    if args.out:
        meta = {"device": f"{rows[0]['devices']} x {rows[0]['gpu']} (roofline of a TPU-compiled program)",
                "date": datetime.date.today().isoformat(),
                "note": "prediction: a TPU program's memory and cost at the GPU's memory and peaks (module docstring)"}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
