"""The calibration study's arithmetic on hand-made rows (penalty = quality at B' of the model trained
at B minus the native model's at B'; recovery = the share of it a calibration wins back), and the
report generator on a tiny run of made-up rows: the numbers it states are the table's."""

from __future__ import annotations

import math

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
