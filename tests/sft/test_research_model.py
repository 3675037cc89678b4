"""The research model of issue 20 meets its floor: the export of configs/research_tool.yaml as it stands
(its default block sizes: the study's mix) that the study keeps in models/calibration_study/
(the study model whose recipe is the recipe's own: mix; with the recipe that trained it), decoded AR on
the study's held-out eval split (200 prompts of sft.data.tool_task, user turns disjoint from training)
by `launch.py calibrate`'s own code: tool-call validity >= 0.95 and argument accuracy >= 0.8 (the
numbers the study prints). The stored model must be the recipe's: a recipe edited without retraining
fails here, as it fails the study."""

import json
from pathlib import Path

from clover_jax.decoding.calibrate import CalibrateConfig, EvalSetConfig, SweepConfig, run_calibrate
from clover_jax.yaml_config import from_tree
from sft.calibration_study import FLOOR, _recipe_tree, _splits, _stored_model, load_study_config, study_models

ROOT = Path(__file__).resolve().parents[2]
BFCL = ROOT.parent / "shared" / "data" / "bfcl" / "BFCL_v4_simple_python.json"


def test_the_stored_research_model_meets_the_floor(tmp_path):
    import dataclasses

    study = load_study_config(ROOT / "configs" / "calibration_study.yaml")
    study = dataclasses.replace(study, recipe=str(ROOT / study.recipe), bfcl=str(BFCL),
                                store_dir=str(ROOT / study.store_dir))
    own = _recipe_tree(study, ())
    [model] = [m for m in study_models(study) if m.seed == 0 and _recipe_tree(study, m.overrides({})) == own]
    assert model.name == "mix"  # the recipe's default block sizes are the study's mix
    stored = Path(study.store_dir) / model.dirname
    assert _stored_model(stored, own), f"{stored}: no stored research model"
    ev, _ = _splits(study, tmp_path)
    base = from_tree(CalibrateConfig, dict(study.calibrate), where="study.calibrate")
    cfg = dataclasses.replace(base, checkpoint=str(stored), out_dir=str(tmp_path / "ar"), plots=False,
                              eval=EvalSetConfig(source="jsonl", path=str(ev), n=study.eval_n),
                              sweep=dataclasses.replace(base.sweep, modes=("ar",)),
                              loss=dataclasses.replace(base.loss, enabled=False))
    assert isinstance(cfg.sweep, SweepConfig) and run_calibrate(cfg) == 0
    ar = json.loads((tmp_path / "ar" / "results.json").read_text())["rows"][0]
    assert ar["mode"] == "ar" and ar["n"] == study.eval_n == 200
    assert all(ar[k] >= v for k, v in FLOOR.items()), {k: ar[k] for k in FLOOR}
