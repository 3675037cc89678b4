"""The Clover HF checkpoint format (docs/design.md 2.2, 3.2 B/C, 6): `clover_moe` config.json, the two
block-diffusion tensors per GDN layer, load/save modes, and the exported tokenizer's mask token.

Checkpoints come from tests/hf_fixtures.py: a transformers `Qwen3_5MoeForCausalLM` built from the
"tiny" preset, written hub-style with safetensors.torch, plus random Clover tensors written from the
documented layout (independent of clover_jax's writer). Expected values are computed here from
that layout (`weight[c, d-1] = right[d-1, c]`, rows q | k | v; scalar columns alpha, beta, gamma)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

import launch
from clover_jax.bridge import convert
from clover_jax.bridge import hf_keys as hk
from clover_jax.bridge import params_checkpoint as pc
from clover_jax.api import load_hf, save_hf
from clover_jax.config import LINEAR, PRESETS, ModelConfig
from clover_jax.model.clover_model import model_to_params
from clover_jax.model.params import flatten, layer_param_shapes, unflatten, unstack_layers
from clover_jax.bridge.safetensors_io import CheckpointError
from tests.hf_fixtures import (
    CLOVER_CONV_RIGHT, CLOVER_SCALARS, SPLIT_CONV_RIGHT, SPLIT_SCALARS, assert_tensors_identical, clover_config,
    clover_tensors, randomise_, read_all_tensors, split_clover_tensors, write_clover_hub, write_save_pretrained,
    write_small_tokenizer,
)

TINY = PRESETS["tiny"]
NV, DK = TINY.linear_num_value_heads, TINY.linear_key_head_dim
KD, VD, K1 = TINY.gdn_key_dim, TINY.gdn_value_dim, TINY.linear_conv_kernel_dim - 1
C = TINY.gdn_conv_channels
GDN_LAYERS = [i for i, t in enumerate(TINY.layer_types) if t == LINEAR]
HUB = "model.language_model."
BF16 = np.dtype(ml_dtypes.bfloat16)
#: the block-diffusion fields of our fixture's config.json, written by hand (JSON form)
CLOVER_FIELDS = dict(block_size=[4, 8], mask_token_id=None, logits_shift=False, bd_alpha_init=2.5,
                     bd_beta_init=-0.5, bd_gamma_init=0.75)
SKIPPED = ("mtp.", "model.visual.")
BD_SUFFIXES = (CLOVER_SCALARS, CLOVER_CONV_RIGHT)
SPLIT_SUFFIXES = SPLIT_SCALARS + (SPLIT_CONV_RIGHT,)
RUNTIME = ("dtype", "param_dtype", "gdn_chunk_size", "gdn_backend", "moe_impl", "scan_layers")


def _hf_text_cfg() -> Qwen3_5MoeTextConfig:
    return Qwen3_5MoeTextConfig(**TINY.to_hf_dict())


@pytest.fixture(scope="module")
def torch_model():
    cfg = _hf_text_cfg()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return randomise_(Qwen3_5MoeForCausalLM(cfg).eval(), seed=0)


@pytest.fixture(scope="module")
def bd(torch_model):
    return clover_tensors(torch_model.config, HUB, seed=0)


@pytest.fixture(scope="module")
def clover_dir(torch_model, bd, tmp_path_factory):
    """Hub-style Clover dir (bf16, fp32 A_log / GDN norm / scalars, fused, ~10 shards) + a real
    200-word tokenizer: mask_token_id unset, so the export must set it to 200."""
    d = tmp_path_factory.mktemp("clover") / "src"
    write_clover_hub(torch_model, d, bd, clover_config(torch_model.config, **CLOVER_FIELDS))
    assert write_small_tokenizer(d) == 200
    return d


@pytest.fixture(scope="module")
def qwen_dir(torch_model, tmp_path_factory):
    return write_save_pretrained(torch_model, tmp_path_factory.mktemp("qwen") / "sp")


@pytest.fixture(scope="module")
def clover_ckpt(clover_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax") / "ckpt"
    assert launch.main(["convert", "--hf", str(clover_dir), "--out", str(out)]) == 0
    return out


def text_tensors(d: Path) -> dict[str, np.ndarray]:
    return {k: v for k, v in read_all_tensors(d).items() if not k.startswith(SKIPPED)}


def f32(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


def expected_right(w_CK: np.ndarray) -> dict[str, np.ndarray]:
    """Ours [K-1, part] per q/k/v from HF [C, K-1], written out index by index (the documented
    `weight[c, d-1] = right[d-1, c]` with rows q | k | v), not by slicing."""
    parts = {"q": (0, KD), "k": (KD, 2 * KD), "v": (2 * KD, C)}
    out = {}
    for p, (lo, hi) in parts.items():
        r = np.zeros((K1, hi - lo), np.float32)
        for c in range(lo, hi):
            for d in range(K1):
                r[d, c - lo] = w_CK[c, d]
        out[p] = r
    return out


def gdn_leaves(model, i: int) -> dict[str, np.ndarray]:
    tree = unstack_layers(model.cfg, model_to_params(model))
    return {k: np.asarray(v) for k, v in flatten(tree["layers"][i]).items()}


def records(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# ------------------------------------------------------------------------------------ config.json


def test_config_json_clover_round_trip():
    cfg = TINY.replace(mode="block", block_size=(4, 8, 16), mask_token_id=200, logits_shift=False,
                       bd_alpha_init=2.5, bd_beta_init=-0.5, bd_gamma_init=0.75)
    d = json.loads(json.dumps(cfg.to_hf_dict("clover_moe")))
    assert d["model_type"] == "clover_moe" and d["architectures"] == ["CloverMoeModelLM"]
    assert d["num_shared_experts"] == 1  # what llama.cpp's Clover converter reads
    assert d["block_size"] == [4, 8, 16] and d["mask_token_id"] == 200 and d["logits_shift"] is False
    assert (d["bd_alpha_init"], d["bd_beta_init"], d["bd_gamma_init"]) == (2.5, -0.5, 0.75)
    assert "mode" not in d
    runtime = {k: getattr(cfg, k) for k in RUNTIME}
    assert ModelConfig.from_hf_dict(d, **runtime) == cfg
    # int block size, alpha None (= sqrt(dk)) round trip as well
    cfg2 = TINY.replace(mode="block", block_size=32)
    d2 = json.loads(json.dumps(cfg2.to_hf_dict("clover_moe")))
    assert d2["block_size"] == 32 and d2["bd_alpha_init"] is None and d2["mask_token_id"] is None
    back = ModelConfig.from_hf_dict(d2, **runtime)
    assert back == cfg2 and back.bd_scalar_init == (DK ** 0.5, 0.0, 1.0)
    # the Qwen text type carries none of them
    assert not set(TINY.to_hf_dict()) & {"block_size", "mask_token_id", "logits_shift", "bd_alpha_init"}


def test_config_modes_from_model_type():
    qwen = TINY.to_hf_dict()
    assert ModelConfig.from_hf_dict(qwen).mode == "ar"
    assert ModelConfig.from_hf_dict(qwen, mode="block").mode == "block"
    # bd fields in a Qwen-typed config are not read (AR model); in a Clover one missing fields default
    assert ModelConfig.from_hf_dict({**qwen, "block_size": 8}).block_size == TINY.block_size
    bare = {k: v for k, v in qwen.items()}
    bare["model_type"] = "clover_moe"
    c = ModelConfig.from_hf_dict(bare)
    assert c.mode == "block" and c.block_size == 32 and c.mask_token_id is None and c.logits_shift is True
    assert ModelConfig.from_hf_dict(bare, mode="ar").mode == "ar"
    with pytest.raises(ValueError, match=r"x\.json: block_size"):
        ModelConfig.from_hf_dict({**bare, "block_size": [4, 0]}, source="x.json")
    assert ModelConfig.from_hf_dict({**bare, "num_shared_experts": 1}) == c
    with pytest.raises(ValueError, match=r"x\.json: num_shared_experts=2 unsupported"):
        ModelConfig.from_hf_dict({**bare, "num_shared_experts": 2}, source="x.json")


# ------------------------------------------------------------------------------- Clover round trips


def test_load_hf_clover_maps_documented_layout_and_save_hf_is_byte_identical(clover_dir, bd, tmp_path):
    cfg, model = load_hf(clover_dir)  # mode from the checkpoint
    assert cfg.mode == "block" and cfg.block_size == (4, 8) and cfg.logits_shift is False
    assert cfg.bd_scalar_init == (2.5, -0.5, 0.75) and cfg.mask_token_id is None
    for i in GDN_LAYERS:
        leaves = gdn_leaves(model, i)
        p = f"{HUB}layers.{i}.linear_attn."
        np.testing.assert_array_equal(leaves["gdn.bd_gdn_softmax_scalars"], f32(bd[p + CLOVER_SCALARS]))
        assert leaves["gdn.bd_gdn_softmax_scalars"].dtype == np.float32
        for part, want in expected_right(f32(bd[p + CLOVER_CONV_RIGHT])).items():
            np.testing.assert_array_equal(leaves[f"gdn.conv_{part}.right"], want)

    out = save_hf(model, cfg, tmp_path / "out", format="clover", prefix=HUB, source_dir=clover_dir,
                  clover_naming="packed")
    assert_tensors_identical(text_tensors(clover_dir), text_tensors(out))  # bf16 + fp32 scalars kept
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "clover_moe" and hf["architectures"] == ["CloverMoeModelLM"]
    assert hf["block_size"] == [4, 8] and hf["logits_shift"] is False and hf["bd_alpha_init"] == 2.5
    assert hf["mask_token_id"] == 200  # unset in the source: the id <|mask|> got (the 200-word tokenizer)
    assert (out / "generation_config.json").is_file()

    cfg2, model2 = load_hf(out)
    assert cfg2 == cfg.replace(mask_token_id=200)
    a, b = flatten(model_to_params(model)), flatten(model_to_params(model2))
    assert a.keys() == b.keys()
    for k in a:
        assert np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes(), k


def test_convert_export_clover_through_orbax_is_byte_identical(clover_dir, clover_ckpt, tmp_path, capsys):
    ck_cfg, info = pc.read_params_info(clover_ckpt)
    assert ck_cfg == ModelConfig.from_hf_file(clover_dir)  # incl. mode block and the block_size tuple
    assert ck_cfg.mode == "block" and ck_cfg.block_size == (4, 8)
    assert "gdn.bd_gdn_softmax_scalars" in info["manifest"]["layers"][GDN_LAYERS[0]]
    for argv_tail, name in ((["--format", "clover"], "explicit"), ([], "default")):
        out = tmp_path / name
        assert launch.main(["export", "--checkpoint", str(clover_ckpt), "--out", str(out), "--clover-naming",
                            "packed", *argv_tail]) == 0
        assert_tensors_identical(text_tensors(clover_dir), text_tensors(out))
        hf = json.loads((out / "config.json").read_text())
        assert hf["model_type"] == "clover_moe" and hf["mask_token_id"] == 200, name
        assert ModelConfig.from_hf_file(out) == ck_cfg.replace(mask_token_id=200)
    # and convert of the export (mask id now set) -> export again: still identical
    ck2 = tmp_path / "ck2"
    assert launch.main(["convert", "--hf", str(tmp_path / "explicit"), "--out", str(ck2)]) == 0
    assert launch.main(["export", "--checkpoint", str(ck2), "--out", str(tmp_path / "again"), "--clover-naming",
                        "packed"]) == 0
    assert_tensors_identical(text_tensors(clover_dir), text_tensors(tmp_path / "again"))


def test_qwen_export_drops_clover_tensors_and_loads_in_transformers(clover_dir, clover_ckpt, tmp_path, caplog):
    out = tmp_path / "qwen"
    with caplog.at_level(logging.INFO):
        assert launch.main(["export", "--checkpoint", str(clover_ckpt), "--out", str(out), "--format", "qwen"]) == 0
    assert len(records(caplog, "qwen format drops the model's Clover block-diffusion parameters of 2 GDN")) == 1
    src = {k: v for k, v in text_tensors(clover_dir).items() if not k.endswith(BD_SUFFIXES)}
    assert_tensors_identical(src, text_tensors(out))
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "qwen3_5_moe_text" and "block_size" not in hf and "mask_token_id" not in hf
    # fp32 so the fp32 A_log / GDN norm are not rounded to bf16 on load
    loaded, info = Qwen3_5MoeForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    sd = loaded.state_dict()
    for k, v in src.items():  # HF names its text weights `model.` in memory
        t = sd["model." + k[len(HUB):]] if k.startswith(HUB) else sd[k]
        np.testing.assert_array_equal(t.numpy(), np.asarray(v, np.float32), err_msg=k)


# ---------------------------------------------------------------------------------- mode mismatches


def test_qwen_checkpoint_in_block_mode_fills_init_values(qwen_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        cfg, model = load_hf(qwen_dir, mode="block", bd_alpha_init=3.0, bd_gamma_init=0.5)
    lines = records(caplog, "no Clover block-diffusion tensors")
    assert len(lines) == 1, lines
    assert "fills the Clover parameters of 2 GDN layers" in lines[0]
    assert "(alpha, beta, gamma) = (3, 0, 0.5)" in lines[0]
    assert cfg.mode == "block"
    ar_cfg, ar_model = load_hf(qwen_dir)
    assert ar_cfg.mode == "ar"
    for i in GDN_LAYERS:
        leaves, ar = gdn_leaves(model, i), gdn_leaves(ar_model, i)
        np.testing.assert_array_equal(leaves["gdn.bd_gdn_softmax_scalars"], np.tile([3.0, 0.0, 0.5], (NV, 1)))
        for part, width in (("q", KD), ("k", KD), ("v", VD)):
            np.testing.assert_array_equal(leaves[f"gdn.conv_{part}.right"], np.zeros((K1, width)))
        assert {k: v for k, v in leaves.items() if "bd_" not in k and ".right" not in k}.keys() == ar.keys()
        for k in ar:
            np.testing.assert_array_equal(leaves[k], ar[k], err_msg=k)
    # default inits (alpha = sqrt(dk)) through the streaming paths: iter_hf_layers, `convert --mode block`
    streamed = [flatten(t) for t in convert.iter_hf_layers(qwen_dir, mode="block")]
    assert all(("gdn.bd_gdn_softmax_scalars" in t) == (i in GDN_LAYERS) for i, t in enumerate(streamed))
    ar_streamed = [flatten(t) for t in convert.iter_hf_layers(qwen_dir)]  # AR: none
    assert [t.keys() - s.keys() for t, s in zip(ar_streamed, streamed)] == [set()] * len(streamed)
    assert {k for t in streamed for k in t} - {k for t in ar_streamed for k in t} == {
        "gdn.bd_gdn_softmax_scalars", "gdn.conv_q.right", "gdn.conv_k.right", "gdn.conv_v.right"}
    ck = tmp_path / "ck"
    assert launch.main(["convert", "--hf", str(qwen_dir), "--out", str(ck), "--mode", "block"]) == 0
    assert pc.read_params_info(ck)[0].mode == "block"
    layer = flatten(pc.open_params_checkpoint(ck).read_layer(GDN_LAYERS[-1]))
    np.testing.assert_array_equal(layer["gdn.bd_gdn_softmax_scalars"], np.tile([DK ** 0.5, 0.0, 1.0], (NV, 1)))
    assert layer["gdn.conv_v.right"].dtype == layer["gdn.conv_v.kernel"].dtype == np.float32
    assert not layer["gdn.conv_v.right"].any()


def test_ar_model_exported_as_clover_writes_init_values(qwen_dir, tmp_path, caplog):
    cfg, model = load_hf(qwen_dir, bd_beta_init=0.25)
    assert cfg.mode == "ar"
    with caplog.at_level(logging.INFO):
        out = save_hf(model, cfg, tmp_path / "c", format="clover")
    assert len(records(caplog, "AR mode; the clover export writes its 8 Clover tensors")) == 1  # split: 4 a layer
    t = read_all_tensors(out)
    for i in GDN_LAYERS:
        for name, want in zip(SPLIT_SCALARS, (DK ** 0.5, 0.25, 1.0)):
            s = t[f"model.layers.{i}.linear_attn.{name}"]
            assert s.dtype == np.float32 and s.shape == (NV,)
            np.testing.assert_array_equal(s, np.full(NV, want, np.float32))
        r = t[f"model.layers.{i}.linear_attn.{SPLIT_CONV_RIGHT}"]
        assert r.shape == (C, K1) and r.dtype == ml_dtypes.bfloat16 and not r.astype(np.float32).any()
    assert json.loads((out / "config.json").read_text())["model_type"] == "clover_moe"
    assert load_hf(out)[0].mode == "block"


def test_clover_checkpoint_in_ar_mode_drops_clover_tensors(clover_dir, qwen_dir, caplog):
    with caplog.at_level(logging.INFO):
        cfg, model = load_hf(clover_dir, mode="ar")
    lines = records(caplog, "mode='ar' drops the checkpoint's 4 Clover block-diffusion tensors")
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert cfg.mode == "ar"
    _, ref = load_hf(qwen_dir)  # same weights (fp32 source; the Clover dir is their bf16 rounding)
    for i in range(TINY.num_hidden_layers):
        leaves, want = gdn_leaves(model, i), gdn_leaves(ref, i)
        assert leaves.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(leaves[k], want[k].astype(ml_dtypes.bfloat16).astype(np.float32)
                                          if not k.endswith(("A_log", "gdn.norm.scale")) else want[k], err_msg=k)


# ------------------------------------------------------------------------ other shapes, bad shapes


def _variant_dir(torch_model, tmp: Path, bd: dict, name: str) -> Path:
    d = tmp / name
    write_clover_hub(torch_model, d, bd, clover_config(torch_model.config, **CLOVER_FIELDS))
    return d


@pytest.mark.parametrize("cols", [None, 2])
def test_partial_scalars_and_c1k_right_conv_map_and_log(torch_model, tmp_path, caplog, cols):
    bd = clover_tensors(torch_model.config, HUB, seed=3, scalar_cols=cols, right_shape="C1K")
    d = _variant_dir(torch_model, tmp_path, bd, f"cols{cols}")
    alpha, beta, gamma = 2.5, -0.5, 0.75  # CLOVER_FIELDS init values
    with caplog.at_level(logging.INFO):
        _, tree = convert.read_hf(d)  # streaming path (SafetensorsIndex)
    for i in GDN_LAYERS:
        p = f"{HUB}layers.{i}.linear_attn."
        sc = f32(bd[p + CLOVER_SCALARS])
        want = np.empty((NV, 3), np.float32)
        for h in range(NV):
            want[h] = (alpha, sc[h], gamma) if cols is None else (alpha, sc[h, 0], sc[h, 1])
        leaves = flatten(tree["layers"][i])
        np.testing.assert_array_equal(leaves["gdn.bd_gdn_softmax_scalars"], want)
        for part, r in expected_right(f32(bd[p + CLOVER_CONV_RIGHT])[:, 0, :]).items():
            np.testing.assert_array_equal(leaves[f"gdn.conv_{part}.right"].astype(np.float32), r)
        line = records(caplog, repr(p + CLOVER_SCALARS))
        assert len(line) == 1 and ("beta only" if cols is None else "(beta, gamma)") in line[0], line
        # the in-memory dict path maps the same
        hf = {k: v for k, v in read_all_tensors(d).items() if k.startswith(f"{HUB}layers.{i}.")}
        cfg = ModelConfig.from_hf_file(d)
        ours = flatten(hk.hf_to_layer(cfg, hk.HFLayout(HUB, hk.FUSED, clover=True, clover_naming="packed"), i, hf))
        for k in ("gdn.bd_gdn_softmax_scalars", "gdn.conv_q.right", "gdn.conv_v.right"):
            np.testing.assert_array_equal(ours[k], leaves[k], err_msg=k)


BAD = [
    (CLOVER_SCALARS, (NV, 4)), (CLOVER_SCALARS, (NV + 1, 3)), (CLOVER_SCALARS, (NV, 3, 1)),
    (CLOVER_CONV_RIGHT, (C, K1 + 1)), (CLOVER_CONV_RIGHT, (C + 1, K1)), (CLOVER_CONV_RIGHT, (C, 2, K1)),
]


@pytest.mark.parametrize("name,shape", BAD, ids=lambda x: str(x))
def test_wrong_clover_shapes_fail_naming_the_tensor(torch_model, bd, tmp_path, name, shape):
    key = f"{HUB}layers.{GDN_LAYERS[-1]}.linear_attn.{name}"
    bad = {**bd, key: torch.zeros(shape, dtype=bd[key].dtype)}
    d = _variant_dir(torch_model, tmp_path, bad, "bad")
    accepted = "(4, 3), (4,), (4, 2)" if name == CLOVER_SCALARS else f"({C}, {K1}), ({C}, 1, {K1})"
    msg = rf"'{key}' has shape {tuple(shape)!s}.*accepted shapes: {accepted}".replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(hk.HFMappingError, match=msg):
        load_hf(d)
    with pytest.raises(hk.HFMappingError, match=msg):  # the dict path too
        cfg = ModelConfig.from_hf_file(d)
        hf = {k: v for k, v in read_all_tensors(d).items() if k.startswith(f"{HUB}layers.{GDN_LAYERS[-1]}.")}
        hk.hf_to_layer(cfg, hk.HFLayout(HUB, hk.FUSED, clover=True, clover_naming="packed"), GDN_LAYERS[-1], hf)


def test_clover_tensors_missing_in_one_layer_is_an_error(torch_model, bd, tmp_path):
    key = f"{HUB}layers.{GDN_LAYERS[-1]}.linear_attn.{CLOVER_CONV_RIGHT}"
    d = _variant_dir(torch_model, tmp_path, {k: v for k, v in bd.items() if k != key}, "partial")
    with pytest.raises(CheckpointError, match=rf"missing tensor '{key}'.*Clover block-diffusion tensors in other"):
        load_hf(d)
    with pytest.raises(CheckpointError, match=rf"missing tensor '{key}'"):
        convert.convert_hf_to_orbax(d, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


# ----------------------------------------------------------------------------- streaming / specs


@pytest.mark.parametrize("mode", ["ar", "block"])
@pytest.mark.parametrize("clover", [False, True])
def test_specs_and_row_blocks_cover_the_clover_tensors(mode, clover):
    cfg = TINY.replace(mode=mode)
    layout = hk.HFLayout(hk.PLAIN_PREFIX, hk.FUSED, clover=clover, clover_naming="packed")
    rng = np.random.default_rng(0)
    i = GDN_LAYERS[0]
    # bf16 weights, fp32 A_log / scalars (as exported)
    layer = {k: rng.standard_normal(sh).astype(np.float32 if k.endswith(("A_log", "scalars")) else BF16)
             for k, sh in flatten(layer_param_shapes(cfg, i)).items()}
    tree = unflatten(layer)
    whole = hk.layer_to_hf(cfg, layout, i, tree)
    keys = [k for k, _ in whole]
    assert any(k.endswith(CLOVER_SCALARS) for k in keys) == clover
    assert any(k.endswith(CLOVER_CONV_RIGHT) for k in keys) == clover
    if clover:
        got = dict(whole)
        sc, right = got[f"model.layers.{i}.linear_attn.{CLOVER_SCALARS}"], got[f"model.layers.{i}.linear_attn.{CLOVER_CONV_RIGHT}"]
        assert sc.dtype == np.float32 and right.dtype == BF16 and right.shape == (C, K1)
        if mode == "block":  # HF [c, d-1] = ours right[d-1, c], rows q | k | v
            for part, want in expected_right(right.astype(np.float32)).items():
                np.testing.assert_array_equal(layer[f"gdn.conv_{part}.right"].astype(np.float32), want)
            assert sc.tobytes() == layer["gdn.bd_gdn_softmax_scalars"].tobytes()
        else:  # an AR layer written as Clover: init values
            np.testing.assert_array_equal(sc, np.tile([DK ** 0.5, 0.0, 1.0], (NV, 1)))
            assert not right.astype(np.float32).any()
    specs = hk.layer_hf_specs(cfg, layout, i, {k: v.dtype for k, v in layer.items()})
    assert specs == [(k, a.shape, a.dtype) for k, a in whole]
    blocks = {k: np.concatenate(list(b)) for k, b in hk.iter_layer_to_hf_blocks(cfg, layout, i, tree, max_block_bytes=8)}
    for k, a in whole:
        assert blocks[k].tobytes() == a.tobytes(), k
    if clover and mode == "block":  # and back
        back = flatten(hk.hf_to_layer(cfg, layout, i, dict(whole)))
        for k in layer:
            assert back[k].tobytes() == np.ascontiguousarray(layer[k]).tobytes(), k


# ------------------------------------------------------------- the split naming (llama.cpp's converter)


@pytest.fixture(scope="module")
def split_dir(torch_model, bd, tmp_path_factory):
    """The clover_dir's weights with the Clover tensors in the split naming (written by hand from the
    packed columns alpha, beta, gamma; the right taps renamed)."""
    d = tmp_path_factory.mktemp("split") / "src"
    write_clover_hub(torch_model, d, split_clover_tensors(bd), clover_config(torch_model.config, **CLOVER_FIELDS))
    assert write_small_tokenizer(d) == 200
    return d


def test_split_naming_loads_as_the_packed_one_and_gives_the_same_noisy_outputs(clover_dir, split_dir, bd):
    _, packed = load_hf(clover_dir)
    cfg, split = load_hf(split_dir)
    a, b = flatten(model_to_params(packed)), flatten(model_to_params(split))
    assert a.keys() == b.keys()
    for k in a:
        assert np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes(), k
    for i in GDN_LAYERS:  # split column j -> scalars[:, j], written out per head
        p = f"{HUB}layers.{i}.linear_attn."
        got = gdn_leaves(split, i)["gdn.bd_gdn_softmax_scalars"]
        for j, name in enumerate(SPLIT_SCALARS):
            want = split_clover_tensors({p + CLOVER_SCALARS: bd[p + CLOVER_SCALARS]})[p + name]
            for h in range(NV):
                assert got[h, j] == float(want[h]), (name, h)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 200, (2, 16)).astype(np.int32)
    noisy = np.where(rng.random((2, 16)) < 0.5, 199, ids).astype(np.int32)
    # one compiled program for both models (op by op, each of the forward's ops would compile alone)
    block_logits = nnx.jit(lambda m, ids, noisy: m.block_logits(ids, noisy, block_size=4))
    lp, ls = block_logits(packed, ids, noisy), block_logits(split, ids, noisy)
    assert np.asarray(lp).tobytes() == np.asarray(ls).tobytes()


def test_default_export_writes_the_split_naming_llama_cpp_filters(clover_dir, clover_ckpt, bd, tmp_path):
    out, qwen = tmp_path / "split", tmp_path / "qwen"
    assert launch.main(["export", "--checkpoint", str(clover_ckpt), "--out", str(out)]) == 0
    assert launch.main(["export", "--checkpoint", str(clover_ckpt), "--out", str(qwen), "--format", "qwen"]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["CloverMoeModelLM"] and hf["model_type"] == "clover_moe"
    assert hf["num_shared_experts"] == 1 and hf["block_size"] == [4, 8] and hf["mask_token_id"] == 200
    got = text_tensors(out)
    for i in range(TINY.num_hidden_layers):
        p = f"{HUB}layers.{i}.linear_attn."
        clover_keys = {k[len(p):] for k in got if k.startswith(p) and k.endswith(SPLIT_SUFFIXES + BD_SUFFIXES)}
        assert clover_keys == (set(SPLIT_SUFFIXES) if i in GDN_LAYERS else set()), (i, clover_keys)
    # llama.cpp's converter drops exactly the names ending in the four split suffixes: what is left is
    # the plain text model (the qwen export, tensor for tensor)
    kept = {k: v for k, v in got.items() if not k.endswith(tuple("." + x for x in SPLIT_SUFFIXES))}
    assert_tensors_identical(text_tensors(qwen), kept)
    # the values: the packed source's, column by column
    for k, t in split_clover_tensors(bd).items():
        want = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
        np.testing.assert_array_equal(np.asarray(got[k], np.float32), want.astype(np.float32), err_msg=k)
        assert got[k].shape == tuple(t.shape) and got[k].dtype == (np.float32 if t.dtype == torch.float32 else BF16), k


def test_split_round_trip_changes_no_tensor(split_dir, tmp_path):
    ck = tmp_path / "ck"
    assert launch.main(["convert", "--hf", str(split_dir), "--out", str(ck)]) == 0
    assert pc.read_params_info(ck)[1]["source"]["clover_naming"] == "split"
    assert launch.main(["export", "--checkpoint", str(ck), "--out", str(tmp_path / "out")]) == 0
    assert_tensors_identical(text_tensors(split_dir), text_tensors(tmp_path / "out"))


def test_split_scalars_as_n_by_1_or_one_value_for_all_heads(torch_model, bd, tmp_path, caplog):
    g = GDN_LAYERS[0]
    ref = flatten(convert.read_hf(_variant_dir(torch_model, tmp_path, split_clover_tensors(bd), "v"))[1]["layers"][g])
    tall = split_clover_tensors(bd, scalar_shape="V1")
    d = _variant_dir(torch_model, tmp_path, tall, "v1")
    assert flatten(convert.read_hf(d)[1]["layers"][g])["gdn.bd_gdn_softmax_scalars"].tobytes() == \
        ref["gdn.bd_gdn_softmax_scalars"].tobytes()
    one = dict(split_clover_tensors(bd))
    i = GDN_LAYERS[0]
    key = f"{HUB}layers.{i}.linear_attn.{SPLIT_SCALARS[1]}"
    one[key] = torch.tensor(-0.25, dtype=torch.float32)  # history_bias as one value, shape []
    d = _variant_dir(torch_model, tmp_path, one, "scalar")
    with caplog.at_level(logging.INFO):
        leaves = flatten(convert.read_hf(d)[1]["layers"][i])
    assert len(records(caplog, f"{key!r} is one value for all {NV} heads; broadcast")) == 1
    sc = leaves["gdn.bd_gdn_softmax_scalars"]
    np.testing.assert_array_equal(sc[:, 1], np.full(NV, -0.25, np.float32))
    for j in (0, 2):
        want = split_clover_tensors(bd)[f"{HUB}layers.{i}.linear_attn.{SPLIT_SCALARS[j]}"].numpy()
        np.testing.assert_array_equal(sc[:, j], want)


@pytest.mark.parametrize("name,shape", [(SPLIT_SCALARS[0], (NV, 2)), (SPLIT_SCALARS[2], (NV + 1,)),
                                        (SPLIT_CONV_RIGHT, (C, K1 + 1))], ids=lambda x: str(x))
def test_wrong_split_shapes_fail_naming_the_tensor(torch_model, bd, tmp_path, name, shape):
    split = split_clover_tensors(bd)
    key = f"{HUB}layers.{GDN_LAYERS[-1]}.linear_attn.{name}"
    split[key] = torch.zeros(shape, dtype=split[key].dtype)
    d = _variant_dir(torch_model, tmp_path, split, "bad")
    accepted = f"({NV},), ({NV}, 1), ()" if name != SPLIT_CONV_RIGHT else f"({C}, {K1}), ({C}, 1, {K1})"
    msg = rf"'{key}' has shape {tuple(shape)!s}.*accepted shapes: {accepted}".replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(hk.HFMappingError, match=msg):
        load_hf(d)


def test_both_namings_in_one_checkpoint_is_an_error(torch_model, bd, tmp_path):
    mixed = {**bd, **{k: v for k, v in split_clover_tensors(bd).items() if f"layers.{GDN_LAYERS[-1]}." in k}}
    d = _variant_dir(torch_model, tmp_path, mixed, "mixed")
    with pytest.raises(hk.HFMappingError, match=r"Clover block-diffusion tensors in both namings: .*\(split\) and "
                                                r".*bd_gdn_.*\(packed\)"):
        load_hf(d)


# ------------------------------------------------------------------------------------- tokenizer


def test_exported_tokenizer_knows_the_mask_token(clover_dir, clover_ckpt, tmp_path):
    from clover_jax.bridge.tokenizer import load_tokenizer

    out = convert.export_orbax_to_hf(clover_ckpt, tmp_path / "out", format="clover")
    tok = load_tokenizer(out, fresh=True)
    mask = json.loads((out / "config.json").read_text())["mask_token_id"]
    assert mask == 200 == len(tok) - 1
    assert tok("<|mask|>")["input_ids"] == [mask]
    assert tok("w3 <|mask|> w5")["input_ids"] == [3, mask, 5]
    assert tok.mask_token == "<|mask|>"
    # the source tokenizer is untouched
    assert "<|mask|>" not in load_tokenizer(clover_dir, fresh=True).get_vocab()


def test_mask_token_id_must_match_the_tokenizer(clover_dir, tmp_path):
    cfg, model = load_hf(clover_dir)
    with pytest.raises(CheckpointError, match=r"mask_token_id 150 does not fit .*next free id, 200"):
        save_hf(model, cfg.replace(mask_token_id=150), tmp_path / "a", format="clover", source_dir=clover_dir)
    assert not (tmp_path / "a").exists()
    out = save_hf(model, cfg.replace(mask_token_id=200), tmp_path / "b", format="clover", source_dir=clover_dir)
    assert json.loads((out / "config.json").read_text())["mask_token_id"] == 200


def test_real_vocab_mask_token_is_248077():
    """No source tokenizer, the Qwen3.6 vocabulary: the built-in tokenizer (disk-cached; loading it
    costs seconds, so once) gets <|mask|> at its first unused id."""
    cfg = PRESETS["tiny-qwen3.6"].replace(mode="block")
    tok, mask = convert.clover_tokenizer(cfg, None)
    assert mask == 248077 and tok("x<|mask|>y")["input_ids"][1] == 248077 and len(tok) == 248078
