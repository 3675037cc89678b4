"""bench/gdn_decode_step.py at tiny shapes: the recurrent one-token step (what the model's cached
one-token extend runs) computes what the chunked reference computes (the independent oracle: the
chunked WY form, tests/kernels/gdn/test_reference.py), and the script writes its table's JSON."""

from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.bench.bench_import import bench_module  # noqa: E402


def test_one_token_step_matches_the_chunked_form_and_is_recorded(tmp_path):
    out = tmp_path / "r.json"
    report = bench_module("gdn_decode_step").main(["--batches", "1", "3", "--heads", "4", "--key-heads", "2", "--dk", "16",
                                                   "--dv", "32", "--chunk", "16", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert [r["B"] for r in report["rows"]] == [1, 3]
    for r in report["rows"]:
        assert set(r["ms"]) == {"recurrent", "chunked"} and all(t > 0 for t in r["ms"].values())
        o_diff, state_diff = r["max_diff_o_state"]["chunked"]
        assert o_diff <= 2 ** -8 and state_diff <= 1e-5, r  # o in bf16 (values ~1), the state fp32
