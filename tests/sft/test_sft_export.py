"""HF exports (clover_jax.bridge.convert, sft.export, sft.train_checkpoint): atomic, never replacing
another model's folder by accident, never holding NaN; exports and generation from an SFT training
checkpoint.

Bridge level (a tiny random model, no training): a failure in the tokenizer write or a NaN weight
leaves the target exactly as it was and no temp dir behind; a non-empty target is refused, and with
`overwrite` replaced whole (no file of the other model survives).

Recipe level: `export.dir` null follows `logging.run_dir`; a folder that is not this run's export
is refused before training; one short in-process SFT run (2 steps), whose final checkpoint goes
through `launch.py export` (tensors equal to the run's own export, and the run may replace its own
export on a rerun) and `launch.py generate` (the same tokens as generating from the run's export).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from clover_jax.bridge import convert
from clover_jax.bridge.safetensors_io import CheckpointError, SafetensorsIndex
from clover_jax.yaml_config import ConfigError
from tests.launch.launch_utils import run_main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "sft_tiny.yaml"


# ---------------------------------------------------------------------------------------------- bridge
@pytest.fixture(scope="module")
def tiny():
    """(ModelConfig, per-layer numpy tree) of a small random model (vocabulary 128)."""
    from clover_jax.config import ModelConfig
    from clover_jax.model.clover_model import create_model, model_to_params
    from clover_jax.model.params import unstack_layers

    cfg = ModelConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                      layer_types=("linear_attention", "full_attention"), num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=8, linear_value_head_dim=12, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_intermediate_size=12, max_position_embeddings=256,
                      mode="ar")
    import jax

    tree = unstack_layers(cfg, jax.device_get(model_to_params(create_model(cfg, seed=0))))
    return cfg, tree


def _source(tmp: Path) -> Path:
    """A source dir whose tokenizer files the export copies verbatim (format qwen)."""
    src = tmp / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(128)}}}))
    (src / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    return src


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _temp_siblings(d: Path) -> list[str]:
    return [p.name for p in d.parent.iterdir() if p.name.startswith(f".{d.name}.")]


def test_failed_tokenizer_write_leaves_the_target_as_it_was(tiny, tmp_path, monkeypatch):
    cfg, tree = tiny
    src, out, fresh = _source(tmp_path), tmp_path / "out", tmp_path / "fresh"
    convert.write_hf(cfg, tree, out, format="qwen", source_dir=src)
    before = _snapshot(out)
    real = convert.shutil.copyfile

    def torn_copy(a, b, *args, **kw):  # the disk fills up half-way through tokenizer.json
        if Path(a).name == "tokenizer.json":
            Path(b).write_bytes(Path(a).read_bytes()[:10])
            raise OSError(28, "No space left on device")
        return real(a, b, *args, **kw)

    monkeypatch.setattr(convert.shutil, "copyfile", torn_copy)
    for target, overwrite in ((out, True), (fresh, False)):
        with pytest.raises(OSError, match="No space left"):
            convert.write_hf(cfg, tree, target, format="qwen", source_dir=src, overwrite=overwrite)
        assert _temp_siblings(target) == []
    assert _snapshot(out) == before  # the previous export, byte for byte
    assert not fresh.exists()  # no weights without their tokenizer
    monkeypatch.setattr(convert.shutil, "copyfile", real)
    convert.write_hf(cfg, tree, fresh, format="qwen", source_dir=src)
    assert _snapshot(fresh) == before


def test_a_killed_exports_temp_dir_is_cleaned_up_by_the_next_one(tiny, tmp_path):
    import socket

    cfg, tree = tiny
    out = tmp_path / "out"
    dead = 2**22 + 12345  # above the default pid_max: no process has it
    stale = tmp_path / f".out.partial-{socket.gethostname().replace('-', '_')}-{dead}-deadbeef"
    stale.mkdir()
    (stale / "model.safetensors.partial").write_bytes(b"x")
    other_host = tmp_path / f".out.partial-otherhost-{dead}-cafecafe"
    other_host.mkdir()
    convert.write_hf(cfg, tree, out, format="qwen")
    assert not stale.exists() and other_host.exists()  # another host's writer may be alive


def test_non_finite_weight_refused_naming_the_tensor(tiny, tmp_path):
    cfg, tree = tiny
    out = tmp_path / "out"
    convert.write_hf(cfg, tree, out, format="qwen")
    before = _snapshot(out)
    bad = {**tree, "layers": [dict(layer) for layer in tree["layers"]]}
    attn = dict(bad["layers"][1]["attn"])
    q = np.array(attn["q_proj"]["kernel"])
    q[3, 5] = np.nan
    attn["q_proj"] = {**attn["q_proj"], "kernel": q}
    bad["layers"][1] = {**bad["layers"][1], "attn": attn}
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.1\.self_attn\.q_proj\.weight' holds 1 "
                                              r"non-finite values") as e:
        convert.write_hf(cfg, bad, out, format="qwen", overwrite=True)
    assert len(str(e.value).splitlines()) == 1
    assert _snapshot(out) == before and _temp_siblings(out) == []
    bad["embed"] = {"embedding": np.full_like(tree["embed"]["embedding"], np.inf)}
    with pytest.raises(CheckpointError, match="embed_tokens.weight' holds"):
        convert.write_hf(cfg, bad, tmp_path / "new", format="qwen")
    assert not (tmp_path / "new").exists()


def test_non_empty_target_refused_and_overwrite_replaces_it_whole(tiny, tmp_path):
    cfg, tree = tiny
    src, out, ref = _source(tmp_path), tmp_path / "out", tmp_path / "ref"
    out.mkdir()
    other = ("pytorch_model.bin", "tokenizer.model", "vocab.json", "merges.txt", "special_tokens_map.json",
             "model.safetensors")
    for name in other:
        (out / name).write_text("another model's " + name)
    with pytest.raises(CheckpointError, match=f"{out}: exists and is not empty .*pass overwrite=True"):
        convert.write_hf(cfg, tree, out, format="qwen", source_dir=src)
    assert sorted(p.name for p in out.iterdir()) == sorted(other)
    convert.write_hf(cfg, tree, out, format="qwen", source_dir=src, overwrite=True)
    convert.write_hf(cfg, tree, ref, format="qwen", source_dir=src)
    assert _snapshot(out) == _snapshot(ref)  # exactly a fresh export: nothing of the other model left
    (tmp_path / "empty").mkdir()
    convert.write_hf(cfg, tree, tmp_path / "empty", format="qwen")  # an empty folder is not "another model"


# ---------------------------------------------------------------------------------------------- config
def test_export_dir_follows_the_run_dir():
    from sft.config import load_sft_config

    cfg = load_sft_config(TINY, ["logging.run_dir=runs/other"])
    assert cfg.export_dir == "runs/other/hf_export" and cfg.export.overwrite is False
    assert load_sft_config(TINY).export_dir == "runs/sft_tiny/hf_export"
    assert load_sft_config(TINY, ["export.dir=elsewhere/hf"]).export_dir == "elsewhere/hf"
    assert load_sft_config(TINY, ["export.enabled=false"]).export_dir is None


def test_launch_sft_refuses_a_folder_it_may_not_replace_before_training(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "hf_export").mkdir(parents=True)
    (run / "hf_export" / "notes.txt").write_text("mine")
    rc, _, err = run_main(["sft", "--config", str(TINY), f"logging.run_dir={run}", "model.init_from=null",
                           "model.generate_missing=false", "train.steps=1"], capsys)
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert f"export.dir: {run / 'hf_export'} is not empty" in err and "export.overwrite=true" in err
    assert (run / "hf_export" / "notes.txt").read_text() == "mine"
    assert not (run / "metrics.jsonl").exists() and not list((run / "checkpoints").glob("[0-9]*"))  # no step ran


# ---------------------------------------------------------------------------------------------- a run
STEPS = 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One in-process SFT run of configs/sft_tiny.yaml shrunk to 2 layers and 2 steps, fp32 export."""
    from sft.config import load_sft_config
    from sft.recipe import run_sft

    tmp = tmp_path_factory.mktemp("sft_export")
    run = tmp / "run"
    over = [f"model.init_from={run / 'init_hf'}", "model.num_hidden_layers=2", f"logging.run_dir={run}",
            "data.seq_len=64", "data.batch_size=2", "data.sources=[{name: synthetic, format: synthetic, options: "
            "{n_records: 60, seed: 0}}]", f"train.steps={STEPS}", "train.eval_every=0", "checkpoint.every_steps=0",
            "logging.console_every=0", "logging.progress='off'", "logging.wandb.mode=disabled", "export.dtype=float32",
            "count_flops=false", "devices=1"]
    cfg = load_sft_config(TINY, over)
    res = run_sft(cfg, print_fn=lambda s: None)
    assert res.step == STEPS and res.export_dir == run / "hf_export"
    return cfg, run, res


