"""clover_jax.config against independent facts: the docs/design.md section 2 table, parameter counts by hand
and from transformers' own `Qwen3_5MoeForCausalLM` (built on the meta device, so no memory), and
`Qwen3_5MoeTextConfig` for the HF dict conversions."""

import json

import pytest
import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from clover_jax.config import (
    FULL, LINEAR, PRESETS, ModelConfig, ModelConfigError, default_layer_types, get_preset, param_count,
)

L, F = "linear_attention", "full_attention"
QWEN = "qwen3.6-35b-a3b"

#: The architecture fields every conversion must carry (HF names).
ARCH_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "router_aux_loss_coef", "rms_norm_eps",
    "tie_word_embeddings", "max_position_embeddings", "bos_token_id", "pad_token_id",
)


def _hf_param_count(hf_cfg: Qwen3_5MoeTextConfig) -> int:
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(hf_cfg)
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


# ------------------------------------------------------------------------------------------ presets

def test_qwen36_preset_matches_design_table():
    c = get_preset(QWEN)
    assert c.hidden_size == 2048
    assert c.num_hidden_layers == 40 and len(c.layer_types) == 40
    assert [i for i, t in enumerate(c.layer_types) if t == F] == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39]
    assert all(t == L for i, t in enumerate(c.layer_types) if i % 4 != 3)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 2, 256)
    assert c.rotary_dim == 64 and c.partial_rotary_factor == 0.25 and c.rope_theta == 1e7
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (16, 32)
    assert (c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim) == (128, 128, 4)
    assert (c.gdn_key_dim, c.gdn_value_dim) == (2048, 4096)
    assert c.gdn_conv_channels == 8192
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (256, 8, 512)
    assert c.shared_expert_intermediate_size == 512
    assert c.vocab_size == 248320 and not c.tie_word_embeddings
    assert c.rms_norm_eps == 1e-6 and c.max_position_embeddings == 262144
    assert get_preset("clover-35b-a3b").max_position_embeddings == 131072  # "Clover advertises 131072"


def test_param_count_about_35b_and_routed_experts_about_32b():
    c = get_preset(QWEN)
    total = param_count(c)
    assert 34e9 < total < 36.5e9
    # by hand: 40 layers x 256 experts x (gate, up, down) x 2048 x 512
    routed = 40 * 256 * 3 * 2048 * 512
    assert routed == 32_212_254_720  # "about 32B of the 35B"
    assert 0.9 < routed / total < 0.95
    # embeddings + untied lm_head: 2 x 248320 x 2048; the rest (attention, GDN, shared experts,
    # routers, norms) is well under 2B
    embed = 2 * 248320 * 2048
    assert 0 < total - routed - embed < 2e9


@pytest.mark.parametrize("name", [QWEN, "small-cpu", "tiny-qwen3.6", "tiny"])
def test_param_count_equals_transformers_model(name):
    cfg = PRESETS[name]
    assert param_count(cfg) == _hf_param_count(Qwen3_5MoeTextConfig(**cfg.to_hf_dict()))


def test_param_count_tied_embeddings_equals_transformers_model():
    cfg = PRESETS["tiny"].replace(tie_word_embeddings=True)
    assert param_count(cfg) == _hf_param_count(Qwen3_5MoeTextConfig(**cfg.to_hf_dict()))
    assert param_count(PRESETS["tiny"]) - param_count(cfg) == 256 * 64


def test_group_size():
    c = get_preset(QWEN)
    assert c.group_size == 4 and c.num_groups == 10
    assert PRESETS["tiny"].group_size == 2 and PRESETS["tiny"].num_groups == 2
    assert PRESETS["small-cpu"].group_size == 4
    non_repeating = ModelConfig(num_hidden_layers=5, layer_types=(L, L, F, L, F))
    assert non_repeating.group_size == 5 and non_repeating.num_groups == 1
    assert ModelConfig(num_hidden_layers=4, layer_types=(L, F, L, L)).group_size == 4
    assert ModelConfig(num_hidden_layers=3, layer_types=(L, L, L)).group_size == 1
    assert ModelConfig(num_hidden_layers=6, layer_types=(L, F) * 3).group_size == 2


