"""The block-size calibration study, one resumable command (issue 20):
``python launch.py calibrate --config configs/calibration_study.yaml`` (a YAML with a `study:`
section; `launch.py calibrate` hands it here).

1. the eval split (held-out prompts of `sft.data.tool_task`) and a calibration split (held-out
   prompts of another seed, minus every eval prompt: disjoint by construction), as JSONL;
2. one model per training block size, one on the mix and one on the block-size curriculum
   (`curriculum`: `model.block_size_schedule`), the block-coreset variants (`coreset`: each of
   `coreset_models` also trained with `model.moe_block_coreset` = C, named ``<model>_c<C>``; the
   exported config carries C, so its sweeps decode with the coreset too), each `sft.recipe.run_sft`
   of the study's recipe with `model.block_size` set (a list for the mix and the curriculum) under ``<runs_dir>/train_<name>``,
   and `seeds` of each (`StudyModel`: seed k > 0 adds k to the recipe's `train.seed`, `data.seed` (the
   data order) and `model.seed` (the init), under ``train_<name>_seed<k>``); a model whose HF export
   exists is not trained again, and an interrupted training resumes from its checkpoints. With
   `store_dir` (the repo's ``models/calibration_study``), each export is also kept there
   (``<name>``, ``<name>_seed<k>``) with the resolved recipe it was trained by (`study_model.json`),
   and a stored model whose recipe matches is used instead of training: ``runs/`` is scratch, the
   stored models are what lets the study be rerun in minutes on a fresh checkout (a recipe that
   differs is an error naming the key);
3. per model: the post-hoc gamma fit for every decode block size on the calibration split
   (`calibrate --fit`), the sweep (decode sizes x thresholds x {learned, gamma=0}, AR first) and a
   sweep of each fitted checkpoint at its own size (at `fitted_thresholds`); each writes its
   results.json and is skipped when that exists. Each row keeps its per-prompt results
   (``per_prompt``, from the sweep's per-example records, checked to average to the row's numbers)
   for the report's bootstrap. With `store_dir`, a model's rows are kept beside it (`measured.json`,
   with what they depend on: the eval prompts' hash and every sweep setting) and reused while that
   key matches, so the report is rebuilt from the stored models in seconds (rows measured before
   per-prompt results were kept are reused without them unless `measure_missing_prompts`);
4. the rows of all sweeps, labelled by trained size, seed and calibration, go to
   `clover_jax.decoding.study_report.write_report` (``report_dir``: means over seeds with their
   intervals), and each model's AR numbers are printed against the floor (validity 0.95, argument
   accuracy 0.8).

`dry_run` runs nothing: it prints, per model, whether it is stored, would be trained or measured.
`only` runs step 2 and 3 for some models (their folder names) and writes no report: several
processes (one per core or host) train and measure their shares, then a run without it reports.

Every step is a function handed in (`Steps`), so the orchestration is tested with stand-ins.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from clover_jax.yaml_config import ConfigError, apply_overrides, from_tree, load_yaml_tree

__all__ = ["StudyConfig", "StudyModel", "Steps", "default_steps", "is_study_config", "load_study_config", "run_study",
           "study_models"]

FLOOR = {"validity": 0.95, "bfcl_accuracy": 0.8}


@dataclass(frozen=True)
class StudyConfig:
    """The study's `study:` section (module docstring: what each step does with it)."""

    recipe: str = "configs/research_tool.yaml"  # the SFT recipe every model is trained by
    recipe_overrides: tuple[str, ...] = ()  # `key=value` overrides of that recipe, for every model
    runs_dir: str = "runs/calibration_study"  # scratch: training runs, splits, sweeps (resumable)
    train_block_sizes: tuple[int, ...] = (4, 8, 16, 32)  # one native model per size
    mix: tuple[int, ...] = (4, 8, 16, 32)  # () = no mix model
    # the curriculum model's model.block_size_schedule, [[fraction, block size], ...]; () = no curriculum model
    curriculum: tuple[tuple[float, int], ...] = ()
    # the block-coreset axis: each of `coreset_models` (training block sizes or "mix") also trained with
    # model.moe_block_coreset = C for every C here, named "<model>_c<C>"; () = none
    coreset: tuple[int, ...] = ()
    coreset_models: tuple[int | str, ...] = (32, "mix")  # which models get the coreset variants
    # models per name (a training block size, mix, curriculum, <model>_c<C>; default: the others); absent: 1.
    # Seed 0 is the recipe's
    seeds: dict[str | int, int] = field(default_factory=dict)
    bfcl: str = "../shared/data/bfcl/BFCL_v4_simple_python.json"  # the function schemas the prompts draw from
    eval_n: int = 200  # held-out eval prompts (the eval split)
    eval_seed: int = 1
    calibration_n: int = 32  # prompts of the calibration split (the gamma fit), disjoint from the eval split
    calibration_seed: int = 2
    decode_block_sizes: tuple[int, ...] = (4, 8, 16, 32, 64)  # every model is decoded at each
    thresholds: tuple[float, ...] = (0.8, 0.9, 0.95, 0.99)  # confidence thresholds of the sweeps
    quality: str = "bfcl_accuracy"  # the report's quality metric (a row key of the sweeps)
    report_threshold: float = 0.9  # the threshold the report's tables and answer read
    report_dir: str = "docs/calibration_study"  # where the report (markdown, CSV, plots) is written
    store_dir: str | None = None  # trained models kept (with their recipe) for fresh checkouts; None = runs only
    train_only: bool = False  # step 2 only: train (and store) what is missing, measure nothing
    fitted_thresholds: tuple[float, ...] | None = None  # the fitted checkpoints' sweeps; None = `thresholds`
    calibrate: dict[str, Any] = field(default_factory=dict)  # base CalibrateConfig tree of every sweep
    # measure again a stored model whose measured.json predates per-prompt results (for the prompt bootstrap)
    measure_missing_prompts: bool = False
    dry_run: bool = False  # print what would be trained / measured, run nothing
    # only these models (their folder names: "32", "mix_seed2", "32_c4"), e.g. one process per core or host
    # training its share; such a run writes no report (a run without `only` writes it from the stored rows).
    # A bare number (`study.only=[4]`, which YAML reads as an int) names the model "4".
    only: tuple[str | int, ...] = ()

    def __post_init__(self) -> None:
        names = {str(b) for b in self.train_block_sizes} | ({"mix"} if self.mix else set()) | (
            {"curriculum"} if self.curriculum else set())
        if self.coreset:
            missing = [str(m) for m in self.coreset_models if str(m) not in names]
            if missing:
                raise ConfigError(f"study.coreset_models: {missing[0]} is not a model of the study "
                                  f"({', '.join(sorted(names))})")
            if any(c < 1 for c in self.coreset):
                raise ConfigError(f"study.coreset: every C must be >= 1, got {list(self.coreset)}")
            names |= {f"{m}_c{c}" for m in self.coreset_models for c in self.coreset}
        for k, n in self.seeds.items():
            if str(k) != "default" and str(k) not in names:
                raise ConfigError(f"study.seeds.{k}: not a model of the study (default, {', '.join(sorted(names))})")
            if n < 1:
                raise ConfigError(f"study.seeds.{k}: must be >= 1, got {n}")
        if self.curriculum:
            from sft.noise import check_block_size_schedule

            check_block_size_schedule(self.curriculum, where="study.curriculum")

    def n_seeds(self, name: Any) -> int:
        by_name = {str(k): v for k, v in self.seeds.items()}
        return by_name.get(str(name), by_name.get("default", 1))