def _tensors(d: Path) -> dict[str, np.ndarray]:
    idx = SafetensorsIndex(d)
    return {k: np.asarray(idx.get(k)) for k in idx.keys()}


def test_export_from_a_training_checkpoint_equals_the_runs_export(trained, tmp_path, capsys):
    from sft.export import check_export_target
    from sft.train_checkpoint import training_step_dir

    cfg, run, res = trained
    info = convert.read_export_info(res.export_dir)
    assert info["run_dir"] == str(run.absolute()) and info["step"] == STEPS
    # a rerun of this run (it resumes from its final checkpoint and exports again) may replace it ...
    assert check_export_target(cfg) is True
    # ... another run into the same folder may not
    other = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, run_dir=str(tmp_path / "other")))
    with pytest.raises(ConfigError, match="is the export of another run"):
        check_export_target(other, res.export_dir)
    # the checkpoints dir stands for its newest step
    assert training_step_dir(run / "checkpoints") == run / "checkpoints" / str(STEPS)
    out = tmp_path / "out"
    rc, stdout, err = run_main(["export", "--checkpoint", str(run / "checkpoints"), "--out", str(out)], capsys)
    assert rc == 0, err
    got, want = _tensors(out), _tensors(res.export_dir)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (res.export_dir / name).read_bytes(), name
    rc, _, err = run_main(["export", "--checkpoint", str(run / "checkpoints" / str(STEPS)), "--out", str(out)], capsys)
    assert rc == 1 and "is not empty" in err and "overwrite" in err  # the CLI: only with --overwrite


def test_generate_from_a_training_checkpoint(trained, tmp_path, capsys):
    cfg, run, res = trained
    outs = []
    for ckpt in (run / "checkpoints", res.export_dir):
        out = tmp_path / f"{ckpt.name}.json"
        rc, _, err = run_main(["generate", "--checkpoint", str(ckpt), "--prompt", "What's the weather in Oslo?",
                               "--no-stream", "--out", str(out), "decode.max_new_tokens=32", "decode.fast_compile=true"],
                              capsys)
        assert rc == 0, err
        outs.append(json.loads(out.read_text()))
    # the checkpoint decodes to what its fp32 export decodes to
    assert outs[0][0]["token_ids"] == outs[1][0]["token_ids"] and len(outs[0][0]["token_ids"]) > 0
