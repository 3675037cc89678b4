"""sft.calibration_study's orchestration with stand-in steps (training and decoding are tested
elsewhere): the eval and calibration splits are disjoint held-out prompts; every model is trained,
fitted and swept once, and a rerun does nothing but rebuild the report (resumable); a model whose
training stopped without an export is retried on the next run; the report's penalty table is the
stand-in sweeps' quality arithmetic; each model's AR numbers are printed against the floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sft.calibration_study import Steps, StudyConfig, run_study

ROOT = Path(__file__).resolve().parents[2]
BFCL = ROOT.parent / "shared" / "data" / "bfcl" / "BFCL_v4_simple_python.json"


def _row(mode, k, th, gamma, q):
    return {"mode": mode, "block_size": k, "threshold": th, "sub_block_size": 0, "gamma": gamma, "alpha_scale": 1.0,
            "beta_shift": 0.0, "validity": q, "bfcl_accuracy": q, "tokens_per_forward": 1.0 + k / 8}


def _steps(calls: list, fail_train: set | None = None, overrides: dict | None = None) -> Steps:
    def train(run: Path, over):
        calls.append(("train", run.name))
        if overrides is not None:
            overrides[run.name] = over
        if fail_train and run.name in fail_train:
            raise RuntimeError("preempted")
        size = yaml.safe_load(next(o for o in over if o.startswith("model.block_size=")).split("=", 1)[1])
        seed = next((int(o.split("=")[1]) for o in over if o.startswith("train.seed=")), 0)
        (run / "hf").mkdir(parents=True, exist_ok=True)
        (run / "hf" / "config.json").write_text(json.dumps({"sizes": size if isinstance(size, list) else [size],
                                                            "seed": seed}))
        return run / "hf"

    def fit(hf, out, cal, sizes):
        calls.append(("fit", out.parent.name))
        for k in sizes:  # a fitted checkpoint per size, of the model it was fitted on
            (out / "fit" / f"block{k}").mkdir(parents=True, exist_ok=True)
            (out / "fit" / f"block{k}" / "config.json").write_text((Path(hf) / "config.json").read_text())
        (out / "fit" / "fit.json").write_text("{}")

    def sweep(hf, out, ev, sizes, thresholds, cals, ar_from=None):
        calls.append(("sweep", out.parent.name, out.name, str(hf)))
        # a fitted checkpoint's sweep reuses its model's AR baseline; the model's own sweep decodes it
        fitted = out.name.startswith("sweep_fitted")
        assert ar_from == (out.parent / "sweep" / "results.json" if fitted else None), (out, ar_from)
        assert ar_from is None or ar_from.is_file()
        trained = json.loads((Path(hf) / "config.json").read_text())["sizes"]
        rows = [_row("ar", 1, thresholds[0], "learned", 0.97)]
        for k in sizes:
            for th in thresholds:
                for c in cals:
                    native = 1.0 if k in trained else 0.6  # the mismatch costs 0.4; gamma = 0 wins 0.1 back
                    q = native + (0.1 if "gamma" in c and native < 1 else 0.0) + (0.2 if fitted and native < 1 else 0.0)
                    rows.append(_row("threshold", k, th, c.get("gamma", "learned"), q))
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"rows": rows}))

    return Steps(train=train, fit=fit, sweep=sweep)


def test_study_runs_once_resumes_and_reports(tmp_path):
    cfg = StudyConfig(runs_dir=str(tmp_path / "runs"), train_block_sizes=(8, 32), mix=(8, 32), bfcl=str(BFCL),
                      eval_n=40, calibration_n=16, decode_block_sizes=(8, 32), thresholds=(0.9,),
                      quality="validity", report_dir=str(tmp_path / "report"))
    calls: list = []
    with pytest.raises(RuntimeError, match="preempted"):
        run_study(cfg, _steps(calls, fail_train={"train_32"}), command="cmd", print_fn=lambda s: None)
    assert ("train", "train_8") in calls and not (tmp_path / "runs" / "train_32" / "hf").exists()

    said: list[str] = []
    calls.clear()
    md = run_study(cfg, _steps(calls), command="python launch.py calibrate --config study.yaml", print_fn=said.append)
    assert [c for c in calls if c[0] == "train"] == [("train", "train_32"), ("train", "train_mix")]  # 8 was done
    assert len([c for c in calls if c[0] == "sweep"]) == 3 * (1 + 2) - 3  # train_8's plain + fitted sweeps were done
    ev = [json.loads(x) for x in (tmp_path / "runs" / "eval.jsonl").read_text().splitlines()]
    cal = [json.loads(x) for x in (tmp_path / "runs" / "calibration.jsonl").read_text().splitlines()]
    assert len(ev) == 40 and len(cal) == 16
    assert not {r["messages"][0]["content"] for r in ev} & {r["messages"][0]["content"] for r in cal}
    text = md.read_text()
    assert "| 8 | +0.000 | -0.400 |" in text and "| 32 | -0.400 | +0.000 |" in text and "| mix | +0.000 | +0.000 |" in text
    assert "gamma=0: +25% of the penalty (2 cells)" in text and "fitted: +50% of the penalty (2 cells)" in text
    assert sum("validity 0.970, argument accuracy 0.970" in s and "NOT met" not in s for s in said) == 3

    calls.clear()
    run_study(cfg, _steps(calls), command="cmd", print_fn=lambda s: None)
    assert calls == []  # everything cached: only the report is rebuilt


def test_eval_prompts_draw_from_the_recipes_task(tmp_path):
    """The eval and calibration splits use the recipe's tool_task options that define the task
    (`max_values`, `quote_values`), not its training curricula (`echo_share`): with a recipe cut to
    12 string values, every string argument of both splits is one of those 12 (the default pool has
    256, so a split drawn from it would not be), quoted in the user turn, and no reply is a copy drill."""
    from sft.data.tool_task import load_schemas

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base_config: {ROOT / 'configs' / 'research_tool.yaml'}\ndata:\n  sources:\n"
                      f"    - {{name: t, format: tool_task, path: bfcl/BFCL_v4_simple_python.json, "
                      f"options: {{n_records: 10, max_values: 12, quote_values: true, echo_share: 0.5}}}}\n")
    cfg = StudyConfig(recipe=str(recipe), runs_dir=str(tmp_path / "runs"), train_block_sizes=(8,), mix=(),
                      bfcl=str(BFCL), eval_n=60, calibration_n=20, decode_block_sizes=(8,), thresholds=(0.9,),
                      quality="validity", report_dir=str(tmp_path / "report"))
    run_study(cfg, _steps([]), command="cmd", print_fn=lambda s: None)
    pool = set(load_schemas(str(BFCL), 32, 12).values)
    assert len(pool) == 12
    recs = [json.loads(line) for name in ("eval.jsonl", "calibration.jsonl")
            for line in (tmp_path / "runs" / name).read_text().splitlines()]
    strings = [(v, r["messages"][0]["content"]) for r in recs for c in r["messages"][1].get("tool_calls") or []
               for v in c["function"]["arguments"].values() if isinstance(v, str)]
    assert len(strings) > 20 and {v for v, _ in strings} <= pool
    assert all(f'"{v}"' in user for v, user in strings)
    assert not any((r["messages"][1].get("content") or "").startswith(("Noted: ", "I will remember ")) for r in recs)


def test_stored_models_stand_in_for_training_on_a_fresh_checkout(tmp_path):
    """`store_dir`: each trained export is kept with the recipe that trained it, and its measured rows
    beside it with what they depend on; with the scratch runs gone (a fresh checkout), the study trains
    and measures nothing and writes the same report; other sweep settings are measured again; a stored
    model whose recipe differs from the study's is refused, naming the key; a copy cut short never counts."""
    from clover_jax.yaml_config import ConfigError

    def cfg(runs, *overrides, train_only=False, thresholds=(0.9,)):
        return StudyConfig(recipe=str(ROOT / "configs" / "research_tool.yaml"), recipe_overrides=overrides,
                           runs_dir=str(tmp_path / runs), train_block_sizes=(8, 32), mix=(), bfcl=str(BFCL),
                           eval_n=20, calibration_n=8, decode_block_sizes=(8, 32), thresholds=thresholds,
                           quality="validity", report_dir=str(tmp_path / "report"), store_dir=str(tmp_path / "store"),
                           train_only=train_only)

    calls: list = []  # train_only: train and store, measure nothing (the models of one session, measured later)
    assert run_study(cfg("runs1", train_only=True), _steps(calls), command="cmd", print_fn=lambda s: None) is None
    assert calls == [("train", "train_8"), ("train", "train_32")] and not (tmp_path / "report").exists()
    calls.clear()
    run_study(cfg("runs1"), _steps(calls), command="cmd", print_fn=lambda s: None)
    assert not [c for c in calls if c[0] == "train"] and ("fit", "train_8") in calls
    for b in (8, 32):
        meta = json.loads((tmp_path / "store" / str(b) / "study_model.json").read_text())["recipe"]
        assert meta["model"]["overrides"]["block_size"] == b and meta["train"]["steps"] == 3000
        assert meta["data"]["sources"][0]["path"] == "BFCL_v4_simple_python.json"  # no machine's absolute path
        assert json.loads((tmp_path / "store" / str(b) / "config.json").read_text())["sizes"] == [b]
    assert not list((tmp_path / "store").glob("*.partial"))
    assert {c[3] for c in calls if c[0] == "sweep" and c[2] == "sweep"} == {str(tmp_path / "store" / "8"),
                                                                           str(tmp_path / "store" / "32")}

    report = (tmp_path / "report" / "calibration_study.md").read_text()
    calls.clear()  # a fresh checkout: new scratch dir, same store -> the stored rows, nothing run
    run_study(cfg("runs2"), _steps(calls), command="cmd", print_fn=lambda s: None)
    assert calls == [] and (tmp_path / "report" / "calibration_study.md").read_text() == report
    run_study(cfg("runs5", thresholds=(0.9, 0.95)), _steps(calls), command="cmd", print_fn=lambda s: None)
    assert not [c for c in calls if c[0] == "train"]  # other thresholds: measured again, from the stored models
    assert {c[3] for c in calls if c[0] == "sweep" and c[2] == "sweep"} == {str(tmp_path / "store" / "8"),
                                                                           str(tmp_path / "store" / "32")}
    assert json.loads((tmp_path / "store" / "8" / "measured.json").read_text())["key"]["thresholds"] == [0.9, 0.95]
    with pytest.raises(ConfigError, match=r"store/8: this stored model was trained by another recipe "
                                          r"\(train.steps: stored 3000, recipe now 10\)"):
        run_study(cfg("runs3", "train.steps=10"), _steps([]), command="cmd", print_fn=lambda s: None)
    meta = tmp_path / "store" / "8" / "study_model.json"  # a config field added after training: not a change
    recipe = json.loads(meta.read_text())
    del recipe["recipe"]["train"]["eval_steps"]
    meta.write_text(json.dumps(recipe))
    calls.clear()
    run_study(cfg("runs5", thresholds=(0.9, 0.95)), _steps(calls), command="cmd", print_fn=lambda s: None)
    assert calls == []
    (tmp_path / "store" / "32" / "study_model.json").unlink()  # as if the copy had been cut short
    calls.clear()
    run_study(cfg("runs4"), _steps(calls), command="cmd", print_fn=lambda s: None)
    assert [c for c in calls if c[0] == "train"] == [("train", "train_32")]


