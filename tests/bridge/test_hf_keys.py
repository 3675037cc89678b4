"""`clover_jax.bridge.hf_keys`: names, layouts, shapes and the byte-exact HF <-> per-layer mapping (numpy
only, no files, no torch)."""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import pytest

from clover_jax.bridge import hf_keys as hk
from clover_jax.config import FULL, get_preset
from clover_jax.model.params import flatten, global_param_shapes, layer_param_shapes, unflatten

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
    with caplog.at_level(logging.INFO, logger="clover_jax.bridge.hf_keys"):
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



# ------------------------------------------------------------------------------------------
# streaming: TensorSource in, row blocks out
# ------------------------------------------------------------------------------------------


class DictSource:
    """An in-memory `hk.TensorSource` that logs every read (whole tensor or row range)."""

    def __init__(self, tensors):
        self.t, self.reads = tensors, []

    def __contains__(self, key):
        return key in self.t

    def shape(self, key):
        return self.t[key].shape

    def dtype(self, key):
        return self.t[key].dtype

    def get(self, key):
        self.reads.append((key, None))
        return self.t[key].copy()

    def get_rows(self, key, start, stop):
        self.reads.append((key, (start, stop)))
        return self.t[key][start:stop].copy()


def assert_trees_identical(a, b):
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        x, y = fa[k], fb[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes(), k


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l.prefix}{l.expert_layout}")
def test_streaming_from_a_source_matches_the_dict_path(layout):
    t = random_hf(CFG, layout, seed=3)
    src = DictSource(t)
    block = 96  # bytes: forces many row blocks per tensor (and one-row blocks for wide ones)
    g = hk.hf_to_globals(CFG, layout, src, max_block_bytes=block)
    assert_trees_identical(g, hk.hf_to_globals(CFG, layout, t))
    for i in range(CFG.num_hidden_layers):
        layer = hk.hf_to_layer(CFG, layout, i, src, max_block_bytes=block)
        assert_trees_identical(layer, hk.hf_to_layer(CFG, layout, i, t))
        for k, v in flatten(layer).items():
            assert v.flags.c_contiguous, k  # filled in place: nothing for a writer to copy
    # big tensors were read in row blocks, never whole
    head = [r for k, r in src.reads if k == hk.LM_HEAD_KEY]
    assert len(head) > 1 and all(r is not None for r in head)
    assert {k for k, _ in src.reads} == set(t)


def test_iter_hf_globals_reads_each_global_only_when_asked():
    lay = hk.HFLayout(hk.HUB_PREFIX, hk.FUSED)
    src = DictSource(random_hf(CFG, lay))
    it = hk.iter_hf_globals(CFG, lay, src)
    assert src.reads == []
    key, emb = next(it)
    assert key == "embed.embedding" and {k for k, _ in src.reads} == {lay.prefix + "embed_tokens.weight"}
    assert [k for k, _ in it] == ["final_norm.scale", "lm_head.kernel"]


def test_streaming_source_errors():
    lay = hk.HFLayout(hk.PLAIN_PREFIX, hk.PER_EXPERT)
    t = random_hf(CFG, lay)
    key = "model.layers.0.mlp.experts.3.up_proj.weight"
    with pytest.raises(hk.HFMappingError, match=rf"'{key}' has shape \(8, 8\), expected"):
        hk.hf_to_layer(CFG, lay, 0, DictSource({**t, key: np.zeros((8, 8), BF16)}))
    with pytest.raises(hk.HFMappingError, match=f"src: missing tensor '{key}'"):
        hk.hf_to_layer(CFG, lay, 0, DictSource({k: v for k, v in t.items() if k != key}), source="src")
    with pytest.raises(hk.HFMappingError, match=f"'{key}' has dtype float32"):
        hk.hf_to_layer(CFG, lay, 0, DictSource({**t, key: t[key].astype(np.float32)}))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l.prefix}{l.expert_layout}")
def test_row_blocks_to_hf_match_the_whole_tensors(layout):
    t = random_hf(CFG, layout, seed=4)
    g, layers = to_ours(CFG, layout, t)
    # contiguous leaves, as a checkpoint restore gives them
    layers = [unflatten({k: np.ascontiguousarray(v) for k, v in flatten(la).items()}) for la in layers]
    block = 200
    streamed = {}
    for i, layer in enumerate(layers):
        order = []
        leaves = list(flatten(layer).values())
        for key, blocks in hk.iter_layer_to_hf_blocks(CFG, layout, i, layer, max_block_bytes=block):
            bs = list(blocks)
            assert all(b.flags.c_contiguous for b in bs), key
            row = t[key][0].nbytes if t[key].ndim else t[key].nbytes
            if not (len(bs) == 1 and any(bs[0] is leaf for leaf in leaves)):  # a leaf passed through as is
                assert all(b.nbytes <= max(block, row) for b in bs), key  # or copied in small blocks
            streamed[key] = np.concatenate(bs) if t[key].ndim else bs[0]
            order.append(key)
        dts = {k: v.dtype for k, v in flatten(layer).items()}
        assert order == [k for k, _, _ in hk.layer_hf_specs(CFG, layout, i, dts)]
    for key, blocks in hk.iter_globals_to_hf_blocks(CFG, layout, g, max_block_bytes=block):
        streamed[key] = np.concatenate(list(blocks))
    assert list(streamed) != [] and set(streamed) == set(t)
    for k, a in t.items():
        assert streamed[k].dtype == a.dtype and streamed[k].tobytes() == a.tobytes(), k


def test_globals_to_hf_blocks_from_a_reader_are_lazy():
    lay = hk.HFLayout(hk.PLAIN_PREFIX, hk.FUSED)
    t = random_hf(CFG, lay)
    g = flatten(to_ours(CFG, lay, t)[0])
    calls = []

    def read(key):
        calls.append(key)
        return g[key]

    it = hk.iter_globals_to_hf_blocks(CFG, lay, read)
    assert calls == []
    got = {}
    for key, blocks in it:
        assert calls[-1] == {"model.embed_tokens.weight": "embed.embedding", "model.norm.weight": "final_norm.scale",
                             hk.LM_HEAD_KEY: "lm_head.kernel"}[key]  # read just before its HF tensor
        got[key] = np.concatenate(list(blocks))
    assert calls == ["embed.embedding", "final_norm.scale", "lm_head.kernel"]
    for k, a in got.items():
        assert a.tobytes() == t[k].tobytes(), k
    with pytest.raises(hk.HFMappingError, match="globals: param 'embed.embedding' has shape"):
        next(hk.iter_globals_to_hf_blocks(CFG, lay, lambda k: g[k][:-1]))
