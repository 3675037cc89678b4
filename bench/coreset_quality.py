"""Decode quality with the block coreset (issue 44), on the calibration study's 200 held-out prompts
(same generator, split and seed), at block 32, thresholds 0.9 / 0.95, beside AR decoding.

Two parts:

* `--part imposed` (~20 min on 2 cores): the study's stored block-32 model (trained with free
  routing; 8 experts, top 2) decoded with a coreset of C = 4 and 2 (= top-k, the tightest) set in a
  copy of its config.json, per-step and first-step coresets (`decode.coreset`): what a coreset costs a
  model that never trained with one, and which of the two decoding rules costs less.
* `--part trained --variant e64` (hours on 2 cores: 0.16 steps/s measured with other jobs beside
  it): the recipe trained with the coreset off and at C = 16 and 32. The research model's 8 experts
  make 16 / 32 no restriction, so this variant has 64 fine-grained experts, top 8, intermediate 12
  (the same active expert FLOPs per token as 8 x 48 top 2): C = 16 / 32 keep a quarter / a half of
  the experts per block (Clover: 256, top 8). `--variant e8 --coresets 4`: the research model
  itself trained with C = 4 of its 8 experts (its free twin is the study's stored model).
  Resumable: a trained export under `--runs` is reused, a finished evaluation too.

    python bench/coreset_quality.py --part imposed --out bench/results/coreset_quality_imposed.json
    python bench/coreset_quality.py --part trained --out bench/results/coreset_quality.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.recipe_quality import BFCL, EVAL_N, RECIPE, STUDY_MODEL, evaluate, eval_set, print_table, rows, train  # noqa: E402

VARIANTS = {  # recipe overrides of --part trained
    "e64": ["model.num_experts=64", "model.num_experts_per_tok=8", "model.moe_intermediate_size=12",
            "model.block_size=32"],
    "e8": ["model.block_size=32"],  # the study's block-32 model itself (its `off` is models/calibration_study/32)
}


def _with_coreset(src: Path, dst: Path, c: int | None) -> Path:
    """A copy of the HF dir `src` whose config.json sets `moe_block_coreset` to `c` (weights linked)."""
    if not (dst / "config.json").is_file():
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != "config.json" and f.is_file() and not (dst / f.name).exists():
                (dst / f.name).symlink_to(f.resolve())
        cfg = json.loads((src / "config.json").read_text())
        cfg["moe_block_coreset"] = c
        (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("imposed", "trained"), default="imposed")
    p.add_argument("--runs", default="runs/coreset_study")
    p.add_argument("--model", default=STUDY_MODEL, help="--part imposed: the stored model")
    p.add_argument("--coresets", default=None, help="default: off,4,2 (imposed) / off,16,32 (trained)")
    p.add_argument("--steps", type=int, default=None, help="--part trained: train.steps (default: the recipe's)")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="e64",
                   help="--part trained: e64 (64 experts, top 8) or e8 (the research model's 8 experts, top 2)")
    p.add_argument("--bfcl", default=BFCL)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    runs = Path(a.runs)
    ev = eval_set(runs, a.bfcl)
    names = (a.coresets or ("off,4,2" if a.part == "imposed" else "off,16,32")).split(",")
    table = []
    for name in names:
        c = None if name == "off" else int(name)
        if a.part == "imposed":
            hf = _with_coreset(ROOT / a.model, runs / "imposed" / name / "hf", c)
        else:
            print(f"== coreset {name}: train (if missing), then decode", flush=True)
            hf = train(runs / a.variant / name, [*VARIANTS[a.variant], *([f"model.moe_block_coreset={c}"] if c else [])],
                       a.steps)
        for rule in (("per_step",) if c is None else ("per_step", "first_step")):
            out = hf.parent / f"calibrate_{rule}"
            table += [{**r, "rule": rule if r["mode"] != "ar" else "-"}
                      for r in rows(evaluate(hf, out, ev, rule), coreset=name) if rule == "per_step" or r["mode"] != "ar"]
    print_table(table, ("coreset", "rule"))
    if a.out:
        Path(a.out).write_text(json.dumps({"part": a.part, "model": a.model if a.part == "imposed" else VARIANTS[a.variant],
                                           "recipe": RECIPE, "eval_n": EVAL_N, "rows": table,
                                           "wall_s": time.perf_counter() - t0}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
