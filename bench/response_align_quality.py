"""Response block alignment (`data.align_responses: block`) against today's layout, on the research
recipe at block 32: the recipe trained with every assistant response starting on the block grid (the
decoder pads prompts the same way, from the export's `response_block_align`), beside the
calibration study's stored block-32 model (the same recipe, responses starting where the prompt
ends), both decoded on the study's 200 held-out prompts (bench/recipe_quality.py): AR, block 32 at
thresholds 0.9 / 0.95, masked CE.

    python bench/response_align_quality.py --out bench/results/response_align_quality.json

~30 min of training plus ~10 min per evaluation on 2 cores; resumable (a finished export or
evaluation under --runs is reused).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.recipe_quality import BFCL, EVAL_N, RECIPE, STUDY_MODEL, eval_set, evaluate, print_table, rows, train  # noqa: E402

ALIGNED = ["model.block_size=32", "data.align_responses=block"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="runs/align_study")
    p.add_argument("--model", default=STUDY_MODEL, help="today's layout: the stored block-32 study model")
    p.add_argument("--steps", type=int, default=None, help="train.steps (default: the recipe's)")
    p.add_argument("--bfcl", default=BFCL)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    runs = Path(a.runs)
    ev = eval_set(runs, a.bfcl)
    print("== aligned responses: train (if missing), then decode", flush=True)
    aligned = train(runs / "aligned", ALIGNED, a.steps)
    align = json.loads((aligned / "config.json").read_text()).get("response_block_align")
    if not align:
        raise RuntimeError(f"{aligned}/config.json does not record response_block_align: the decoder would not pad")
    table = rows(evaluate(ROOT / a.model, runs / "today" / "calibrate", ev), layout="prompt end")
    table += rows(evaluate(aligned, runs / "aligned" / "calibrate", ev), layout=f"block grid ({align})")
    print_table(table, ("layout",))
    if a.out:
        Path(a.out).write_text(json.dumps({"recipe": RECIPE, "today": a.model, "aligned": ALIGNED, "eval_n": EVAL_N,
                                           "rows": table, "wall_s": time.perf_counter() - t0}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
