"""bench/load_memory.py at a tiny width (seconds per variant): it synthesises the checkpoint,
converts it to Orbax, runs the old and new start-ups each in its own process, and reports for each
the peak RSS over its base, the fp32 parameter bytes P (from the config's shapes) and a CRC of the
params: the old and new paths start from the same bytes, the streamed params are P bytes, and the
table and JSON are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_load_memory_bench_tiny(tmp_path):
    out = tmp_path / "load_memory.json"
    variants = ["old_init_state", "new_init_state", "new_init_state_orbax"]
    r = subprocess.run([sys.executable, str(ROOT / "bench/load_memory.py"), "--hidden", "64", "--vocab", "512",
                        "--experts", "4", "--moe-intermediate", "16", "--layers", "2", "--orbax",
                        "--work-dir", str(tmp_path), "--out-json", str(out), "--variants", *variants],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = res["variants"]
    assert list(rows) == variants and "target host <= 1.3 P + L" in r.stdout
    # P by hand: hidden 64, vocab 512 (embed + head), 2 GDN layers of the Qwen3.6 head layout
    # (16 key heads x 128, 32 value heads x 128, conv 4 taps), 4 experts x 16, shared 16, block mode
    d, v, kd, vd, nv, k, e, i = 64, 512, 2048, 4096, 32, 4, 4, 16
    gdn = 2 * d * kd + 2 * d * vd + 2 * d * nv + k * (2 * kd + vd) + 2 * nv + 128 + vd * d + nv * 3 \
        + (k - 1) * (2 * kd + vd)
    moe = d * e + 3 * e * d * i + 3 * d * i + d
    layer = 2 * d + gdn + moe
    assert res["params_fp32_bytes"] == 4 * (2 * v * d + d + 2 * layer)
    assert res["largest_layer_fp32_bytes"] == 4 * layer
    for name, row in rows.items():
        assert row["peak_rss"] >= row["base_rss"] > 0, name
        assert row["params_global_bytes"] == res["params_fp32_bytes"], name  # every param, fp32
    assert len({row["params_crc"] for row in rows.values()}) == 1  # old == new == from Orbax