def _with_details(steps: Steps, n_prompts: int = 10) -> Steps:
    """The stand-in sweep, plus per-example records (as `calibrate.run_setting` writes them): the
    first round(q * n) prompts right, 2 tokens in 1 forward each; the rows' numbers become those
    records' means, so rows and records agree as a real sweep's do."""
    def sweep(hf, out, ev, sizes, thresholds, cals, ar_from=None):
        steps.sweep(hf, out, ev, sizes, thresholds, cals, ar_from)
        res = json.loads((out / "results.json").read_text())
        res["details"] = []
        for r in res["rows"]:
            right = round(r["validity"] * n_prompts)
            ex = [{"valid": float(i < right), "bfcl": float(i < right), "exact": 0.0, "tokens": 2, "nfe": 1}
                  for i in range(n_prompts)]
            r.update(validity=right / n_prompts, bfcl_accuracy=right / n_prompts, exact_match=0.0, tokens_per_forward=2.0)
            res["details"].append({"setting": r, "examples": ex})
        (out / "results.json").write_text(json.dumps(res))

    return Steps(train=steps.train, fit=steps.fit, sweep=sweep)


def test_seeds_and_the_curriculum_model_train_store_and_report_with_intervals(tmp_path):
    """`seeds`: seed k > 0 of a model is trained with the recipe's train / data / model seeds + k, stored
    as <name>_seed<k> (seed 0 keeps <name>, so round-1 models stay valid); `curriculum`: a model trained
    with model.block_size_schedule over the schedule's sizes. Rows carry seed and per-prompt results,
    measured.json keeps them, a rerun runs nothing, and the report gives each cell over its seeds with
    intervals (the Welch interval of a penalty by hand)."""
    cfg = StudyConfig(recipe=str(ROOT / "configs" / "research_tool.yaml"), runs_dir=str(tmp_path / "runs"),
                      train_block_sizes=(8, 32), mix=(8, 32), curriculum=((0.0, 8), (0.5, 32)),
                      seeds={"default": 2, "mix": 3, "curriculum": 1}, bfcl=str(BFCL), eval_n=20, calibration_n=8,
                      decode_block_sizes=(8, 32), thresholds=(0.9,), quality="validity",
                      report_dir=str(tmp_path / "report"), store_dir=str(tmp_path / "store"))
    calls, over = [], {}
    base = _steps(calls, overrides=over)
    seeded = base.sweep

    def sweep(hf, out, ev, sizes, thresholds, cals, ar_from=None):  # seed 1 loses 0.1 more where mismatched
        seeded(hf, out, ev, sizes, thresholds, cals, ar_from)
        seed = json.loads((Path(hf) / "config.json").read_text()).get("seed", 0)
        res = json.loads((out / "results.json").read_text())
        for r in res["rows"]:
            if r["mode"] == "threshold" and r["validity"] < 1.0:
                r["validity"] = r["bfcl_accuracy"] = round(r["validity"] - 0.1 * seed, 6)
        (out / "results.json").write_text(json.dumps(res))

    md = run_study(cfg, _with_details(Steps(base.train, base.fit, sweep)), command="cmd", print_fn=lambda s: None)
    trained = [c[1] for c in calls if c[0] == "train"]
    assert trained == ["train_8", "train_32", "train_mix", "train_curriculum", "train_8_seed1", "train_32_seed1",
                       "train_mix_seed1", "train_mix_seed2"]
    assert over["train_mix"] == ("model.block_size=[8, 32]",)  # seed 0: the recipe's own seeds (round 1)
    assert over["train_mix_seed2"] == ("model.block_size=[8, 32]", "data.seed=2", "model.seed=2", "train.seed=2")
    assert over["train_curriculum"] == ("model.block_size=[8, 32]", "model.block_size_schedule=[[0.0, 8], [0.5, 32]]")
    store = tmp_path / "store"
    meta = json.loads((store / "mix_seed2" / "study_model.json").read_text())["recipe"]
    assert (meta["train"]["seed"], meta["data"]["seed"], meta["model"]["seed"]) == (2, 2, 2)
    curriculum = json.loads((store / "curriculum" / "study_model.json").read_text())["recipe"]["model"]
    assert curriculum["block_size_schedule"] == [[0.0, 8], [0.5, 32]]
    assert curriculum["overrides"]["block_size"] == [8, 32]
    rows = json.loads((store / "32_seed1" / "measured.json").read_text())["rows"]
    assert {r["seed"] for r in rows} == {1} and all(len(r["per_prompt"]["validity"]) == 10 for r in rows)
    cell = next(r for r in rows if r["mode"] == "threshold" and r["block_size"] == 8 and r["gamma"] == "learned")
    assert cell["validity"] == 0.5 and cell["per_prompt"]["validity"] == [1] * 5 + [0] * 5

    text = md.read_text()
    # 32 at 8: seeds 0.6 / 0.5 against native 8's 1.0 / 1.0: -0.45 +- t(0.975, df 1) * 0.05 (Welch: the
    # native model's seeds agree, so df = n_32 - 1 = 1), and a prompt interval
    row32 = next(line for line in text.splitlines() if line.startswith("| 32 | -0.450 ±0.635 (±"))
    assert "+0.000" in row32
    # the mix is native everywhere: its seeds agree; the curriculum has one seed: a prompt interval only
    assert "| mix | +0.000 ±0.000 (±0.000) | +0.000 ±0.000 (±0.000) |" in text
    assert "| curriculum | +0.000 (±0.000) | +0.000 (±0.000) |" in text
    # only the prompt interval separates mix - 32 at block 8 (°): the seed interval holds 0
    assert "| mix - 32 | +0.450 ±0.635 (±0.300)° | +0.000 ±0.000 (±0.000) |" in text
    assert "| curriculum - mix | +0.000 (±0.000) | +0.000 (±0.000) |" in text
    assert "The intervals separate none of the 10 differences." in text
    calls.clear()
    run_study(cfg, _with_details(Steps(base.train, base.fit, sweep)), command="cmd", print_fn=lambda s: None)
    assert calls == []