def is_study_config(path: str | Path) -> bool:
    return "study" in load_yaml_tree(path)


def load_study_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> StudyConfig:
    tree = apply_overrides(load_yaml_tree(path), list(overrides))
    return from_tree(StudyConfig, tree.get("study") or {}, where=f"{path}: study")


@dataclass(frozen=True)
class StudyModel:
    """One trained model of the study: its `name` in the report (a block size, "mix", "curriculum",
    "<model>_c<C>"), the training block sizes, the curriculum (or None), the block coreset C (or None)
    and the seed (0: the recipe's own seeds)."""

    name: Any
    sizes: tuple[int, ...]
    schedule: tuple[tuple[float, int], ...] | None = None
    seed: int = 0
    coreset: int | None = None

    @property
    def dirname(self) -> str:
        """The model's folder name under runs (``train_<dirname>``) and the store."""
        return str(self.name) if self.seed == 0 else f"{self.name}_seed{self.seed}"

    def overrides(self, base_seeds: dict[str, int]) -> tuple[str, ...]:
        """The recipe overrides that train this model; `base_seeds`: the recipe's train / data / model seeds."""
        size = self.sizes[0] if len(self.sizes) == 1 else f"[{', '.join(map(str, self.sizes))}]"
        out = [f"model.block_size={size}"]
        if self.schedule:
            out.append("model.block_size_schedule=[" + ", ".join(f"[{f!r}, {b}]" for f, b in self.schedule) + "]")
        if self.coreset is not None:
            out.append(f"model.moe_block_coreset={self.coreset}")
        if self.seed:
            out += [f"{k}={v + self.seed}" for k, v in sorted(base_seeds.items())]
        return tuple(out)