def test_unknown_preset_suggests_nearest():
    with pytest.raises(ModelConfigError) as e:
        get_preset("qwen3.6-35b-a3")
    msg = str(e.value)
    assert "'qwen3.6-35b-a3'" in msg and "did you mean 'qwen3.6-35b-a3b'" in msg


# ------------------------------------------------------------------------------------ layer types

@pytest.mark.parametrize("n", [1, 4, 8, 10, 40])
def test_default_layer_types_match_transformers(n):
    assert ModelConfig(num_hidden_layers=n).layer_types == tuple(
        Qwen3_5MoeTextConfig(num_hidden_layers=n).layer_types)


def test_layer_types_default_from_full_attention_interval():
    hf = {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 6, "full_attention_interval": 2}
    assert ModelConfig.from_hf_dict(hf).layer_types == (L, F, L, F, L, F)
    hf = {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 6, "full_attention_interval": 3}
    assert ModelConfig.from_hf_dict(hf).layer_types == (L, L, F, L, L, F)
    hf = {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 8}  # no interval: every 4th
    assert ModelConfig.from_hf_dict(hf).layer_types == (L, L, L, F) * 2
    assert default_layer_types(4, 1) == (F,) * 4
    assert (FULL, LINEAR) == (F, L)


# -------------------------------------------------------------------------------------- from HF

def _real_composite() -> dict:
    """A hub-style Qwen3.6-35B-A3B config.json (composite, vision stub, fields HF adds that we ignore)."""
    layer_types = [F if (i + 1) % 4 == 0 else L for i in range(40)]
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "image_token_id": 248056, "video_token_id": 248057,
        "vision_start_token_id": 248053, "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
            "bos_token_id": None, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
            "dtype": "bfloat16", "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
            "hidden_size": 2048, "initializer_range": 0.02, "layer_types": layer_types,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_value_head_dim": 128,
            "max_position_embeddings": 262144, "mamba_ssm_dtype": "float32", "mlp_only_layers": [],
            "moe_intermediate_size": 512, "mtp_num_hidden_layers": 1, "num_attention_heads": 16,
            "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 40,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 512, "use_cache": True, "vocab_size": 248320,
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                                "rope_type": "default", "rope_theta": 10000000,
                                "partial_rotary_factor": 0.25},
        },
        "vision_config": {"model_type": "qwen3_5_moe", "depth": 27, "hidden_size": 1152},
    }


def test_from_hf_dict_real_composite():
    c = ModelConfig.from_hf_dict(_real_composite(), dtype="bfloat16")
    q = get_preset(QWEN)
    for f in ARCH_FIELDS:
        if f not in ("pad_token_id",):
            assert getattr(c, f) == getattr(q, f), f
    assert c.layer_types == q.layer_types
    assert c.eos_token_id == (248046, 248044)
    assert c.pad_token_id == 248044 and c.bos_token_id is None
    assert c.rope_theta == 1e7 and isinstance(c.rope_theta, float)
    assert c.partial_rotary_factor == 0.25 and c.mrope_section == (11, 11, 10)
    assert c.dtype == "bfloat16"  # runtime kwarg; the HF `dtype` field is not ours
    assert c.group_size == 4


def test_from_hf_dict_transformers_text_config():
    hf_cfg = Qwen3_5MoeTextConfig(
        vocab_size=300, hidden_size=48, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=3,
        head_dim=24, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=3, num_experts=5, num_experts_per_tok=3,
        moe_intermediate_size=20, shared_expert_intermediate_size=28, router_aux_loss_coef=0.01,
        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=1024,
        layer_types=[L, L, F, L, L, F], bos_token_id=3, eos_token_id=[4, 5], pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5,
                         "mrope_section": [3, 2, 1]},
    )
    d = json.loads(json.dumps(hf_cfg.to_dict()))  # what a config.json holds
    c = ModelConfig.from_hf_dict(d)
    for f in ARCH_FIELDS:
        if f not in ("bos_token_id", "pad_token_id"):
            assert getattr(c, f) == getattr(hf_cfg, f), f
    assert (c.bos_token_id, c.pad_token_id, c.eos_token_id) == (3, 0, (4, 5))
    assert c.layer_types == (L, L, F, L, L, F) and c.group_size == 3
    assert (c.rope_theta, c.partial_rotary_factor, c.mrope_section) == (5e5, 0.5, (3, 2, 1))
    assert c.rotary_dim == 12