def test_only_trains_and_measures_a_share_and_a_full_run_reports_from_the_store(tmp_path):
    """`only`: two runs, each with its share of the models (folder names, a seed's included), train and
    measure just those and write no report; a run without `only` then trains and measures nothing and
    reports every model; a name that is no model of the study is refused, listing the models."""
    from clover_jax.yaml_config import ConfigError

    def cfg(*only):
        return StudyConfig(recipe=str(ROOT / "configs" / "research_tool.yaml"), runs_dir=str(tmp_path / "runs"),
                           train_block_sizes=(8, 32), mix=(), seeds={"32": 2}, bfcl=str(BFCL), eval_n=20,
                           calibration_n=8, decode_block_sizes=(8, 32), thresholds=(0.9,), quality="validity",
                           report_dir=str(tmp_path / "report"), store_dir=str(tmp_path / "store"), only=only)

    calls: list = []
    steps = _with_details(_steps(calls))
    assert run_study(cfg("32_seed1", "8"), steps, command="cmd", print_fn=lambda s: None) is None
    assert [c[1] for c in calls if c[0] == "train"] == ["train_8", "train_32_seed1"]
    assert {c[1] for c in calls if c[0] == "sweep"} == {"train_8", "train_32_seed1"}
    assert not (tmp_path / "report").exists()
    calls.clear()
    run_study(cfg("32"), steps, command="cmd", print_fn=lambda s: None)
    assert {c[1] for c in calls} == {"train_32"}
    calls.clear()
    md = run_study(cfg(), steps, command="cmd", print_fn=lambda s: None)
    assert calls == [] and "| 32 | -0.400 " in md.read_text()  # 32's two seeds agree on the stand-in's numbers
    with pytest.raises(ConfigError, match=r"study.only: 64 is not a model of the study \(8, 32, 32_seed1\)"):
        run_study(cfg("64"), steps, command="cmd", print_fn=lambda s: None)


