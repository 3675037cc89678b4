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

RECIPE = "configs/research_tool.yaml"
VARIANTS = {  # recipe overrides of --part trained
    "e64": ["model.num_experts=64", "model.num_experts_per_tok=8", "model.moe_intermediate_size=12",
            "model.block_size=32"],
    "e8": ["model.block_size=32"],  # the study's block-32 model itself (its `off` is models/calibration_study/32)
}
EVAL_N, EVAL_SEED = 200, 1  # configs/calibration_study.yaml: study.eval_n, study.eval_seed
THRESHOLDS = (0.9, 0.95)


def _eval_set(runs: Path, bfcl: str) -> Path:
    """The calibration study's held-out eval prompts (sft.calibration_study._splits' eval half)."""
    from sft.config import load_sft_config
    from sft.data.converters import resolve_options
    from sft.data.tool_task import generate_records, schemas_from_options, write_jsonl

    path = runs / "eval.jsonl"
    if not path.is_file():
        recipe = load_sft_config(ROOT / RECIPE)
        src = next(s for s in recipe.data.sources if s.format == "tool_task")
        schemas = schemas_from_options(bfcl, resolve_options("tool_task", src.options, RECIPE))
        runs.mkdir(parents=True, exist_ok=True)
        write_jsonl(path, generate_records(EVAL_N, EVAL_SEED, "heldout", schemas))
    return path


def _train(run: Path, coreset: int | None, steps: int | None, variant: list[str]) -> Path:
    from sft.config import load_sft_config
    from sft.recipe import run_sft

    hf = run / "hf"
    if (hf / "config.json").is_file():
        return hf
    over = [*variant, f"logging.run_dir={run}", f"export.dir={hf}"]
    over += [f"model.moe_block_coreset={coreset}"] if coreset else []
    over += [f"train.steps={steps}"] if steps else []
    res = run_sft(load_sft_config(ROOT / RECIPE, over))
    if res.export_dir is None:
        raise RuntimeError(f"{run}: training stopped at step {res.step} without an export")
    return Path(res.export_dir)


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


def _evaluate(hf: Path, out: Path, ev: Path, coreset_rule: str = "per_step") -> dict:
    from clover_jax.decoding.calibrate import CalibrateConfig, run_calibrate
    from clover_jax.yaml_config import from_tree

    if not (out / "results.json").is_file():
        tree = {"checkpoint": str(hf), "out_dir": str(out), "plots": False,
                "eval": {"source": "jsonl", "path": str(ev), "n": EVAL_N},
                "decode": {"max_new_tokens": 96, "batch_bucket": 8, "fast_compile": False, "coreset": coreset_rule},
                "sweep": {"modes": ["threshold"], "block_sizes": [32], "thresholds": list(THRESHOLDS),
                          "sub_block_sizes": [0], "calibration": [{}], "batch_size": 50,
                          "quality_metric": "bfcl_accuracy"},
                "loss": {"enabled": True, "block_sizes": [32], "t_values": [0.25, 0.5, 0.75], "n": 32}}
        run_calibrate(from_tree(CalibrateConfig, tree, where="coreset_quality"))
    return json.loads((out / "results.json").read_text())


def _rows(res: dict, name: str, rule: str) -> list[dict]:
    loss = {f"masked_ce_t{r['t']}": r["loss"] for r in res.get("loss", [])}
    return [{"coreset": name, "rule": rule if r["mode"] != "ar" else "-", "mode": r["mode"],
             "threshold": r["threshold"] if r["mode"] != "ar" else None, "validity": r["validity"],
             "bfcl_accuracy": r["bfcl_accuracy"], "tokens_per_forward": r["tokens_per_forward"], **loss}
            for r in res["rows"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("imposed", "trained"), default="imposed")
    p.add_argument("--runs", default="runs/coreset_study")
    p.add_argument("--model", default="models/calibration_study/32", help="--part imposed: the stored model")
    p.add_argument("--coresets", default=None, help="default: off,4,2 (imposed) / off,16,32 (trained)")
    p.add_argument("--steps", type=int, default=None, help="--part trained: train.steps (default: the recipe's)")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="e64",
                   help="--part trained: e64 (64 experts, top 8) or e8 (the research model's 8 experts, top 2)")
    p.add_argument("--bfcl", default=str(ROOT.parent / "shared/data/bfcl/BFCL_v4_simple_python.json"))
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    runs = Path(a.runs)
    ev = _eval_set(runs, a.bfcl)
    names = (a.coresets or ("off,4,2" if a.part == "imposed" else "off,16,32")).split(",")
    table = []
    for name in names:
        c = None if name == "off" else int(name)
        if a.part == "imposed":
            hf = _with_coreset(ROOT / a.model, runs / "imposed" / name / "hf", c)
        else:
            print(f"== coreset {name}: train (if missing), then decode", flush=True)
            hf = _train(runs / a.variant / name, c, a.steps, VARIANTS[a.variant])
        for rule in (("per_step",) if c is None else ("per_step", "first_step")):
            out = hf.parent / f"calibrate_{rule}"
            table += [r for r in _rows(_evaluate(hf, out, ev, rule), name, rule)
                      if rule == "per_step" or r["mode"] != "ar"]
    print("\n| coreset C | rule | decoding | validity | argument accuracy | tokens per forward | masked CE t=0.25 / 0.5 / 0.75 |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        how = "AR" if r["mode"] == "ar" else f"block 32, threshold {r['threshold']}"
        ce = " / ".join(f"{r[k]:.3f}" for k in r if k.startswith("masked_ce"))
        print(f"| {r['coreset']} | {r['rule']} | {how} | {r['validity']:.3f} | {r['bfcl_accuracy']:.3f} | "
              f"{r['tokens_per_forward']:.2f} | {ce} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"part": a.part, "model": a.model if a.part == "imposed" else VARIANTS[a.variant],
                                           "recipe": RECIPE, "eval_n": EVAL_N, "rows": table,
                                           "wall_s": time.perf_counter() - t0}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