def test_from_hf_dict_hf_fixture_composite():
    from tests.hf_fixtures import TINY_HF_CONFIG, composite_config, tiny_hf_config

    c = ModelConfig.from_hf_dict(composite_config(tiny_hf_config()))
    for f in ARCH_FIELDS:
        if f in TINY_HF_CONFIG:
            assert getattr(c, f) == TINY_HF_CONFIG[f], f
    assert c.layer_types == tuple(TINY_HF_CONFIG["layer_types"])
    assert c.mrope_section == (1, 1, 0) and c.rope_theta == 10000.0 and c.eos_token_id == 1


def test_from_hf_dict_top_level_rope_fields():
    """Older configs keep rope_theta / partial_rotary_factor at the top level."""
    c = ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe_text", "rope_theta": 1e6,
                                  "partial_rotary_factor": 0.5})
    assert (c.rope_theta, c.partial_rotary_factor, c.rotary_dim) == (1e6, 0.5, 128)


# ---------------------------------------------------------------------------------------- to HF

@pytest.mark.parametrize("name", [QWEN, "clover-35b-a3b", "small-cpu", "tiny-qwen3.6", "tiny"])
def test_to_hf_dict_builds_transformers_config(name):
    cfg = PRESETS[name]
    d = cfg.to_hf_dict()
    d = json.loads(json.dumps(d))  # must be JSON-serialisable
    hf = Qwen3_5MoeTextConfig(**d)
    assert hf.model_type == "qwen3_5_moe_text"
    for f in ARCH_FIELDS:
        assert getattr(hf, f) == getattr(cfg, f), f
    assert tuple(hf.layer_types) == cfg.layer_types
    rp = hf.rope_parameters
    assert rp["rope_type"] == "default"
    assert rp["rope_theta"] == cfg.rope_theta and rp["partial_rotary_factor"] == cfg.partial_rotary_factor
    assert tuple(rp["mrope_section"]) == cfg.mrope_section
    eos = hf.eos_token_id
    assert (tuple(eos) if isinstance(eos, list) else eos) == cfg.eos_token_id
    assert hf.hidden_act == "silu" and hf.attention_bias is False


def test_to_hf_dict_eos_list_and_back():
    cfg = PRESETS["tiny"].replace(eos_token_id=(1, 2), bos_token_id=3)
    d = cfg.to_hf_dict()
    assert d["eos_token_id"] == [1, 2]
    assert Qwen3_5MoeTextConfig(**d).eos_token_id == [1, 2]
    runtime = {k: getattr(cfg, k) for k in ("dtype", "param_dtype", "gdn_chunk_size", "gdn_backend",
                                            "moe_impl", "scan_layers")}
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(d)), **runtime) == cfg


def test_to_hf_dict_refuses_composite_and_unknown_types():
    for mt in ("qwen3_5_moe", "llama"):
        with pytest.raises(ModelConfigError, match=mt):
            PRESETS["tiny"].to_hf_dict(model_type=mt)
    assert PRESETS["tiny"].to_hf_dict(model_type="clover_moe")["model_type"] == "clover_moe"


# --------------------------------------------------------------------------------------- errors

def test_unknown_model_type_names_source_and_type():
    with pytest.raises(ModelConfigError) as e:
        ModelConfig.from_hf_dict({"model_type": "llama", "hidden_size": 8}, source="/ckpt/x/config.json")
    assert "/ckpt/x/config.json" in str(e.value) and "'llama'" in str(e.value)
    with pytest.raises(ModelConfigError, match="None"):
        ModelConfig.from_hf_dict({"hidden_size": 8}, source="cfg.json")


def test_composite_without_text_config():
    with pytest.raises(ModelConfigError, match=r"src\.json.*text_config"):
        ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe", "hidden_size": 8}, source="src.json")


def test_layer_types_length_mismatch():
    with pytest.raises(ModelConfigError, match=r"layer_types has 4 entries but num_hidden_layers is 3"):
        ModelConfig(num_hidden_layers=3, layer_types=(L, L, L, F))
    hf = {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 3, "layer_types": [L, F]}
    with pytest.raises(ModelConfigError, match=r"^a/config\.json: layer_types"):
        ModelConfig.from_hf_dict(hf, source="a/config.json")