def test_only_reads_a_bare_number_as_the_model_of_that_name():
    """`study.only=[4, 32_seed1]` on the command line: YAML reads 4 as an int, which names the model "4"."""
    from sft.calibration_study import _selected, load_study_config, study_models

    cfg = load_study_config(ROOT / "configs" / "calibration_study.yaml", ["study.only=[4, 32_seed1]"])
    assert [m.dirname for m in _selected(cfg, study_models(cfg))] == ["4", "32_seed1"]


def test_per_prompt_results_must_give_the_rows_numbers(tmp_path):
    """A sweep whose per-example records do not average to its rows is refused, naming the file."""
    cfg = StudyConfig(runs_dir=str(tmp_path / "runs"), train_block_sizes=(8,), mix=(), bfcl=str(BFCL), eval_n=10,
                      calibration_n=4, decode_block_sizes=(8,), thresholds=(0.9,), quality="validity",
                      report_dir=str(tmp_path / "report"))
    steps = _with_details(_steps([]))

    def sweep(hf, out, ev, sizes, thresholds, cals, ar_from=None):
        steps.sweep(hf, out, ev, sizes, thresholds, cals, ar_from)
        res = json.loads((out / "results.json").read_text())
        res["rows"][0]["validity"] -= 0.1
        (out / "results.json").write_text(json.dumps(res))

    with pytest.raises(ValueError, match=r"sweep/results.json: the per-example records give validity 1.0, the row 0.9"):
        run_study(cfg, Steps(steps.train, steps.fit, sweep), command="cmd", print_fn=lambda s: None)


