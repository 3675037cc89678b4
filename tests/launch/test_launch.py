"""launch.py, in-process (`launch.main([...])`) plus one real subprocess for `--help`.

The demo test runs the whole embedded default job (the 248320-row vocabulary makes it the slowest test
here); its tokenizer build goes to a module-scoped tmp `CLOVER_JAX_CACHE`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import launch
from tests.launch.launch_utils import run_main as _main
from clover_jax.bridge import tokenizer as T
from clover_jax.config import ModelConfig
from tests.hf_fixtures import (
    TINY_HF_CONFIG, assert_tensors_identical, make_hf_model, read_all_tensors, write_save_pretrained,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny transformers `save_pretrained` dir (per-expert layout, prefix `model.`)."""
    return write_save_pretrained(make_hf_model(seed=0), tmp_path_factory.mktemp("hf") / "src")


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax") / "ckpt"
    assert launch.main(["convert", "--hf", str(hf_dir), "--out", str(out)]) == 0
    return out


def test_help_subprocess():
    p = subprocess.run([sys.executable, "launch.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    for cmd in ("demo", "convert", "export", "sft", "generate", "calibrate", "compile"):
        assert cmd in p.stdout


def test_convert_then_export_is_byte_identical(hf_dir, converted, tmp_path, capsys):
    capsys.readouterr()
    exp = tmp_path / "export"
    rc, out, err = _main(["export", "--checkpoint", str(converted), "--out", str(exp)], capsys)
    assert rc == 0, err
    assert str(exp) in out
    assert_tensors_identical(read_all_tensors(hf_dir), read_all_tensors(exp))
    # the exported config describes the same model as the source's
    assert ModelConfig.from_hf_file(exp) == ModelConfig.from_hf_file(hf_dir)
    exported = json.loads((exp / "config.json").read_text())
    for k in ("hidden_size", "num_hidden_layers", "layer_types", "num_experts", "vocab_size"):
        assert exported[k] == TINY_HF_CONFIG[k], k


def test_export_refuses_existing_out_dir(converted, tmp_path, capsys):
    exp = tmp_path / "export"
    argv = ["export", "--checkpoint", str(converted), "--out", str(exp)]
    assert _main(argv, capsys)[0] == 0
    before = read_all_tensors(exp)
    rc, _, err = _main(argv, capsys)
    assert rc == 1
    assert "error:" in err and str(exp) in err
    assert_tensors_identical(before, read_all_tensors(exp))  # untouched
    rc, _, err = _main(argv + ["--overwrite"], capsys)
    assert rc == 0, err


def test_export_clover_format(converted, tmp_path, capsys):
    """`--format clover` of an AR checkpoint writes a `clover_moe` dir (its Clover tensors at their init
    values; the format itself is tested in tests/bridge/test_clover_format.py)."""
    exp = tmp_path / "clover"
    rc, _, err = _main(["export", "--checkpoint", str(converted), "--out", str(exp), "--format", "clover"],
                       capsys)
    assert rc == 0, err
    assert json.loads((exp / "config.json").read_text())["model_type"] == "clover_moe"
    assert ModelConfig.from_hf_file(exp).mode == "block"
    names = read_all_tensors(exp)
    assert "model.layers.0.linear_attn.bd_softmax_logit_scale" in names  # the default: split naming
    assert not [n for n in names if "bd_gdn_" in n]


def test_convert_refuses_existing_checkpoint(hf_dir, converted, capsys):
    rc, _, err = _main(["convert", "--hf", str(hf_dir), "--out", str(converted)], capsys)
    assert rc == 1 and str(converted) in err


def test_convert_missing_dir(tmp_path, capsys):
    missing = tmp_path / "no_such_hf_dir"
    rc, _, err = _main(["convert", "--hf", str(missing), "--out", str(tmp_path / "out")], capsys)
    assert rc == 1
    assert "error:" in err and str(missing) in err
    assert not (tmp_path / "out").exists()


def test_export_missing_checkpoint(tmp_path, capsys):
    missing = tmp_path / "no_such_ckpt"
    rc, _, err = _main(["export", "--checkpoint", str(missing), "--out", str(tmp_path / "out")], capsys)
    assert rc == 1 and str(missing) in err


def test_generate_and_calibrate_are_commands(capsys):
    """No command is pending any more: generate / calibrate parse their own options (argparse names
    the missing required one)."""
    for name, required in (("generate", "--checkpoint"), ("calibrate", "--config")):
        rc, _, err = _main([name], capsys)
        assert rc == 2 and required in err and "not available yet" not in err


def test_demo_bad_override_exits_1(capsys):
    rc, _, err = _main(["demo", "--config", str(ROOT / "configs" / "demo.yaml"), "demo.max_new_token=2"],
                       capsys)
    assert rc == 1 and "'demo.max_new_tokens'" in err


@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("clover_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLOVER_JAX_CACHE", str(root))
        T.clear_tokenizer_cache()
        yield root
    T.clear_tokenizer_cache()


def test_demo_end_to_end(tokenizer_cache, tmp_path, capsys):
    out_dir = tmp_path / "demo"
    rc, out, err = _main(["demo", "--config", str(ROOT / "configs" / "demo.yaml"), f"demo.out_dir={out_dir}",
                          "demo.max_new_tokens=2"], capsys)
    assert rc == 0, out[-3000:] + err[-3000:]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["tensors_differing"] == []
    assert summary["tensors"] > 0 and summary["max_logit_diff"] == 0.0
    assert summary["cached_equals_recomputed"] is True
    assert len(summary["generated_ids"]) == 2
    assert (tokenizer_cache / T.CACHE_NAME / "tokenizer.json").is_file()  # built into our cache
    src, exp = out_dir / "hf_source", out_dir / "hf_export"
    # independent of the demo's own comparison: every tensor file read with safetensors.numpy
    assert_tensors_identical(read_all_tensors(src), read_all_tensors(exp))
    assert (exp / "tokenizer.json").is_file() and (exp / "config.json").is_file()
    cfg = ModelConfig.from_hf_file(exp)
    assert cfg.vocab_size == 248320 and cfg.num_hidden_layers == 4