def study_models(cfg: StudyConfig) -> list[StudyModel]:
    """Every model of the study, seed 0 of each first (the round-1 models), then the other seeds."""
    base = [StudyModel(b, (b,)) for b in cfg.train_block_sizes]
    if cfg.mix:
        base.append(StudyModel("mix", tuple(cfg.mix)))
    if cfg.curriculum:
        sizes = tuple(dict.fromkeys(int(b) for _, b in cfg.curriculum))
        base.append(StudyModel("curriculum", sizes, tuple(cfg.curriculum)))
    wanted = {str(m) for m in cfg.coreset_models}
    base += [dataclasses.replace(m, name=f"{m.name}_c{c}", coreset=int(c))
             for c in cfg.coreset for m in list(base) if str(m.name) in wanted]
    extra = [dataclasses.replace(m, seed=k) for m in base for k in range(1, cfg.n_seeds(m.name))]
    return base + extra


def _base_seeds(cfg: StudyConfig) -> dict[str, int]:
    """The recipe's seeds that seed k > 0 shifts by k: the noise (train.seed), data order (data.seed), init (model.seed)."""
    from sft.config import load_sft_config

    r = load_sft_config(cfg.recipe, list(cfg.recipe_overrides))
    return {"train.seed": r.train.seed, "data.seed": r.data.seed, "model.seed": r.model.seed}


@dataclass(frozen=True)
class Steps:
    """The study's side effects: train(run_dir, recipe overrides of the model) -> export dir;
    fit(checkpoint, out, calibration jsonl, sizes); sweep(checkpoint, out, eval jsonl, sizes,
    thresholds, calibrations, ar_from=None) -> writes <out>/results.json (``ar_from``: an earlier
    sweep's results.json whose AR baseline it reuses)."""

    train: Callable[[Path, tuple[str, ...]], Path]
    fit: Callable[[Path, Path, Path, tuple[int, ...]], None]
    sweep: Callable[..., None]


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
        for path, recs in ((cal, cal_recs), (ev, eval_recs)):  # atomic: runs with `only` may start together
            tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
            write_jsonl(tmp, recs)
            tmp.replace(path)
    return ev, cal


#: per-prompt results a row keeps (row key -> the sweep's per-example key): the report's bootstrap reads them
_PER_PROMPT = {"validity": "valid", "bfcl_accuracy": "bfcl", "exact_match": "exact", "tokens": "tokens", "nfe": "nfe"}


