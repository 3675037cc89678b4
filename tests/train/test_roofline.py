"""The roofline arithmetic (`train.roofline`), by hand."""

import pytest

from train.roofline import CHIPS, roofline


def test_step_time_is_the_longest_bound_and_gives_tokens_and_mfu():
    v5p = CHIPS["v5p"]
    r = roofline("v5p", flops=0.010 * 459e12, hbm_bytes=0.020 * 2765e9, ici_bytes=0.005 * 1200e9,
                 tokens_per_step=100_000, chips=4, model_flops=0.5 * 4 * 0.020 * 459e12)
    assert (r.compute_s, r.hbm_s, r.ici_s) == pytest.approx((0.010, 0.020, 0.005))
    assert r.step_s == pytest.approx(0.020) and r.bound == "HBM bandwidth"
    assert r.tokens_per_s == pytest.approx(5e6)
    assert r.mfu == pytest.approx(0.5)  # model FLOPs = half of 4 chips x 20 ms at peak
    text = "\n".join(r.lines())
    assert "PREDICTION" in text and "not a measurement" in text and "HBM bandwidth" in text
    assert r.as_dict()["note"] == "roofline prediction, not a measurement"
    assert v5p.peak_flops == 459e12


def test_chip_table_figures():
    want = {"v5p": (459, 2765, 1200), "v5e": (197, 819, 400), "v6e": (918, 1638, 800), "h100": (989, 3350, 900),
            "h200": (989, 4800, 900)}
    for k, (tf, hbm, ici) in want.items():
        c = CHIPS[k]
        assert (c.peak_flops, c.hbm_bandwidth, c.ici_bandwidth) == (tf * 1e12, hbm * 1e9, ici * 1e9), k
    r = roofline("H200", flops=989e12, hbm_bytes=0, ici_bytes=2 * 900e9, tokens_per_step=1, chips=1, model_flops=0)
    assert r.bound == "interconnect" and r.step_s == pytest.approx(2.0)
