"""clover_jax.run_config: YAML + `base_config` + dotted overrides -> RunConfig, with `model.preset`."""

from pathlib import Path

import pytest
from transformers import Qwen3_5MoeTextConfig

from clover_jax.config import PRESETS
from clover_jax.run_config import DemoConfig, RunConfig, load_run_config
from clover_jax.yaml_config import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
L, F = "linear_attention", "full_attention"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_without_file():
    r = load_run_config(None)
    assert isinstance(r, RunConfig)
    assert r.model.hidden_size == 2048 and r.model.num_hidden_layers == 40  # the 35B backbone
    assert r.demo == DemoConfig()


def test_preset_with_field_overrides(tmp_path):
    f = _write(tmp_path / "run.yaml", "model:\n  preset: tiny\n  hidden_size: 48\n  num_experts: 4\n"
                                      "demo:\n  seed: 5\n")
    r = load_run_config(f)
    tiny = PRESETS["tiny"]
    assert (r.model.hidden_size, r.model.num_experts) == (48, 4)
    # everything else is the tiny preset, not the ModelConfig defaults
    assert r.model.vocab_size == 256 and r.model.layer_types == (L, F, L, F) and r.model.head_dim == 16
    assert r.model.eos_token_id == 1 and r.model.gdn_chunk_size == tiny.gdn_chunk_size == 16
    assert r.model == tiny.replace(hidden_size=48, num_experts=4)
    assert r.demo.seed == 5 and r.demo.max_new_tokens == DemoConfig().max_new_tokens


def test_base_config_include_and_cli_overrides(tmp_path):
    _write(tmp_path / "base.yaml", "model:\n  preset: tiny\n  hidden_size: 48\ndemo:\n  seed: 5\n"
                                   "  max_new_tokens: 9\n")
    (tmp_path / "sub").mkdir()
    child = _write(tmp_path / "sub" / "child.yaml",
                   "base_config: ../base.yaml\nmodel:\n  num_experts: 4\ndemo:\n  max_new_tokens: 7\n")
    r = load_run_config(child)
    assert (r.model.hidden_size, r.model.num_experts, r.model.vocab_size) == (48, 4, 256)
    assert (r.demo.seed, r.demo.max_new_tokens) == (5, 7)
    r = load_run_config(child, ["model.hidden_size=32", "demo.max_new_tokens=3", "demo.prompt=hi there",
                                "model.rope_theta=10000"])
    assert (r.model.hidden_size, r.model.num_experts) == (32, 4)
    assert (r.demo.seed, r.demo.max_new_tokens, r.demo.prompt) == (5, 3, "hi there")
    assert r.model.rope_theta == 10000.0 and isinstance(r.model.rope_theta, float)


def test_preset_from_override_only():
    r = load_run_config(None, ["model.preset=tiny", "model.hidden_size=32"])
    assert r.model == PRESETS["tiny"].replace(hidden_size=32)
    # an override can switch the file's preset
    r = load_run_config(str(CONFIGS / "demo.yaml"), ["model.preset=tiny"])
    assert r.model == PRESETS["tiny"]