def _per_prompt(row: dict[str, Any], examples: list[dict[str, Any]], where: str) -> dict[str, list]:
    """The row's per-prompt results from the sweep's per-example records (ints where whole: 0/1
    scores, token counts), checked to give the row's own numbers back (the report's means and its
    bootstrap must describe the same measurement)."""
    out = {k: [int(e[v]) if float(e[v]).is_integer() else float(e[v]) for e in examples] for k, v in _PER_PROMPT.items()}
    checks = {m: sum(out[m]) / len(examples) for m in ("validity", "bfcl_accuracy", "exact_match")}
    checks["tokens_per_forward"] = sum(out["tokens"]) / max(sum(out["nfe"]), 1)
    for m, v in checks.items():
        if abs(v - float(row[m])) > 1e-9:
            raise ValueError(f"{where}: the per-example records give {m} {v}, the row {row[m]} (block "
                             f"{row['block_size']}, threshold {row['threshold']})")
    return out


def _rows(results: Path, model: StudyModel, calibration: str | None = None) -> list[dict[str, Any]]:
    """The sweep's rows labelled with the model (``trained``, ``seed``) and `calibration`, each with its
    ``per_prompt`` results where the sweep wrote per-example records (``details``)."""
    res = json.loads(results.read_text())
    details = res.get("details")
    out = []
    for i, r in enumerate(res["rows"]):
        row = {**r, "trained": model.name, "seed": model.seed, **({"calibration": calibration} if calibration else {})}
        if details:
            row["per_prompt"] = _per_prompt(r, details[i]["examples"], str(results))
        out.append(row)
    return out


# what a stored model's recipe may differ in: where it wrote, how often it checkpointed or logged, where
# this machine keeps the data and caches (source paths are compared by file name)
_RECIPE_IGNORED = ("logging", "checkpoint", "export", "data_root", "staging_dir", "devices", "count_flops")


def _recipe_tree(cfg: StudyConfig, overrides: tuple[str, ...]) -> dict[str, Any]:
    """The resolved training config of a model (the recipe with the model's `overrides`, as `train`
    runs it), without the sections that only say where and how often it wrote."""
    from clover_jax.yaml_config import to_tree
    from sft.config import load_sft_config

    tree = to_tree(load_sft_config(cfg.recipe, [*cfg.recipe_overrides, *overrides]))
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


def _model_paths(cfg: StudyConfig, runs: Path, model: StudyModel) -> tuple[Path, Path | None]:
    """(the model's run dir, its stored copy or None without `store_dir`)."""
    return runs / f"train_{model.dirname}", Path(cfg.store_dir) / model.dirname if cfg.store_dir else None


def _trained_model(cfg: StudyConfig, runs: Path, model: StudyModel, base_seeds: dict[str, int], steps: Steps,
                   print_fn: Callable[[str], None]) -> Path:
    """The export of `model`: the stored one when its recipe matches, else the run's (trained now if
    missing), stored when `store_dir` is set; measured from the stored copy."""
    run, stored = _model_paths(cfg, runs, model)
    hf = run / "hf"
    overrides = model.overrides(base_seeds)
    recipe = _recipe_tree(cfg, overrides) if stored else None
    if stored is not None and _stored_model(stored, recipe):
        return stored
    if not (hf / "config.json").is_file():
        print_fn(f"study: training the block {model.dirname} model ({run})")
        hf = steps.train(run, overrides)
    if stored is not None:
        _store_model(hf, stored, recipe)
        print_fn(f"study: stored the block {model.dirname} model in {stored}")
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


def _stored_rows(cfg: StudyConfig, measured: Path | None, key: dict[str, Any], model: StudyModel) -> list[dict] | None:
    """The model's rows from its `measured.json` while its key matches (and, with
    `measure_missing_prompts`, they have per-prompt results); None: measure it."""
    if measured is None or not measured.is_file():
        return None
    m = json.loads(measured.read_text())
    if m["key"] != key or (cfg.measure_missing_prompts and not all(r.get("per_prompt") for r in m["rows"])):
        return None
    return [{**r, "trained": model.name, "seed": model.seed} for r in m["rows"]]


