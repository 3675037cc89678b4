"""The calibration study's arithmetic on hand-made rows (penalty = quality at B' of the model trained
at B minus the native model's at B'; recovery = the share of it a calibration wins back), and the
report generator on a tiny run of made-up rows: the numbers it states are the table's."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clover_jax.decoding.study_report import (ar_quality, native_by_threshold, penalty_matrix, recovery, summarize,
                                              write_report)

# validity of models trained at 8 / 32 and on the mix, decoded at 8 / 32, learned and gamma = 0
Q = {(8, 8, "learned"): 0.9, (8, 32, "learned"): 0.5, (32, 8, "learned"): 0.2, (32, 32, "learned"): 1.0,
     ("mix", 8, "learned"): 0.85, ("mix", 32, "learned"): 0.95,
     (8, 32, 0.0): 0.7, (32, 8, 0.0): 0.2, (8, 8, 0.0): 0.8, (32, 32, 0.0): 0.9}


def _rows(threshold=0.9):
    rows = [{"mode": "threshold", "trained": t, "block_size": d, "threshold": threshold, "gamma": g,
             "alpha_scale": 1.0, "beta_shift": 0.0, "validity": v, "tokens_per_forward": 1 + d / 16}
            for (t, d, g), v in Q.items()]
    rows.append({"mode": "ar", "trained": 32, "block_size": 1, "threshold": threshold, "gamma": "learned",
                 "validity": 1.0, "tokens_per_forward": 1.0})
    return rows


def test_penalty_and_recovery_by_hand():
    pen = penalty_matrix(_rows(), "validity", 0.9)
    assert pen[(8, 8)] == 0 and pen[(32, 32)] == 0
    assert pen[(8, 32)] == pytest.approx(0.5 - 1.0) and pen[(32, 8)] == pytest.approx(0.2 - 0.9)
    assert pen[("mix", 8)] == pytest.approx(-0.05) and pen[("mix", 32)] == pytest.approx(-0.05)
    rec = recovery(_rows(), "validity", 0.9, "gamma=0")
    # (8 at 32): (0.7 - 0.5) / 0.5 = 40%; (32 at 8): no change = 0%; the mix cells' 0.05 penalties are
    # kept (>= 0.02) but have no gamma = 0 row; the diagonal never counts
    assert rec == {(8, 32): pytest.approx(0.4), (32, 8): pytest.approx(0.0)}
    s = summarize(_rows(), "validity", 0.9)
    assert s["mean_penalty"] == pytest.approx((-0.5 - 0.7) / 2) and s["worst_penalty"] == pytest.approx(-0.7)
    assert s["recovery"] == {"gamma=0": pytest.approx(0.2)} and s["mix_mean_vs_native"] == pytest.approx(-0.05)
    # a cell that beats its native model has no penalty to recover: mix at 32 above native 32's 1.0
    better = _rows() + [{"mode": "threshold", "trained": "mix", "block_size": 32, "threshold": 0.9, "gamma": 0.0,
                         "alpha_scale": 1.0, "beta_shift": 0.0, "validity": 0.9, "tokens_per_forward": 3.0}]
    for r in better:
        if r["trained"] == "mix" and r["block_size"] == 32 and r["gamma"] == "learned":
            r["validity"] = 1.1
    assert penalty_matrix(better, "validity", 0.9)[("mix", 32)] == pytest.approx(0.1)
    assert ("mix", 32) not in recovery(better, "validity", 0.9, "gamma=0")
    assert penalty_matrix(_rows(), "validity", 0.95) == {}  # no rows at that threshold
    with pytest.raises(ValueError, match="two rows for trained 8, block 8"):
        penalty_matrix(_rows() + _rows()[:1], "validity", 0.9)


def test_report_states_the_tables_numbers(tmp_path):
    md = write_report(tmp_path, _rows(), quality="validity", threshold=0.9,
                      command="python launch.py calibrate --config configs/calibration_study.yaml")
    text = md.read_text()
    assert "configs/calibration_study.yaml" in text and "changes tool-call validity (fraction of turns) by -0.600" in text
    assert "| 8 | +0.000 | -0.500 |" in text and "| 32 | -0.700 | +0.000 |" in text and "| mix | -0.050 | -0.050 |" in text
    assert "gamma=0: +20% of the penalty (2 cells)" in text and "| 8 |  | +40% |" in text
    # the absolute numbers behind the penalty (validity, tokens per forward = 1 + d / 16), the AR ceiling,
    # and each model at its own size (thresholds 0.9 here, 0.8 in the extra rows below)
    assert "| 8 | 0.900 | 0.500 |" in text and "| mix | 0.850 | 0.950 |" in text
    assert "| 32 | 1.50 | 3.00 |" in text and "trained 32 1.000." in text
    assert "| 8 | 0.900 @ 1.50 |" in text and "| 32 | 1.000 @ 3.00 |" in text
    for png in ("penalty_matrix.png", "trained_8/quality_vs_speed.png", "trained_mix/quality_vs_speed.png"):
        assert (tmp_path / png).stat().st_size > 0 and png in text
    assert not math.isnan(summarize(_rows(), "validity", 0.9)["mean_penalty"])


def test_report_tables_the_history_share_and_plots_it_by_position(tmp_path):
    """Rows that carry the history unit's share (mean, and per GDN layer x position inside the block)
    get a share table (trained x decoded, learned calibration) and a share-vs-position plot per model."""
    rows = _rows()
    for r in rows:
        if r["mode"] == "threshold":
            k = r["block_size"]
            r["history_share_mean"] = 0.5 + k / 100 + (0.1 if r["trained"] == "mix" else 0.0)
            r["history_share_L0"] = r["history_share_mean"]
            r["history_share_by_position"] = [[r["history_share_mean"] * (j + 1) / k for j in range(k)]]
    md = write_report(tmp_path, rows, quality="validity", threshold=0.9, command="cmd")
    text = md.read_text()
    assert "## History-unit softmax share" in text
    assert "| 8 | 0.580 | 0.820 |" in text and "| mix | 0.680 | 0.920 |" in text
    for png in ("trained_8/history_position.png", "trained_32/history_share.png"):
        assert (tmp_path / png).stat().st_size > 0 and png in text
    no_share = write_report(tmp_path / "plain", _rows(), quality="validity", threshold=0.9, command="cmd").read_text()
    assert "History-unit" not in no_share and not (tmp_path / "plain" / "trained_8" / "history_position.png").exists()


def test_native_sizes_by_threshold_and_the_ar_ceiling():
    rows = _rows(0.9) + [r for r in _rows(0.8) if r["mode"] == "threshold"]
    for r in rows:
        if r["threshold"] == 0.8:
            r["validity"] -= 0.1
    native = native_by_threshold(rows, "validity")
    # diagonal, learned calibration only: trained 8 at 8, 32 at 32; the mix has no size of its own
    assert native == {(8, 0.9): (0.9, 1.5), (32, 0.9): (1.0, 3.0),
                      (8, 0.8): (pytest.approx(0.8), 1.5), (32, 0.8): (pytest.approx(0.9), 3.0)}
    assert ar_quality(rows, "validity") == {32: 1.0}


def test_report_lists_the_ar_ceilings_by_block_size_mix_last(tmp_path):
    rows = _rows() + [{"mode": "ar", "trained": t, "block_size": 1, "threshold": 0.9, "gamma": "learned",
                       "validity": v, "tokens_per_forward": 1.0} for t, v in (("mix", 0.97), (8, 0.99))]
    text = write_report(tmp_path, rows, quality="validity", threshold=0.9, command="cmd").read_text()
    assert "of the same models: trained 8 0.990, trained 32 1.000, trained mix 0.970." in text


def test_intervals_by_hand():
    """t-intervals over seeds (t quantiles from the table: t(0.975, 1) = 12.7062, t(0.975, 2) = 4.30265),
    Welch-Satterthwaite for a difference of two models, and the percentile bootstrap against the exact
    resampling distribution."""
    from clover_jax.decoding.study_stats import Interval, bootstrap_indices, bootstrap_interval, t_interval

    lo, hi = t_interval([[0.6, 0.7, 0.8]])  # mean 0.7, sd 0.1
    assert (lo, hi) == (pytest.approx(0.7 - 4.30265 * 0.1 / 3**0.5, abs=1e-5), pytest.approx(0.7 + 0.248415, abs=1e-5))
    # model A [0.5, 0.7] minus model B [0.1, 0.3]: se^2 = 0.01 + 0.01, df = 0.02^2 / (0.01^2 + 0.01^2) = 2
    lo, hi = t_interval([[0.5, 0.7], [-0.1, -0.3]])
    assert (lo, hi) == (pytest.approx(0.4 - 4.30265 * 0.02**0.5, abs=1e-5), pytest.approx(0.4 + 0.608494, abs=1e-5))
    assert t_interval([[0.5, 0.7], [0.3]]) is None  # a model with one seed: no interval over seeds
    assert t_interval([[0.5, 0.5], [0.2, 0.2]]) == (pytest.approx(0.7), pytest.approx(0.7))
    # 4 prompts scored 1, 1, 0, 1: a resample's mean is Binomial(4, 3/4) / 4, P(0) = 1/256, P(1/4) = 12/256,
    # P(1) = 81/256: the 2.5% and 97.5% points are 1/4 and 1
    idx = bootstrap_indices(4)
    assert bootstrap_interval(np.asarray([1.0, 1.0, 0.0, 1.0])[idx].mean(axis=1)) == (0.25, 1.0)
    assert Interval(-0.5, (-0.9, -0.1), (-0.8, -0.2)).separated
    assert not Interval(-0.5, (-0.9, 0.1), (-0.8, -0.2)).separated and Interval(-0.5, (-0.9, 0.1), (-0.8, -0.2)).prompts_only
    assert not Interval(-0.5, None, (-0.8, -0.2)).separated and Interval(-0.5, None, (-0.8, -0.2)).prompts_only


def _seeded_rows():
    """Models 8 and 32, three seeds each, decoded at 8 and 32 on 4 prompts (per-prompt scores):
    each native, all right; 32 at 8 right on prompt 0 in seed 1 only; 8 at 32 right on prompts 0, 1."""
    per = {(8, 8): [[1, 1, 1, 1]] * 3, (32, 32): [[1, 1, 1, 1]] * 3, (8, 32): [[1, 1, 0, 0]] * 3,
           (32, 8): [[0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]}
    rows = []
    for (t, d), seeds in per.items():
        for s, v in enumerate(seeds):
            rows.append({"mode": "threshold", "trained": t, "seed": s, "block_size": d, "threshold": 0.9,
                         "gamma": "learned", "alpha_scale": 1.0, "beta_shift": 0.0, "validity": sum(v) / 4,
                         "tokens_per_forward": 2.0, "per_prompt": {"validity": v, "tokens": [2, 4, 2, 4], "nfe": [1, 2, 1, 2]}})
    return rows


def test_report_cells_are_means_over_seeds_with_hand_computed_intervals(tmp_path):
    """32 at 8: seeds 0, 0.25, 0 (mean 1/12, sd 0.1443: +-4.30265 * 0.0833 = 0.359 over seeds); over
    prompts, a resample's mean is k/12 with k ~ Binomial(4, 1/4) (copies of prompt 0): P(k = 0) =
    0.32, P(k >= 3) = 0.051 > 2.5% > P(k = 4): the interval is [0, 3/12], half-width 0.125. Its penalty
    against native 8 (1.0 in every seed and prompt) is those minus 1: separated (*). 8 at 32 is 0.5 in
    every seed (seed interval of width 0) but its prompt interval [-1, 0] (P(all four right) = 1/16)
    holds 0: not separated."""
    text = write_report(tmp_path, _seeded_rows(), quality="validity", threshold=0.9, command="cmd").read_text()
    assert "| 32 | -0.917 ±0.359 (±0.125)\\* | +0.000 |" in text
    assert "| 8 | +0.000 | -0.500 ±0.000 (±0.500) |" in text
    assert "| 32 | 0.083 ±0.359 (±0.125) | 1.000 ±0.000 (±0.000) |" in text
    assert "| 8 | 2.00 ±0.00 (±0.00) | 2.00 ±0.00 (±0.00) |" in text  # tokens / forward: 2 on every resample
    assert "The intervals separate 1 of 2 differences: 32 vs native 8 at block 8 (-0.917)." in text
    assert penalty_matrix(_seeded_rows(), "validity", 0.9)[(32, 8)] == pytest.approx(1 / 12 - 1)
    with pytest.raises(ValueError, match=r"two rows for trained 8, block 8, threshold 0.9, calibration 'learned', seed 2"):
        penalty_matrix(_seeded_rows() + _seeded_rows()[2:3], "validity", 0.9)