def test_unknown_key_in_file(tmp_path):
    f = _write(tmp_path / "typo.yaml", "demo:\n  max_new_token: 3\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(f)
    msg = str(e.value)
    assert str(f) in msg and "'demo.max_new_token'" in msg and "'demo.max_new_tokens'" in msg
    f = _write(tmp_path / "typo2.yaml", "model:\n  preset: tiny\n  hiden_size: 3\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(f)
    assert str(f) in str(e.value) and "'model.hiden_size'" in str(e.value)
    assert "'model.hidden_size'" in str(e.value)


@pytest.mark.parametrize("override, key, nearest", [
    ("demo.max_new_token=3", "demo.max_new_token", "demo.max_new_tokens"),
    ("model.hiden_size=32", "model.hiden_size", "model.hidden_size"),
    ("modle.hidden_size=32", "modle", "model"),
])
@pytest.mark.parametrize("with_file", [False, True])
def test_unknown_key_in_override(override, key, nearest, with_file):
    path = str(CONFIGS / "demo.yaml") if with_file else None
    with pytest.raises(ConfigError) as e:
        load_run_config(path, [override])
    assert f"'{key}'" in str(e.value) and f"did you mean '{nearest}'" in str(e.value)


def test_bad_value_type_names_key():
    with pytest.raises(ConfigError, match=r"demo\.max_new_tokens.*int"):
        load_run_config(None, ["demo.max_new_tokens=many"])
    with pytest.raises(ConfigError, match=r"demo\.weights_dtype"):
        load_run_config(None, ["demo.weights_dtype=float16"])


def test_bad_preset(tmp_path):
    f = _write(tmp_path / "p.yaml", "model:\n  preset: qwen3.6-35b-a3\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(f)
    msg = str(e.value)
    assert str(f) in msg and "'qwen3.6-35b-a3'" in msg and "did you mean 'qwen3.6-35b-a3b'" in msg
    with pytest.raises(ConfigError, match=r"did you mean 'tiny'"):
        load_run_config(None, ["model.preset=tinyy"])


def test_model_invariant_violation_names_file(tmp_path):
    f = _write(tmp_path / "bad.yaml", "model:\n  preset: tiny\n  num_key_value_heads: 3\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(f)  # tiny has 4 query heads
    assert str(f) in str(e.value) and "num_key_value_heads" in str(e.value)
    g = _write(tmp_path / "ok.yaml", "model:\n  preset: tiny\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(g, ["model.num_key_value_heads=3"])
    assert str(g) in str(e.value) and "num_key_value_heads" in str(e.value)
    with pytest.raises(ConfigError, match="layer_types"):
        load_run_config(g, ["model.layer_types=[linear_attention, sliding]"])


def test_fewer_layers_of_the_35b_preset_use_the_hf_default_pattern():
    """`model.num_hidden_layers=8` on the 35B preset (whose layer pattern is not spelt out, HF derives
    it from the layer count) must give 8 layers with the HF default pattern, as
    `Qwen3_5MoeTextConfig(num_hidden_layers=8)` does."""
    want = tuple(Qwen3_5MoeTextConfig(num_hidden_layers=8).layer_types)
    r = load_run_config(None, ["model.preset=qwen3.6-35b-a3b", "model.num_hidden_layers=8"])
    assert r.model.num_hidden_layers == 8 and r.model.layer_types == want
    r = load_run_config(str(CONFIGS / "qwen3.6-35b-a3b.yaml"), ["model.num_hidden_layers=8"])
    assert r.model.layer_types == want


def test_explicit_layer_types_override(tmp_path):
    r = load_run_config(None, ["model.preset=tiny", "model.num_hidden_layers=2",
                               "model.layer_types=[linear_attention, full_attention]"])
    assert r.model.layer_types == (L, F) and r.model.group_size == 2


def test_shipped_demo_yaml():
    r = load_run_config(CONFIGS / "demo.yaml")
    assert r.model == PRESETS["tiny-qwen3.6"]
    assert r.model.vocab_size == 248320  # the real vocabulary
    d = r.demo
    assert (d.out_dir, d.weights_dtype, d.expert_layout, d.prefix, d.max_new_tokens) == (
        "runs/demo", "bfloat16", "fused", "model.language_model.", 12)


def test_shipped_qwen_yaml():
    r = load_run_config(str(CONFIGS / "qwen3.6-35b-a3b.yaml"))
    assert r.model == PRESETS["qwen3.6-35b-a3b"].replace(dtype="bfloat16", param_dtype="float32")
    assert r.model.hidden_size == 2048 and r.model.num_experts == 256 and r.model.group_size == 4


def test_missing_file():
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_run_config("/definitely/nope.yaml")