def _selected(cfg: StudyConfig, models: list[StudyModel]) -> list[StudyModel]:
    """`models` cut to `cfg.only` (all when empty); ConfigError naming a name that is no model of the study."""
    if not cfg.only:
        return models
    names = [m.dirname for m in models]
    unknown = [str(n) for n in cfg.only if str(n) not in names]
    if unknown:
        raise ConfigError(f"study.only: {unknown[0]} is not a model of the study ({', '.join(names)})")
    return [m for m in models if m.dirname in {str(n) for n in cfg.only}]


def _dry_run(cfg: StudyConfig, runs: Path, models: list[StudyModel], base_seeds: dict[str, int], key: dict | None,
             print_fn: Callable[[str], None]) -> None:
    """`dry_run`: per model, what a run would do (nothing is trained, stored or measured)."""
    todo = {"train": 0, "measure": 0}
    for model in models:
        run, stored = _model_paths(cfg, runs, model)
        try:
            have = stored is not None and _stored_model(stored, _recipe_tree(cfg, model.overrides(base_seeds)))
        except ConfigError as e:
            print_fn(f"study (dry run): {model.dirname}: refused: {e}")
            continue
        if have:
            what = f"stored in {stored}"
        elif (run / "hf" / "config.json").is_file():
            what = f"trained in {run / 'hf'}, to store"
        else:
            what, todo["train"] = f"to train in {run}", todo["train"] + 1
        if key is not None:
            measured = stored / "measured.json" if (have and stored is not None) else None
            rows = _stored_rows(cfg, measured, key, model)
            if rows is None:
                todo["measure"] += 1
            what += ("; measured" + ("" if all(r.get("per_prompt") for r in rows) else " (no per-prompt results)")
                     if rows is not None else "; to measure")
        print_fn(f"study (dry run): {model.dirname}: {what}")
    print_fn(f"study (dry run): {len(models)} models, {todo['train']} to train, "
             + (f"{todo['measure']} to measure" if key is not None else "nothing measured (train_only)"))


def _measure(cfg: StudyConfig, run: Path, hf: Path, model: StudyModel, ev: Path, cal: Path, steps: Steps
             ) -> list[dict]:
    """Step 3 for one model (each part skipped when its results exist under `run`): the rows of its
    sweep (AR, learned, gamma = 0) and of its fitted checkpoints' sweeps, labelled."""
    if not (run / "fit" / "fit" / "fit.json").is_file():
        steps.fit(hf, run / "fit", cal, cfg.decode_block_sizes)
    sweep = run / "sweep"
    if not (sweep / "results.json").is_file():
        steps.sweep(hf, sweep, ev, cfg.decode_block_sizes, cfg.thresholds, ({}, {"gamma": 0.0}))
    rows = _rows(sweep / "results.json", model)
    for k in cfg.decode_block_sizes:
        out = run / f"sweep_fitted_{k}"
        if not (out / "results.json").is_file():
            # a fitted checkpoint differs only in block-mode scalars: its AR decoding is the sweep's
            steps.sweep(run / "fit" / "fit" / f"block{k}", out, ev, (k,), cfg.fitted_thresholds or cfg.thresholds,
                        ({},), ar_from=sweep / "results.json")
        rows += [r for r in _rows(out / "results.json", model, "fitted") if r["mode"] != "ar"]
    return rows


def _check_coreset(cfg: StudyConfig) -> None:
    """Each `coreset` C must fit the recipe's model (top-k <= C <= experts): an error naming the key
    before anything trains."""
    if not cfg.coreset:
        return
    from clover_jax.config import ModelConfigError
    from sft.config import load_sft_config, model_config_from

    m = model_config_from(load_sft_config(cfg.recipe, list(cfg.recipe_overrides)).model, None)
    for c in cfg.coreset:
        try:
            m.replace(moe_block_coreset=int(c))
        except ModelConfigError as e:
            raise ConfigError(f"study.coreset: {c} does not fit the recipe's model ({e})") from None


