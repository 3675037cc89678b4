"""`launch.py calibrate` on the trained tiny model: every output file, every column filled, and
cross-checks that do not trust the sweep code: self-speculative rows agree with AR greedy exactly,
the AR row agrees with itself, the scalar table holds the model's parameters, the Pareto front is
non-dominated (brute force), the masked-token loss matches a direct computation."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import launch
from clover_jax.api import load_hf
from clover_jax.decoding.calibrate import LossEvalConfig, block_logits_fn, build_examples, masked_loss_table
from clover_jax.bridge.tokenizer import load_tokenizer
from tests.decode_fixtures import eval_records, trained_checkpoint, write_eval_jsonl

ROOT = Path(__file__).resolve().parents[2]


def test_calibrate_tiny_writes_complete_results(tmp_path, capsys):
    ckpt = trained_checkpoint()
    out = tmp_path / "cal"
    rc = launch.main(["calibrate", "--config", str(ROOT / "configs" / "calibrate_tiny.yaml"), f"checkpoint={ckpt}",
                      f"out_dir={out}", f"eval.path={write_eval_jsonl(tmp_path / 'eval.jsonl')}", "eval.n=16",
                      "decode.max_new_tokens=48",
                      "decode.batch_bucket=16", "sweep.batch_size=16", "sweep.block_sizes=[32]",
                      "sweep.thresholds=[0.95]", "sweep.sub_block_sizes=[0]", "sweep.modes=[threshold,self_speculative]",
                      "sweep.calibration=[{}, {gamma: 0.0}]", "loss.block_sizes=[32]", "loss.t_values=[0.5, 1.0]",
                      "loss.n=4"])
    stdout = capsys.readouterr().out
    assert rc == 0
    for name in ("results.csv", "results.json", "loss.csv", "scalars.csv", "quality_vs_speed.png", "loss_vs_t.png",
                 "scalars.png"):
        assert (out / name).stat().st_size > 0, name
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 1 + 2 * 2  # AR + modes x overrides
    for r in rows:
        empty = [k for k, v in r.items() if v == ""]
        assert not empty, (r["mode"], empty)
    ar = [r for r in rows if r["mode"] == "ar"]
    assert len(ar) == 1 and float(ar[0]["ar_exact"]) == 1.0 and float(ar[0]["tokens_per_forward"]) <= 1.0
    for r in rows:
        if r["mode"] == "self_speculative":
            assert float(r["ar_exact"]) == 1.0 and float(r["ar_agreement"]) == 1.0
        if r["mode"] != "ar":  # the history unit's share, per GDN layer, is a probability
            assert 0.0 < float(r["history_share_L0"]) < 1.0
    # the Clover default (threshold 0.95, block 32, learned calibration) decodes valid tool calls in parallel
    default = [r for r in rows if r["mode"] == "threshold" and r["gamma"] == "learned"]
    assert float(default[0]["validity"]) > 0.5 and float(default[0]["tokens_per_forward"]) > 1.0, default
    assert "Pareto front" in stdout
    res = json.loads((out / "results.json").read_text())
    q = "validity"
    front = {(r["mode"], r["block_size"], str(r["gamma"])) for r in res["pareto"]}
    for r in res["rows"]:
        dominated = any(o["tokens_per_forward"] >= r["tokens_per_forward"] and o[q] >= r[q] and
                        (o["tokens_per_forward"] > r["tokens_per_forward"] or o[q] > r[q]) for o in res["rows"])
        assert ((r["mode"], r["block_size"], str(r["gamma"])) in front) == (not dominated)
    # the scalar table is the model's parameters
    cfg, model = load_hf(ckpt)
    scal = list(csv.DictReader((out / "scalars.csv").open()))
    n_gdn = sum(t != "full_attention" for t in cfg.layer_types)
    assert len(scal) == n_gdn * cfg.linear_num_value_heads
    first = np.asarray(model.groups.layer_0.gdn.bd_gdn_softmax_scalars[...])[0]
    got = np.asarray([[float(s[k]) for k in ("alpha", "beta", "gamma")] for s in scal[: cfg.linear_num_value_heads]])
    np.testing.assert_allclose(got, first, rtol=1e-6)
    if res["history_stats"]:
        assert (out / "history_share.png").stat().st_size > 0 and (out / "history_position.png").stat().st_size > 0
        # the share per position inside the block: probabilities whose token-weighted mean (the
        # decoder's pooled counts) is the row's per-layer share; the long CSV holds the same numbers
        pos = list(csv.DictReader((out / "history_position.csv").open()))
        assert "history_share_by_position" not in rows[0]  # lists stay out of results.csv
        for i, r in enumerate(res["rows"]):
            if r["mode"] == "ar":
                continue
            share = np.asarray(r["history_share_by_position"], np.float64)
            assert share.shape == (n_gdn, r["block_size"])
            seen = ~np.isnan(share)
            assert seen[:, 0].all() and np.all((share[seen] >= 0) & (share[seen] <= 1))
            mine = [p for p in pos if int(p["setting"]) == i]
            assert len(mine) == int(seen.sum())
            for p in mine[:20]:
                assert float(p["share"]) == share[int(p["gdn_layer"]), int(p["position"])]


def test_a_reused_ar_baseline_gives_the_rows_of_a_decoded_one(tmp_path, monkeypatch, capsys):
    """`ar_baseline`: a second sweep of the same checkpoint and eval set, with the first one's results.json,
    decodes no AR and writes the same rows (AR agreement included: it compares with the reused outputs);
    another eval set, a missing file or one that is not JSON is refused, naming the key or the file."""
    from clover_jax.decoding import calibrate

    ckpt, ev = trained_checkpoint(), write_eval_jsonl(tmp_path / "eval.jsonl")
    modes: list[str] = []
    run_setting = calibrate.run_setting
    monkeypatch.setattr(calibrate, "run_setting", lambda m, t, e, dcfg, *a: modes.append(dcfg.mode) or run_setting(
        m, t, e, dcfg, *a))

    def sweep(out, *extra):
        rc = launch.main(["calibrate", "--config", str(ROOT / "configs" / "calibrate_tiny.yaml"), f"checkpoint={ckpt}",
                          f"out_dir={out}", f"eval.path={ev}", "eval.n=8", "decode.max_new_tokens=32",
                          "decode.batch_bucket=8", "sweep.batch_size=8", "sweep.block_sizes=[32]",
                          "sweep.thresholds=[0.9]", "sweep.modes=[threshold]", "sweep.sub_block_sizes=[0]",
                          "sweep.calibration=[{}]", "loss.enabled=false", "plots=false",
                          *extra])
        return json.loads((out / "results.json").read_text()) if rc == 0 else rc

    first = sweep(tmp_path / "a")
    assert modes == ["ar", "threshold"]
    second = sweep(tmp_path / "b", f"ar_baseline={tmp_path / 'a' / 'results.json'}")
    assert modes == ["ar", "threshold", "threshold"] and "reused from" in capsys.readouterr().out
    timing = {"wall_s", "s_per_token", "ttft_s"}
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timing} for r in rows]  # noqa: E731
    assert strip(second["rows"]) == strip(first["rows"]) and second["rows"][1]["ar_agreement"] < 1.0
    assert second["details"][0]["examples"] == first["details"][0]["examples"]
    assert sweep(tmp_path / "c", f"ar_baseline={tmp_path / 'a' / 'results.json'}", "eval.n=6") == 1
    assert f"{tmp_path / 'a' / 'results.json'} was swept with another `eval`" in capsys.readouterr().err
    assert sweep(tmp_path / "d", f"ar_baseline={tmp_path / 'nothing.json'}") == 1
    assert f"{tmp_path / 'nothing.json'} is no file" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text('{"config": ')
    assert sweep(tmp_path / "e", f"ar_baseline={tmp_path / 'broken.json'}") == 1
    assert f"{tmp_path / 'broken.json'} is not JSON" in capsys.readouterr().err
    assert modes == ["ar", "threshold", "threshold"]   # refused before decoding anything


@pytest.mark.parametrize("align", [0, 8])
def test_masked_loss_matches_direct_computation(align):
    """At t = 1 every reference token is masked: the table's loss is the mean CE over all of them,
    recomputed here from the logits (rows built by hand, the forward shared with the table). A model
    trained with aligned responses (`response_block_align` 8) is scored with its prompts padded to the
    block grid (lcm(8, 32) = 32), as the decoder pads them."""
    ckpt = trained_checkpoint()
    cfg, model = load_hf(ckpt)
    if align:
        model = nnx.clone(model)
        model.cfg = cfg = cfg.replace(response_block_align=align)
    ex = build_examples(load_tokenizer(ckpt), eval_records(4))  # the 4 rows of the calibrate run above
    rows = masked_loss_table(model, ex, LossEvalConfig(block_sizes=(32,), t_values=(1.0,), n=4), cfg.mask_token_id)
    starts = [len(e.prompt_ids) + (-len(e.prompt_ids) % 32 if align else 0) for e in ex]
    t = -(-max(s + len(e.reference_ids) for s, e in zip(starts, ex)) // 32) * 32
    ids = np.zeros((len(ex), t), np.int32)
    seg = np.zeros((len(ex), t), np.int32)
    for i, (s, e) in enumerate(zip(starts, ex)):
        doc = e.prompt_ids + [cfg.pad_token_id] * (s - len(e.prompt_ids)) + e.reference_ids
        ids[i, : len(doc)], seg[i, : len(doc)] = doc, 1
    noisy = ids.copy()
    for i, (s, e) in enumerate(zip(starts, ex)):
        noisy[i, s: s + len(e.reference_ids)] = cfg.mask_token_id
    logits = np.asarray(block_logits_fn(model)(ids, noisy, seg, 32), np.float64)
    nll = []
    for i, (s, e) in enumerate(zip(starts, ex)):
        for p in range(s, s + len(e.reference_ids)):
            lg = logits[i, p]
            nll.append(np.log(np.exp(lg - lg.max()).sum()) + lg.max() - lg[ids[i, p]])
    assert rows[0]["masked_tokens"] == len(nll)
    np.testing.assert_allclose(rows[0]["loss"], np.mean(nll), rtol=1e-4)
    if align:
        assert any(s > len(e.prompt_ids) for s, e in zip(starts, ex)), "no prompt needed padding"


def test_quality_metrics_on_hand_made_outputs():
    from clover_jax.decoding.metrics import (ar_agreement, bfcl_match, longest_repeated_run, repeated_ngram_rate,
                                          tool_call_validity, turn_match)

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {}, "unit": {}}, "required": ["city"]}}}]
    good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert tool_call_validity(good, tools, True)["valid"]
    assert not tool_call_validity(good.replace("get_weather", "get_time"), tools, True)["valid"]  # not offered
    assert not tool_call_validity(good.replace('"city"', '"unit"'), tools, True)["valid"]  # required arg missing
    assert not tool_call_validity(good[:-12], tools, True)["valid"]  # unclosed tag
    assert not tool_call_validity(good.replace("}}", "}"), tools, True)["valid"]  # broken JSON
    assert not tool_call_validity("Sure.", tools, True)["valid"]  # no call where one is expected
    assert tool_call_validity("Which city?", tools, False)["valid"]
    assert not tool_call_validity(good, tools, False)["valid"]
    ref = [{"name": "get_weather", "arguments": {"city": "paris", "unit": 20}}]
    assert bfcl_match(good.replace('"Paris"}', '"Paris ", "unit": 20.0}'), ref)  # case, space, int vs float
    assert not bfcl_match(good, ref)  # a missing argument
    assert not bfcl_match(good.replace("Paris", "Rome").replace('"}', '", "unit": 20}'), ref)
    # JSON types stay apart: a boolean is not the number 1 / 0, a numeric string is not a number
    flag = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": True}}]
    assert bfcl_match(good.replace('"}', '", "unit": true}'), flag)
    assert not bfcl_match(good.replace('"}', '", "unit": 1}'), flag)
    zero = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": 0}}]
    assert not bfcl_match(good.replace('"}', '", "unit": false}'), zero)
    assert not bfcl_match(good.replace('"}', '", "unit": "0"}'), zero)
    assert bfcl_match(good.replace('"}', '", "unit": 0.0}'), zero)
    # a turn without calls: only the reference's reply (stripped) matches
    assert turn_match(" None of the tools can do it.\n", [], "None of the tools can do it.")
    assert not turn_match("Sure.", [], "None of the tools can do it.")
    assert not turn_match(good, [], "None of the tools can do it.")
    assert turn_match(good, [{"name": "get_weather", "arguments": {"city": "Paris"}}], "")
    two = good + good.replace("Paris", "Rome")
    assert bfcl_match(two, [{"name": "get_weather", "arguments": {"city": "Rome"}},
                            {"name": "get_weather", "arguments": {"city": "Paris"}}])  # order free
    assert repeated_ngram_rate([1, 2, 3, 1, 2, 3], 3) == 1 / 4
    assert repeated_ngram_rate([1, 2], 3) == 0.0
    assert longest_repeated_run([5, 5, 1, 7, 7, 7, 2]) == 3 and longest_repeated_run([]) == 0
    assert ar_agreement([1, 2, 3], [1, 9, 3, 4]) == 2 / 4 and ar_agreement([], []) == 1.0


def test_quality_series_keeps_calibrations_apart_and_orders_by_threshold():
    """Hand-made sweep rows of one block size, learned gamma and gamma = 0, thresholds out of order:
    two series (never one zig-zag line), each ordered by threshold; AR rows are not a series."""
    from clover_jax.decoding.calibrate_plots import calibration_label, quality_series

    def row(th, gamma, tpf):
        return {"mode": "threshold", "block_size": 32, "sub_block_size": 0, "threshold": th, "gamma": gamma,
                "alpha_scale": 1.0, "beta_shift": 0.0, "tokens_per_forward": tpf, "validity": 1.0}

    rows = [row(0.99, "learned", 1.5), row(0.8, 0.0, 3.0), row(0.8, "learned", 2.9), row(0.99, 0.0, 1.4),
            {"mode": "ar", "block_size": 1, "threshold": 0.9, "tokens_per_forward": 1.0, "validity": 1.0}]
    s = quality_series(rows)
    assert list(s) == [("threshold", 32, 0, "gamma=0"), ("threshold", 32, 0, "learned")]
    assert [[r["threshold"] for r in v] for v in s.values()] == [[0.8, 0.99], [0.8, 0.99]]
    assert [r["tokens_per_forward"] for r in s[("threshold", 32, 0, "learned")]] == [2.9, 1.5]
    assert calibration_label({"gamma": 0.5, "alpha_scale": 2.0, "beta_shift": -1.0}) == "gamma=0.5, alpha x2, beta -1"


def test_fit_lowers_the_calibration_loss_and_never_reads_the_eval_split(tmp_path, capsys):
    """`calibrate --fit` on the tiny model (trained at block 32) for target block 8: the eval split is
    a path that does not exist (reading it would fail); the fitted gamma shift lowers the masked CE
    on the calibration split, and the checkpoint it writes carries gamma + delta in every head and
    gives that loss when evaluated directly (masked_loss_table on the reloaded model)."""
    from clover_jax.decoding.calibrate import scalar_table

    ckpt = trained_checkpoint()
    cal = write_eval_jsonl(tmp_path / "cal.jsonl", n=8, seed=777)
    out = tmp_path / "fit"
    rc = launch.main(["calibrate", "--fit", "--config", str(ROOT / "configs" / "calibrate_tiny.yaml"),
                      f"checkpoint={ckpt}", f"out_dir={out}", f"eval.path={tmp_path / 'no_such_eval.jsonl'}",
                      "eval.source=jsonl", f"fit.calibration={{source: jsonl, path: {cal}, n: 8}}",
                      "fit.block_sizes=[8]", "fit.t_values=[0.5]", "fit.n=8", "fit.deltas=[-2.0, 0.0, 2.0]",
                      "fit.refine_steps=4"])
    assert rc == 0, capsys.readouterr()
    fit = json.loads((out / "fit" / "fit.json").read_text())
    e = fit["targets"]["8"]
    assert e["loss_fitted"] < e["loss_learned"] and e["delta"] != 0.0, e
    base, tok = load_hf(ckpt)[1], load_tokenizer(ckpt)
    fitted = load_hf(e["checkpoint"])[1]
    for a, b in zip(scalar_table(base), scalar_table(fitted)):
        assert abs(b["gamma"] - (a["gamma"] + e["delta"])) < 1e-6 and (a["alpha"], a["beta"]) == (b["alpha"], b["beta"])
    examples = build_examples(tok, [json.loads(x) for x in cal.read_text().splitlines()])
    rows = masked_loss_table(fitted, examples, LossEvalConfig(block_sizes=(8,), t_values=(0.5,), n=8, seed=0),
                             fitted.cfg.mask_token_id)
    assert abs(rows[0]["loss"] - e["loss_fitted"]) <= 1e-5 * abs(e["loss_fitted"]), (rows, e)
