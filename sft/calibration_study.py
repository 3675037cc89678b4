"""The block-size calibration study, one resumable command (issue 20):
``python launch.py calibrate --config configs/calibration_study.yaml`` (a YAML with a `study:`
section; `launch.py calibrate` hands it here).

1. the eval split (held-out prompts of `sft.data.tool_task`) and a calibration split (held-out
   prompts of another seed, minus every eval prompt: disjoint by construction), as JSONL;
2. one model per training block size and one on the mix, each `sft.recipe.run_sft` of the study's
   recipe with `model.block_size` set (a list for the mix) under ``<runs_dir>/train_<B>``; a model
   whose HF export exists is not trained again, and an interrupted training resumes from its
   checkpoints. With `store_dir` (the repo's ``models/calibration_study``), each export is also kept
   there with the resolved recipe it was trained by (`study_model.json`), and a stored model whose
   recipe matches is used instead of training: ``runs/`` is scratch, the stored models are what lets
   the study be rerun in minutes on a fresh checkout (a recipe that differs is an error naming the key);
3. per model: the post-hoc gamma fit for every decode block size on the calibration split
   (`calibrate --fit`), the sweep (decode sizes x thresholds x {learned, gamma=0}, AR first) and a
   sweep of each fitted checkpoint at its own size (at `fitted_thresholds`); each writes its
   results.json and is skipped when that exists. With `store_dir`, a model's rows are kept beside it
   (`measured.json`, with what they depend on: the eval prompts' hash and every sweep setting) and
   reused while that key matches, so the report is rebuilt from the stored models in seconds;
4. the rows of all sweeps, labelled by trained size and calibration, go to
   `clover_jax.decoding.study_report.write_report` (``report_dir``), and each model's AR numbers
   are printed against the floor (validity 0.95, argument accuracy 0.8).

Every step is a function handed in (`Steps`), so the orchestration is tested with stand-ins.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from clover_jax.yaml_config import ConfigError, apply_overrides, from_tree, load_yaml_tree

__all__ = ["StudyConfig", "Steps", "default_steps", "is_study_config", "load_study_config", "run_study"]

FLOOR = {"validity": 0.95, "bfcl_accuracy": 0.8}


@dataclass(frozen=True)
class StudyConfig:
    recipe: str = "configs/research_tool.yaml"
    recipe_overrides: tuple[str, ...] = ()
    runs_dir: str = "runs/calibration_study"
    train_block_sizes: tuple[int, ...] = (4, 8, 16, 32)
    mix: tuple[int, ...] = (4, 8, 16, 32)  # () = no mix model
    bfcl: str = "../shared/data/bfcl/BFCL_v4_simple_python.json"
    eval_n: int = 200
    eval_seed: int = 1
    calibration_n: int = 32
    calibration_seed: int = 2
    decode_block_sizes: tuple[int, ...] = (4, 8, 16, 32, 64)
    thresholds: tuple[float, ...] = (0.8, 0.9, 0.95, 0.99)
    quality: str = "bfcl_accuracy"
    report_threshold: float = 0.9
    report_dir: str = "docs/calibration_study"
    store_dir: str | None = None  # trained models kept (with their recipe) for fresh checkouts; None = runs only
    train_only: bool = False  # step 2 only: train (and store) what is missing, measure nothing
    fitted_thresholds: tuple[float, ...] | None = None  # the fitted checkpoints' sweeps; None = `thresholds`
    calibrate: dict[str, Any] = field(default_factory=dict)  # base CalibrateConfig tree of every sweep


def is_study_config(path: str | Path) -> bool:
    return "study" in load_yaml_tree(path)


def load_study_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> StudyConfig:
    tree = apply_overrides(load_yaml_tree(path), list(overrides))
    return from_tree(StudyConfig, tree.get("study") or {}, where=f"{path}: study")


@dataclass(frozen=True)
class Steps:
    """The study's side effects: train(run_dir, block sizes) -> export dir; fit(checkpoint, out,
    calibration jsonl, sizes); sweep(checkpoint, out, eval jsonl, sizes, thresholds, calibrations)
    -> writes <out>/results.json."""

    train: Callable[[Path, tuple[int, ...]], Path]
    fit: Callable[[Path, Path, Path, tuple[int, ...]], None]
    sweep: Callable[[Path, Path, Path, tuple[int, ...], tuple[float, ...], tuple[dict, ...]], None]


def _task_options(cfg: StudyConfig) -> dict[str, Any]:
    """The resolved options of the recipe's tool_task source: the eval and calibration prompts are drawn
    from the task the models were trained on (`tool_task.TASK_OPTIONS`; its curricula are not used)."""
    from sft.config import load_sft_config
    from sft.data.converters import resolve_options

    recipe = load_sft_config(cfg.recipe, list(cfg.recipe_overrides))
    src = next((s for s in recipe.data.sources if s.format == "tool_task"), None)
    if src is None:
        raise ConfigError(f"study.recipe {cfg.recipe}: no tool_task source in data.sources (the study's task)")
    opts = resolve_options("tool_task", src.options, f"{cfg.recipe}: source {src.name!r}")
    return opts


def _splits(cfg: StudyConfig, runs: Path) -> tuple[Path, Path]:
    from sft.data.tool_task import generate_records, prompt_key, schemas_from_options, write_jsonl

    ev, cal = runs / "eval.jsonl", runs / "calibration.jsonl"
    if not (ev.is_file() and cal.is_file()):
        schemas = schemas_from_options(cfg.bfcl, _task_options(cfg))
        eval_recs = generate_records(cfg.eval_n, cfg.eval_seed, "heldout", schemas)
        seen = {prompt_key(r) for r in eval_recs}
        pool = generate_records(4 * cfg.calibration_n, cfg.calibration_seed, "heldout", schemas)
        cal_recs = [r for r in pool if prompt_key(r) not in seen][: cfg.calibration_n]
        write_jsonl(cal, cal_recs)
        write_jsonl(ev, eval_recs)
    return ev, cal


def _rows(results: Path, trained: Any, calibration: str | None = None) -> list[dict[str, Any]]:
    rows = json.loads(results.read_text())["rows"]
    return [{**r, "trained": trained, **({"calibration": calibration} if calibration else {})} for r in rows]


# what a stored model's recipe may differ in: where it wrote, how often it checkpointed or logged, where
# this machine keeps the data and caches (source paths are compared by file name)
_RECIPE_IGNORED = ("logging", "checkpoint", "export", "data_root", "staging_dir", "devices", "count_flops")


def _recipe_tree(cfg: StudyConfig, sizes: tuple[int, ...]) -> dict[str, Any]:
    """The resolved training config of the model trained at `sizes` (the recipe as `train` runs it),
    without the sections that only say where and how often it wrote."""
    from clover_jax.yaml_config import to_tree
    from sft.config import load_sft_config

    size = sizes[0] if len(sizes) == 1 else f"[{', '.join(map(str, sizes))}]"
    tree = to_tree(load_sft_config(cfg.recipe, [*cfg.recipe_overrides, f"model.block_size={size}"]))
    for src in tree["data"]["sources"]:
        src["path"] = src["path"] and Path(src["path"]).name
    return json.loads(json.dumps({k: v for k, v in tree.items() if k not in _RECIPE_IGNORED}, default=str))


def _first_difference(a: Any, b: Any, key: str = "") -> str | None:
    """The first key where the stored recipe `a` and the recipe now `b` differ. A key the stored recipe
    lacks is a config field added after that model was trained: its default keeps the old behaviour."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a):
            d = _first_difference(a.get(k), b.get(k), f"{key}.{k}" if key else k)
            if d:
                return d
        return None
    return None if a == b else f"{key}: stored {a!r}, recipe now {b!r}"


