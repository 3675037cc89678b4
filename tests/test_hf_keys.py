"""`clover_jax.hf_keys`: names, layouts, shapes and the byte-exact HF <-> per-layer mapping (numpy
only, no files, no torch)."""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import pytest

from clover_jax import hf_keys as hk
from clover_jax.config import FULL, get_preset
from clover_jax.params import flatten, global_param_shapes, layer_param_shapes, unflatten

CFG = get_preset("tiny")  # GQA 4:2, dk 16 != dv 8, 8 experts, pattern (GDN, attn) x 2
BF16 = np.dtype(ml_dtypes.bfloat16)
LAYOUTS = [hk.HFLayout(p, e) for p in hk.TEXT_PREFIXES for e in hk.EXPERT_LAYOUTS]


def random_hf(cfg, layout, seed=0, dtype=BF16):
    """Every HF text tensor of `cfg` under `layout`, random, in `dtype` (A_log / GDN norm fp32)."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, shape in hk.all_expected_keys(cfg, layout).items():
        dt = np.float32 if k.endswith(("A_log", "linear_attn.norm.weight")) else dtype
        out[k] = rng.standard_normal(shape).astype(dt)
    return out


def to_ours(cfg, layout, t):
    g = hk.hf_to_globals(cfg, layout, t)
    return g, [hk.hf_to_layer(cfg, layout, i, t) for i in range(cfg.num_hidden_layers)]


def to_hf(cfg, layout, g, layers):
    out = dict(hk.globals_to_hf(cfg, layout, g))
    for i, layer in enumerate(layers):
        out.update(hk.layer_to_hf(cfg, layout, i, layer))
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l.prefix}{l.expert_layout}")
def test_round_trip_is_byte_identical(layout):
    t = random_hf(CFG, layout)
    g, layers = to_ours(CFG, layout, t)
    for i, layer in enumerate(layers):
        shapes = flatten(layer_param_shapes(CFG, i))
        assert {k: v.shape for k, v in flatten(layer).items()} == {k: tuple(v) for k, v in shapes.items()}
    want_g = {k: tuple(v) for k, v in flatten(global_param_shapes(CFG)).items()}
    assert {k: v.shape for k, v in flatten(g).items()} == want_g
    assert flatten(layers[0])["gdn.A_log"].dtype == np.float32
    assert flatten(layers[0])["moe.wi_gate"].dtype == BF16
    back = to_hf(CFG, layout, g, layers)
    assert list(back) == list(hk.all_expected_keys(CFG, layout))
    for k, a in t.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape and back[k].tobytes() == a.tobytes(), k
        assert back[k].flags.c_contiguous, k


def test_mapping_semantics():
    """The splits and orientations, checked against the HF formulas directly."""
    lay = hk.HFLayout(hk.HUB_PREFIX, hk.FUSED)
    t = random_hf(CFG, lay, dtype=np.float32)
    g, layers = to_ours(CFG, lay, t)
    kd, vd, i_ = CFG.gdn_key_dim, CFG.gdn_value_dim, CFG.moe_intermediate_size
    p = "model.language_model.layers.0."
    gdn, moe = layers[0]["gdn"], layers[0]["moe"]
    qkv = t[p + "linear_attn.in_proj_qkv.weight"]
    np.testing.assert_array_equal(gdn["in_proj_q"]["kernel"], qkv[:kd].T)
    np.testing.assert_array_equal(gdn["in_proj_k"]["kernel"], qkv[kd:2 * kd].T)
    np.testing.assert_array_equal(gdn["in_proj_v"]["kernel"], qkv[2 * kd:].T)
    conv = t[p + "linear_attn.conv1d.weight"]
    np.testing.assert_array_equal(gdn["conv_k"]["kernel"], conv[kd:2 * kd, 0, :].T)
    np.testing.assert_array_equal(gdn["conv_v"]["kernel"], conv[2 * kd:, 0, :].T)
    gu, down = t[p + "mlp.experts.gate_up_proj"], t[p + "mlp.experts.down_proj"]
    np.testing.assert_array_equal(moe["wi_gate"][3], gu[3, :i_].T)
    np.testing.assert_array_equal(moe["wi_up"][3], gu[3, i_:].T)
    np.testing.assert_array_equal(moe["wo"][3], down[3].T)
    np.testing.assert_array_equal(moe["shared_gate"]["kernel"], t[p + "mlp.shared_expert_gate.weight"].T)
    np.testing.assert_array_equal(g["lm_head"]["kernel"], t["lm_head.weight"].T)
    np.testing.assert_array_equal(g["embed"]["embedding"], t["model.language_model.embed_tokens.weight"])
    q = t["model.language_model.layers.1.self_attn.q_proj.weight"]
    assert CFG.layer_types[1] == FULL
    np.testing.assert_array_equal(layers[1]["attn"]["q_proj"]["kernel"], q.T)


def test_fused_and_per_expert_give_the_same_tree():
    fused = hk.HFLayout(hk.PLAIN_PREFIX, hk.FUSED)
    per = hk.HFLayout(hk.PLAIN_PREFIX, hk.PER_EXPERT)
    t = random_hf(CFG, fused)
    # per-expert tensors of the same weights, built from the HF formula (not from our code)
    tp = {k: v for k, v in t.items() if ".mlp.experts." not in k}
    i_ = CFG.moe_intermediate_size
    for li in range(CFG.num_hidden_layers):
        p = f"model.layers.{li}.mlp.experts."
        for e in range(CFG.num_experts):
            tp[f"{p}{e}.gate_proj.weight"] = t[p + "gate_up_proj"][e, :i_]
            tp[f"{p}{e}.up_proj.weight"] = t[p + "gate_up_proj"][e, i_:]
            tp[f"{p}{e}.down_proj.weight"] = t[p + "down_proj"][e]
    a, b = flatten({"l": to_ours(CFG, fused, t)[1]}), flatten({"l": to_ours(CFG, per, tp)[1]})
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == np.ascontiguousarray(b[k]).tobytes(), k


def test_specs_match_conversion_output():
    for lay in LAYOUTS:
        t = random_hf(CFG, lay)
        g, layers = to_ours(CFG, lay, t)
        dts = {k: v.dtype for k, v in flatten(layers[0]).items()}
        specs = hk.layer_hf_specs(CFG, lay, 0, dts)
        got = hk.layer_to_hf(CFG, lay, 0, layers[0])
        assert [(k, s, d) for k, s, d in specs] == [(k, a.shape, a.dtype) for k, a in got]
        lazy = list(hk.iter_layer_to_hf(CFG, lay, 0, layers[0]))
        assert [k for k, _ in lazy] == [k for k, _ in got]
        gspecs = hk.globals_hf_specs(CFG, lay, {k: v.dtype for k, v in flatten(g).items()})
        assert [s[0] for s in gspecs] == [k for k, _ in hk.globals_to_hf(CFG, lay, g)]


def test_detect_layout_and_skip_logging(caplog):
    lay = hk.HFLayout(hk.HUB_PREFIX, hk.FUSED)
    keys = list(random_hf(CFG, lay))
    extras = ["mtp.fc.weight", "mtp.layers.0.mlp.experts.0.up_proj.weight", "mtp.norm.weight",
              "model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.weight"]
    with caplog.at_level(logging.INFO, logger="clover_jax.hf_keys"):
        got, text = hk.detect_layout(keys + extras, source="ck")
    assert got == lay and text == keys
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert any("3 tensors" in m and "'mtp.'" in m for m in lines)
    assert any("2 tensors" in m and "'model.visual.'" in m for m in lines)
    per = hk.HFLayout(hk.PLAIN_PREFIX, hk.PER_EXPERT)
    assert hk.detect_layout(list(random_hf(CFG, per)) + ["model.visual.x"])[0] == per
    # a plain-prefix text name inside a hub checkpoint is not skipped: it surfaces as unexpected
    _, text = hk.detect_layout(keys + ["model.norm.weight"])
    with pytest.raises(hk.HFMappingError, match=r"unexpected tensors.*'model\.norm\.weight'"):
        hk.check_tensor_names(CFG, lay, text)


def test_detect_layout_errors():
    with pytest.raises(hk.HFMappingError, match="no text-model tensors"):
        hk.detect_layout(["foo.weight", "mtp.fc.weight"], source="ck")
    keys = list(random_hf(CFG, hk.HFLayout(hk.PLAIN_PREFIX, hk.FUSED)))
    with pytest.raises(hk.HFMappingError, match=r"mixed expert layouts.*layers\.0\.mlp\.experts\.0\.gate_proj"):
        hk.detect_layout(keys + ["model.layers.0.mlp.experts.0.gate_proj.weight"])
    no_experts = [k for k in keys if ".experts." not in k]
    with pytest.raises(hk.HFMappingError, match="no routed-expert tensors"):
        hk.detect_layout(no_experts)
    with pytest.raises(hk.HFMappingError, match="unknown HF prefix"):
        hk.HFLayout("transformer.", hk.FUSED)


def test_name_check_errors_name_the_key():
    lay = hk.HFLayout(hk.PLAIN_PREFIX, hk.PER_EXPERT)
    keys = list(random_hf(CFG, lay))
    hk.check_tensor_names(CFG, lay, keys)
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(hk.HFMappingError, match=f"missing tensor '{gone}'"):
        hk.check_tensor_names(CFG, lay, [k for k in keys if k != gone])
    with pytest.raises(hk.HFMappingError, match=r"unexpected tensors.*layers\.0\.linear_attn\.bd_gdn_softmax_scalars"):
        hk.check_tensor_names(CFG, lay, keys + ["model.layers.0.linear_attn.bd_gdn_softmax_scalars"])


def test_shape_and_missing_errors_in_conversion():
    lay = hk.HFLayout(hk.PLAIN_PREFIX, hk.FUSED)
    t = random_hf(CFG, lay)
    key = "model.layers.0.linear_attn.in_proj_qkv.weight"
    bad = dict(t, **{key: t[key][:-1]})
    want = (2 * CFG.gdn_key_dim + CFG.gdn_value_dim, CFG.hidden_size)
    msg = rf"'{key}' has shape \({want[0] - 1}, {want[1]}\), expected \({want[0]}, {want[1]}\)"
    with pytest.raises(hk.HFMappingError, match=msg):
        hk.hf_to_layer(CFG, lay, 0, bad)
    del bad[key]
    with pytest.raises(hk.HFMappingError, match=f"missing tensor '{key}'"):
        hk.hf_to_layer(CFG, lay, 0, bad)


def test_ours_to_hf_errors():
    lay = hk.HFLayout(hk.PLAIN_PREFIX, hk.FUSED)
    _, layers = to_ours(CFG, lay, random_hf(CFG, lay))
    layer = flatten(layers[0])
    with pytest.raises(hk.HFMappingError, match="layer 0: param 'moe.wo' has shape"):
        hk.layer_to_hf(CFG, lay, 0, unflatten({**layer, "moe.wo": layer["moe.wo"][:, :-1]}))
    mixed = unflatten({**layer, "gdn.in_proj_k.kernel": layer["gdn.in_proj_k.kernel"].astype(np.float32)})
    with pytest.raises(hk.HFMappingError, match="in_proj_k.kernel"):
        hk.layer_to_hf(CFG, lay, 0, mixed)
    with pytest.raises(hk.HFMappingError, match="share one HF tensor"):
        hk.layer_hf_specs(CFG, lay, 0, {k: v.dtype for k, v in flatten(mixed).items()})


def test_tied_embeddings_have_no_head():
    cfg = CFG.replace(tie_word_embeddings=True)
    lay = hk.HFLayout(hk.PLAIN_PREFIX, hk.FUSED)
    keys = hk.all_expected_keys(cfg, lay)
    assert hk.LM_HEAD_KEY not in keys
    hk.check_tensor_names(cfg, lay, list(keys) + [hk.LM_HEAD_KEY])  # a redundant tied head is tolerated
    g = hk.hf_to_globals(cfg, lay, random_hf(cfg, lay))
    assert set(g) == {"embed", "final_norm"}