def run_study(cfg: StudyConfig, steps: Steps, *, command: str, print_fn: Callable[[str], None] = print
              ) -> Path | None:
    """Steps 1-4 of the module docstring; returns the report's path (None with `train_only`: the
    models are trained first, e.g. over several sessions, and measured by a later run; None with
    `dry_run`)."""
    from clover_jax.decoding.study_report import write_report

    runs = Path(cfg.runs_dir)
    runs.mkdir(parents=True, exist_ok=True)
    ev, cal = _splits(cfg, runs)
    _check_coreset(cfg)
    models = _selected(cfg, study_models(cfg))
    base_seeds = _base_seeds(cfg) if any(m.seed for m in study_models(cfg)) else {}
    key = None if cfg.train_only else _measure_key(cfg, ev)
    if cfg.dry_run:
        _dry_run(cfg, runs, models, base_seeds, key, print_fn)
        return None
    rows: list[dict[str, Any]] = []
    if cfg.train_only:
        for model in models:
            _trained_model(cfg, runs, model, base_seeds, steps, print_fn)
        print_fn(f"study: {len(models)} models trained (train_only: nothing measured)")
        return None
    for model in models:
        run = runs / f"train_{model.dirname}"
        hf = _trained_model(cfg, runs, model, base_seeds, steps, print_fn)
        measured = hf / "measured.json" if cfg.store_dir else None
        mine = _stored_rows(cfg, measured, key, model)  # this model's sweeps, as measured before
        if mine is None:
            mine = _measure(cfg, run, hf, model, ev, cal, steps)
            if measured is not None:
                measured.write_text(json.dumps({"key": key, "rows": mine}, default=str) + "\n")
        rows += mine
        ar = next(r for r in mine if r["mode"] == "ar")
        verdict = all(ar[q] >= v for q, v in FLOOR.items())
        print_fn(f"study: block {model.dirname} model, AR on {ev.name}: validity {ar['validity']:.3f}, argument "
                 f"accuracy {ar['bfcl_accuracy']:.3f} (floor {FLOOR['validity']} / {FLOOR['bfcl_accuracy']}: "
                 f"{'met' if verdict else 'NOT met'})")
    if cfg.only:
        print_fn(f"study: {len(models)} models measured (study.only: no report; a run without it writes the report)")
        return None
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

    def train(run: Path, overrides: tuple[str, ...]) -> Path:
        res = run_sft(load_sft_config(cfg.recipe, [*cfg.recipe_overrides, *overrides, f"logging.run_dir={run}",
                                                   f"export.dir={run / 'hf'}"]))
        if res.export_dir is None:
            raise RuntimeError(f"study: training {run} stopped at step {res.step} without an export (preempted?)")
        return Path(res.export_dir)

    def fit(hf: Path, out: Path, cal_path: Path, sizes: tuple[int, ...]) -> None:
        c = base(hf, out, {})
        run_fit(dataclasses.replace(c, fit=dataclasses.replace(
            c.fit, calibration={"source": "jsonl", "path": str(cal_path), "n": cfg.calibration_n}, block_sizes=sizes)))

    def sweep(hf: Path, out: Path, ev: Path, sizes, thresholds, cals, ar_from: Path | None = None) -> None:
        c = base(hf, out, {"eval": {"source": "jsonl", "path": str(ev), "n": cfg.eval_n},
                           "ar_baseline": str(ar_from or "")})
        run_calibrate(dataclasses.replace(c, sweep=dataclasses.replace(
            c.sweep, modes=("threshold",), block_sizes=tuple(sizes), thresholds=tuple(thresholds),
            calibration=tuple(from_tree(CalibOverride, x, where="study calibration") for x in cals))))

    return Steps(train=train, fit=fit, sweep=sweep)