def test_seeds_name_models_of_the_study():
    from clover_jax.yaml_config import ConfigError

    with pytest.raises(ConfigError, match=r"study.seeds.curriculum: not a model of the study \(default, 32, 8, mix\)"):
        StudyConfig(train_block_sizes=(8, 32), seeds={"curriculum": 3})
    with pytest.raises(ConfigError, match=r"study.seeds.8: must be >= 1"):
        StudyConfig(train_block_sizes=(8, 32), seeds={8: 0})
    with pytest.raises(ConfigError, match=r"study.curriculum: the first stage must start at fraction 0"):
        StudyConfig(curriculum=((0.5, 8),))


def test_the_study_config_trains_nothing_already_stored():
    """A dry run of configs/calibration_study.yaml against the committed models/calibration_study: every
    stored model (a model.safetensors there) is reused, not trained, and every one with a measured.json
    is not measured again (the round-1 models, seed 0 of 4, 8, 16, 32 and the mix, are stored and
    measured); the counts follow from the store's files; nothing is run or written outside runs_dir."""
    from sft.calibration_study import load_study_config, study_models

    said: list[str] = []
    import tempfile

    store = ROOT / "models" / "calibration_study"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_study_config(ROOT / "configs" / "calibration_study.yaml", [
            f"study.runs_dir={tmp}", "study.dry_run=true", f"study.bfcl={BFCL}",
            f"study.recipe={ROOT / 'configs' / 'research_tool.yaml'}", f"study.store_dir={store}"])
        assert run_study(cfg, Steps(None, None, None), command="cmd", print_fn=said.append) is None
    names = [m.dirname for m in study_models(cfg)]
    stored = {n for n in names if (store / n / "model.safetensors").is_file()}
    measured = {n for n in names if (store / n / "measured.json").is_file()}
    assert {"4", "8", "16", "32", "mix"} <= measured <= stored and len(names) == 19
    for n in names:
        [line] = [s for s in said if s.startswith(f"study (dry run): {n}: ")]
        assert line.startswith(f"study (dry run): {n}: " + ("stored in " if n in stored else "to train in ")), line
        assert ("; measured" in line) if n in measured else line.endswith("; to measure"), line
    assert said[-1] == (f"study (dry run): 19 models, {19 - len(stored)} to train, "
                        f"{19 - len(measured)} to measure")


