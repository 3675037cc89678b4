"""Decode quality of research-recipe variants, on the calibration study's 200 held-out prompts (same
generator, split and seed) at block 32, thresholds 0.9 / 0.95, beside AR decoding: the shared steps of
bench/coreset_quality.py and bench/response_align_quality.py (train a variant, decode the held-out
prompts with `launch.py calibrate`'s sweep, tabulate)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "configs/research_tool.yaml"
STUDY_MODEL = "models/calibration_study/32"  # the study's block-32 model: the recipe at block 32, as is
EVAL_N, EVAL_SEED = 200, 1  # configs/calibration_study.yaml: study.eval_n, study.eval_seed
THRESHOLDS = (0.9, 0.95)
BFCL = str(ROOT.parent / "shared/data/bfcl/BFCL_v4_simple_python.json")


def eval_set(runs: Path, bfcl: str = BFCL) -> Path:
    """The calibration study's held-out eval prompts (sft.calibration_study's eval half), as JSONL."""
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


def train(run: Path, overrides: Sequence[str], steps: int | None = None) -> Path:
    """The research recipe with `overrides`, trained into `run` and exported to `run/hf` (reused when
    that export exists: resumable)."""
    from sft.config import load_sft_config
    from sft.recipe import run_sft

    hf = run / "hf"
    if (hf / "config.json").is_file():
        return hf
    over = [*overrides, f"logging.run_dir={run}", f"export.dir={hf}"]
    over += [f"train.steps={steps}"] if steps else []
    res = run_sft(load_sft_config(ROOT / RECIPE, over))
    if res.export_dir is None:
        raise RuntimeError(f"{run}: training stopped at step {res.step} without an export")
    return Path(res.export_dir)


def evaluate(hf: Path, out: Path, ev: Path, coreset_rule: str = "per_step") -> dict:
    """`launch.py calibrate` of `hf` on the eval set: AR, block 32 at THRESHOLDS, and the masked CE at
    t = 0.25 / 0.5 / 0.75; results.json under `out` (reused when present)."""
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
        run_calibrate(from_tree(CalibrateConfig, tree, where="recipe_quality"))
    return json.loads((out / "results.json").read_text())


def rows(res: dict, **labels: str) -> list[dict]:
    """One table row per decoding setting of `res` (an `evaluate` result), with `labels` in front."""
    loss = {f"masked_ce_t{r['t']}": r["loss"] for r in res.get("loss", [])}
    return [{**labels, "mode": r["mode"], "threshold": r["threshold"] if r["mode"] != "ar" else None,
             "validity": r["validity"], "bfcl_accuracy": r["bfcl_accuracy"],
             "tokens_per_forward": r["tokens_per_forward"], **loss}
            for r in res["rows"]]


def print_table(table: list[dict], labels: Sequence[str]) -> None:
    """The rows as a markdown table: `labels` columns, then decoding, quality, speed and masked CE."""
    print("\n| " + " | ".join(labels) + " | decoding | validity | argument accuracy | tokens per forward | "
          "masked CE t=0.25 / 0.5 / 0.75 |")
    print("|" + "---|" * (len(labels) + 5))
    for r in table:
        how = "AR" if r["mode"] == "ar" else f"block 32, threshold {r['threshold']}"
        ce = " / ".join(f"{r[k]:.3f}" for k in r if k.startswith("masked_ce"))
        print("| " + " | ".join(str(r[k]) for k in labels) + f" | {how} | {r['validity']:.3f} | "
              f"{r['bfcl_accuracy']:.3f} | {r['tokens_per_forward']:.2f} | {ce} |")