def test_bad_layer_type():
    with pytest.raises(ModelConfigError, match="sliding_attention"):
        ModelConfig(num_hidden_layers=2, layer_types=(L, "sliding_attention"))
    hf = {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 2, "layer_types": [L, "mamba"]}
    with pytest.raises(ModelConfigError, match=r"b\.json.*'mamba'"):
        ModelConfig.from_hf_dict(hf, source="b.json")


@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic"])
def test_rope_type_other_than_default(rope_type):
    hf = {"model_type": "qwen3_5_moe_text",
          "rope_parameters": {"rope_type": rope_type, "rope_theta": 1e6, "factor": 4.0}}
    with pytest.raises(ModelConfigError) as e:
        ModelConfig.from_hf_dict(hf, source="r.json")
    assert "r.json" in str(e.value) and rope_type in str(e.value)


def test_attention_bias_and_hidden_act():
    with pytest.raises(ModelConfigError, match=r"c\.json.*attention_bias"):
        ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe_text", "attention_bias": True}, source="c.json")
    comp = _real_composite()
    comp["text_config"]["attention_bias"] = True
    with pytest.raises(ModelConfigError, match="attention_bias"):
        ModelConfig.from_hf_dict(comp)
    with pytest.raises(ModelConfigError, match="gelu"):
        ModelConfig.from_hf_dict({"model_type": "clover_moe", "hidden_act": "gelu"})


@pytest.mark.parametrize("kw, field", [
    (dict(num_attention_heads=16, num_key_value_heads=3), "num_key_value_heads"),
    (dict(num_attention_heads=4, num_key_value_heads=8), "num_key_value_heads"),
    (dict(linear_num_key_heads=16, linear_num_value_heads=24), "linear_num_key_heads"),
    (dict(num_experts=8, num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    (dict(head_dim=16, partial_rotary_factor=0.3125), "partial_rotary_factor"),  # rotary dim 5 (odd)
    (dict(head_dim=16, partial_rotary_factor=2.0), "partial_rotary_factor"),  # rotary dim 32 > 16
])
def test_invalid_shapes(kw, field):
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig(**kw)


@pytest.mark.parametrize("kw, field", [
    (dict(num_key_value_heads=0), "num_key_value_heads"),
    (dict(linear_num_key_heads=0), "linear_num_key_heads"),
])
def test_zero_heads_is_a_config_error(kw, field):
    """Zero KV / GDN key heads must be a ModelConfigError naming the field (launch.py turns those into
    exit 1 with a message), not a ZeroDivisionError from the `%` check."""
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig(**kw)


def test_invalid_head_ratio_from_hf_names_source():
    with pytest.raises(ModelConfigError, match=r"^h\.json: .*num_key_value_heads"):
        ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe_text", "num_attention_heads": 16,
                                  "num_key_value_heads": 3}, source="h.json")


# ---------------------------------------------------------------------------------- from_hf_file

def test_from_hf_file(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_real_composite()))
    by_dir, by_file = ModelConfig.from_hf_file(d), ModelConfig.from_hf_file(d / "config.json")
    assert by_dir == by_file and by_dir.eos_token_id == (248046, 248044)
    assert ModelConfig.from_hf_file(d, dtype="bfloat16").dtype == "bfloat16"


def test_from_hf_file_missing_config(tmp_path):
    d = tmp_path / "empty_ckpt"
    d.mkdir()
    with pytest.raises(ModelConfigError) as e:
        ModelConfig.from_hf_file(d)
    assert str(d) in str(e.value) and "config.json" in str(e.value)
    with pytest.raises(ModelConfigError, match="does_not_exist"):
        ModelConfig.from_hf_file(tmp_path / "does_not_exist")


def test_from_hf_file_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_moe_text",')
    with pytest.raises(ModelConfigError) as e:
        ModelConfig.from_hf_file(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value) and "JSON" in str(e.value)


def test_from_hf_file_unknown_type_names_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    with pytest.raises(ModelConfigError) as e:
        ModelConfig.from_hf_file(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value) and "'mixtral'" in str(e.value)