def _stored_model(stored: Path, recipe: dict[str, Any]) -> bool:
    """True when `stored` holds an export trained by `recipe`; ConfigError naming the first key where
    its recorded recipe differs (a stale model must not be measured as the recipe's)."""
    meta = stored / "study_model.json"
    if not (meta.is_file() and (stored / "config.json").is_file()):
        return False
    diff = _first_difference(json.loads(meta.read_text())["recipe"], recipe)
    if diff:
        raise ConfigError(f"{stored}: this stored model was trained by another recipe ({diff}); delete the folder "
                          f"to train it again, or set study.store_dir to another place")
    return True


def _store_model(hf: Path, stored: Path, recipe: dict[str, Any]) -> None:
    """Copies the export `hf` to `stored` with its recipe, atomically (a partial copy never looks stored)."""
    import shutil

    tmp = stored.with_name(stored.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(hf, tmp)
    (tmp / "study_model.json").write_text(json.dumps({"recipe": recipe}, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(stored, ignore_errors=True)
    tmp.rename(stored)


def _trained_model(cfg: StudyConfig, runs: Path, name: Any, sizes: tuple[int, ...], steps: Steps,
                   print_fn: Callable[[str], None]) -> Path:
    """The export of the model trained at `sizes`: the stored one when its recipe matches, else the run's
    (trained now if missing), stored when `store_dir` is set; measured from the stored copy."""
    run = runs / f"train_{name}"
    hf = run / "hf"
    stored = Path(cfg.store_dir) / str(name) if cfg.store_dir else None
    recipe = _recipe_tree(cfg, sizes) if stored else None
    if stored is not None and _stored_model(stored, recipe):
        return stored
    if not (hf / "config.json").is_file():
        print_fn(f"study: training the block {name} model ({run})")
        hf = steps.train(run, sizes)
    if stored is not None:
        _store_model(hf, stored, recipe)
        print_fn(f"study: stored the block {name} model in {stored}")
        return stored  # measured from the stored copy, as a fresh checkout will
    return hf


def _measure_key(cfg: StudyConfig, ev: Path) -> dict[str, Any]:
    """What a model's measured rows depend on besides the model: the eval prompts and every sweep
    setting (a stored `measured.json` with another key is measured again, not reused)."""
    import hashlib

    return {"eval_sha256": hashlib.sha256(ev.read_bytes()).hexdigest(), "calibration_n": cfg.calibration_n,
            "calibration_seed": cfg.calibration_seed, "decode_block_sizes": list(cfg.decode_block_sizes),
            "thresholds": list(cfg.thresholds), "fitted_thresholds": list(cfg.fitted_thresholds or cfg.thresholds),
            "calibrate": json.loads(json.dumps(cfg.calibrate, default=str))}


def _measure(cfg: StudyConfig, run: Path, hf: Path, name: Any, ev: Path, cal: Path, steps: Steps) -> list[dict]:
    """Step 3 for one model (each part skipped when its results exist under `run`): the rows of its
    sweep (AR, learned, gamma = 0) and of its fitted checkpoints' sweeps, labelled."""
    if not (run / "fit" / "fit" / "fit.json").is_file():
        steps.fit(hf, run / "fit", cal, cfg.decode_block_sizes)
    sweep = run / "sweep"
    if not (sweep / "results.json").is_file():
        steps.sweep(hf, sweep, ev, cfg.decode_block_sizes, cfg.thresholds, ({}, {"gamma": 0.0}))
    rows = _rows(sweep / "results.json", name)
    for k in cfg.decode_block_sizes:
        out = run / f"sweep_fitted_{k}"
        if not (out / "results.json").is_file():
            steps.sweep(run / "fit" / "fit" / f"block{k}", out, ev, (k,), cfg.fitted_thresholds or cfg.thresholds,
                        ({},))
        rows += [r for r in _rows(out / "results.json", name, "fitted") if r["mode"] != "ar"]
    return rows


def run_study(cfg: StudyConfig, steps: Steps, *, command: str, print_fn: Callable[[str], None] = print
              ) -> Path | None:
    """Steps 1-4 of the module docstring; returns the report's path (None with `train_only`: the
    models are trained first, e.g. over several sessions, and measured by a later run)."""
    from clover_jax.decoding.study_report import write_report

    runs = Path(cfg.runs_dir)
    runs.mkdir(parents=True, exist_ok=True)
    ev, cal = _splits(cfg, runs)
    models: list[tuple[Any, tuple[int, ...]]] = [(b, (b,)) for b in cfg.train_block_sizes]
    if cfg.mix:
        models.append(("mix", tuple(cfg.mix)))
    rows: list[dict[str, Any]] = []
    if cfg.train_only:
        for name, sizes in models:
            _trained_model(cfg, runs, name, sizes, steps, print_fn)
        print_fn(f"study: {len(models)} models trained (train_only: nothing measured)")
        return None
    key = _measure_key(cfg, ev)
    for name, sizes in models:
        run = runs / f"train_{name}"
        hf = _trained_model(cfg, runs, name, sizes, steps, print_fn)
        measured = hf / "measured.json" if cfg.store_dir else None
        if measured is not None and measured.is_file() and json.loads(measured.read_text())["key"] == key:
            rows += json.loads(measured.read_text())["rows"]  # this model's sweeps, as measured before
        else:
            mine = _measure(cfg, run, hf, name, ev, cal, steps)
            rows += mine
            if measured is not None:
                measured.write_text(json.dumps({"key": key, "rows": mine}, default=str) + "\n")
        ar = next(r for r in rows if r["trained"] == name and r["mode"] == "ar")
        verdict = all(ar[q] >= v for q, v in FLOOR.items())
        print_fn(f"study: block {name} model, AR on {ev.name}: validity {ar['validity']:.3f}, argument accuracy "
                 f"{ar['bfcl_accuracy']:.3f} (floor {FLOOR['validity']} / {FLOOR['bfcl_accuracy']}: "
                 f"{'met' if verdict else 'NOT met'})")
    (runs / "rows.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    md = write_report(Path(cfg.report_dir), rows, quality=cfg.quality, threshold=cfg.report_threshold, command=command)
    print_fn(f"study: wrote {md}")
    return md


def default_steps(cfg: StudyConfig) -> Steps:
    """The real steps: `run_sft` of the recipe, `calibrate_fit.run_fit`, `calibrate.run_calibrate`."""
    from clover_jax.decoding.calibrate import CalibOverride, CalibrateConfig, run_calibrate
    from clover_jax.decoding.calibrate_fit import run_fit
    from sft.config import load_sft_config
    from sft.recipe import run_sft

    def base(checkpoint: Path, out: Path, extra: dict[str, Any]) -> CalibrateConfig:
        tree = {**cfg.calibrate, "checkpoint": str(checkpoint), "out_dir": str(out), **extra}
        return from_tree(CalibrateConfig, tree, where="study.calibrate")

    def train(run: Path, sizes: tuple[int, ...]) -> Path:
        size = sizes[0] if len(sizes) == 1 else f"[{', '.join(map(str, sizes))}]"
        res = run_sft(load_sft_config(cfg.recipe, [*cfg.recipe_overrides, f"model.block_size={size}",
                                                   f"logging.run_dir={run}", f"export.dir={run / 'hf'}"]))
        if res.export_dir is None:
            raise RuntimeError(f"study: training {run} stopped at step {res.step} without an export (preempted?)")
        return Path(res.export_dir)

    def fit(hf: Path, out: Path, cal_path: Path, sizes: tuple[int, ...]) -> None:
        c = base(hf, out, {})
        run_fit(dataclasses.replace(c, fit=dataclasses.replace(
            c.fit, calibration={"source": "jsonl", "path": str(cal_path), "n": cfg.calibration_n}, block_sizes=sizes)))

    def sweep(hf: Path, out: Path, ev: Path, sizes, thresholds, cals) -> None:
        c = base(hf, out, {"eval": {"source": "jsonl", "path": str(ev), "n": cfg.eval_n}})
        run_calibrate(dataclasses.replace(c, sweep=dataclasses.replace(
            c.sweep, modes=("threshold",), block_sizes=tuple(sizes), thresholds=tuple(thresholds),
            calibration=tuple(from_tree(CalibOverride, x, where="study calibration") for x in cals))))

    return Steps(train=train, fit=fit, sweep=sweep)