def test_the_coreset_axis_trains_each_named_model_with_c_and_compares_it_with_itself(tmp_path):
    """`coreset`: each of `coreset_models` is trained again with model.moe_block_coreset = C (named
    <model>_c<C>, its own seeds), and the report compares it with the model it varies; a C the
    recipe's MoE cannot hold (8 experts, top 2) or a model the study lacks is an error naming the key."""
    from clover_jax.yaml_config import ConfigError
    from sft.calibration_study import study_models

    recipe = str(ROOT / "configs" / "research_tool.yaml")
    cfg = StudyConfig(recipe=recipe, runs_dir=str(tmp_path / "runs"), train_block_sizes=(8, 32), mix=(),
                      coreset=(4,), coreset_models=(32,), seeds={"32_c4": 2}, bfcl=str(BFCL), eval_n=20,
                      calibration_n=8, decode_block_sizes=(8, 32), thresholds=(0.9,), quality="validity",
                      report_dir=str(tmp_path / "report"))
    assert [m.dirname for m in study_models(cfg)] == ["8", "32", "32_c4", "32_c4_seed1"]
    calls, over = [], {}
    md = run_study(cfg, _with_details(_steps(calls, overrides=over)), command="cmd", print_fn=lambda s: None)
    assert over["train_32_c4"] == ("model.block_size=32", "model.moe_block_coreset=4")
    assert over["train_32_c4_seed1"][:2] == ("model.block_size=32", "model.moe_block_coreset=4")
    text = md.read_text()
    # native 32 has one seed: the difference has a prompt interval only
    assert "| 32_c4 - 32 | +0.000 (±0.000) | +0.000 (±0.000) |" in text
    assert "| 32_c4 | 0.600 ±0.000 (±0.300) | 1.000 ±0.000 (±0.000) |" in text  # two seeds: both intervals
    assert "the block-32 model with the block coreset C = 4 is" in text

    with pytest.raises(ConfigError, match=r"study.coreset: 16 does not fit the recipe's model .*moe_block_coreset 16"):
        run_study(StudyConfig(recipe=recipe, runs_dir=str(tmp_path / "r2"), coreset=(16,), bfcl=str(BFCL),
                              eval_n=4, calibration_n=2), Steps(None, None, None), command="cmd")
    with pytest.raises(ConfigError, match=r"study.coreset_models: mix is not a model of the study"):
        StudyConfig(train_block_sizes=(32,), mix=(), coreset=(4,), coreset_models=(32, "mix"))
