"""sft.remote.localize on the research recipe with every path in a bucket (etils' local backend
stands in for it, as in tests/train/test_remote.py): the data and init checkpoint are staged and
the sources point into the copy (the data-root check passes on it), the run dir is a local mirror
holding the run's earlier files, checkpoints stay in the bucket, the export is written locally; the
outputs go back to the bucket with summary.json / config.json last and the checkpoints left alone.
A config without URIs comes back unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from etils.epath import testing as epath_testing

from sft.config import check_data_root, load_sft_config
from sft.remote import localize

ROOT = Path(__file__).resolve().parents[2]
BFCL = ROOT.parent / "shared" / "data" / "bfcl" / "BFCL_v4_simple_python.json"


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # gs://b/x is ./gs:/b/x under the mock
    with epath_testing.mock_epath():
        yield tmp_path


def test_localize_stages_inputs_mirrors_the_run_and_publishes(bucket):
    tmp = bucket
    data = tmp / "gs:/b/data/bfcl"
    data.mkdir(parents=True)
    (data / BFCL.name).write_bytes(BFCL.read_bytes())
    run = tmp / "gs:/b/run"
    (run / "checkpoints/100").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 100}\n')
    cfg = load_sft_config(ROOT / "configs" / "research_tool.yaml", [
        "data_root=gs://b/data", "logging.run_dir=gs://b/run", "export.dir=gs://b/export",
        f"staging_dir={tmp / 'staging'}"])
    assert cfg.data_root == "gs://b/data" and cfg.data.sources[0].path == "gs://b/data/bfcl/" + BFCL.name
    assert cfg.checkpoint_dir == "gs://b/run/checkpoints"

    local, outputs = localize(cfg)
    assert Path(local.data_root).parent == tmp / "staging"
    src = Path(local.data.sources[0].path)
    assert src == Path(local.data_root) / "bfcl" / BFCL.name and src.read_bytes() == BFCL.read_bytes()
    check_data_root(local)  # the recipe's own check passes on the copy
    assert local.checkpoint.dir == "gs://b/run/checkpoints"  # Orbax writes the bucket itself
    mirror = Path(local.logging.run_dir)
    assert (mirror / "metrics.jsonl").read_text() == '{"step": 100}\n' and not (mirror / "checkpoints").exists()
    assert not Path(local.export.dir).exists() and local.export.overwrite

    # the run writes its files locally; publishing sends them back (checkpoints are Orbax's)
    (mirror / "metrics.jsonl").write_text('{"step": 100}\n{"step": 200}\n')
    (mirror / "summary.json").write_text(json.dumps({"steps": 200}))
    Path(local.export.dir).mkdir(parents=True)
    (Path(local.export.dir) / "config.json").write_text("{}")
    (Path(local.export.dir) / "model.safetensors").write_bytes(b"w")
    said: list[str] = []
    outputs.publish(print_fn=said.append)
    assert (run / "metrics.jsonl").read_text().count("step") == 2 and (run / "summary.json").is_file()
    assert (tmp / "gs:/b/export/config.json").is_file() and (tmp / "gs:/b/export/model.safetensors").read_bytes() == b"w"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["100"]
    assert any("gs://b/export" in s for s in said) and any("gs://b/run" in s for s in said)


def test_local_config_is_unchanged(tmp_path):
    cfg = load_sft_config(ROOT / "configs" / "research_tool.yaml", [f"logging.run_dir={tmp_path / 'run'}"])
    local, outputs = localize(cfg)
    assert local == cfg and outputs.run_dir is None and outputs.export_dir is None
