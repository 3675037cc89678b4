"""Numerical parity with transformers' `Qwen3_5MoeForCausalLM` (fp32, torch CPU, eager attention).

Every HF parameter is randomised (norms, A_log, dt_bias included: `hf_fixtures.make_hf_model`), and
our model is built from the HF weights both ways a user gets them:

* ``orbax``: `save_pretrained` dir (per-expert, prefix `model.`) -> `convert_hf_to_orbax` ->
  `load_params_checkpoint` -> `stack_layers` -> `model_from_params`;
* ``load_hf``: fused hub-layout dir (prefix `model.language_model.`, sharded, fp32 weights) -> `load_hf`.

Criterion everywhere (fp32): ``max|ours - ref| <= 2e-5 * max|ref|``. Covered:

1. full-model logits on four configs that vary hidden size, head dims, dk != dv, GQA ratio (4:1, 2:2,
   8:2, 4:2), GDN key/value head ratio (2, 3, 1), layer pattern ([lin,lin,lin,full], [lin,full] x2,
   [full,lin,lin], non-repeating [lin,full,full,lin]), experts / top-k (4/2, 8/3, 6/1, 8/8),
   partial rotary 0.25 / 0.5 / 1.0, rope_theta, rms_norm_eps, GDN chunk 16 / 64 with T not a multiple;
2. per module, to localise a full-model failure: the first GDN layer, attention layer and MoE block of
   each config on random hidden states; and every submodule (input norm, mixer, post norm, MoE,
   final norm) of every layer fed HF's own input to it, so the message names the first bad one;
3. cached decoding (extend 2 tokens, extend 15 more from the cache, then one token at a time) vs
   HF's full forward and ours;
4. packed rows (two documents + pad segment per row) vs HF on each document alone;
5. `moe_impl="dense"`;
6. bf16: a bf16 hub checkpoint read in fp32 equals HF on the same rounded weights (fp32 tolerance);
   bf16 params + compute close to HF fp32 (rms 5e-2, max 0.15 relative), argmax equal on >= 90%.

Compile time dominates on CPU: the jitted wrappers below are shared, so a shape compiles once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from clover_jax.bridge import convert
from clover_jax.api import load_hf
from clover_jax.config import FULL, LINEAR, ModelConfig
from clover_jax.model.clover_model import CloverModel, document_positions, model_from_params
from clover_jax.model.params import stack_layers
from clover_jax.bridge.params_checkpoint import load_params_checkpoint
from tests.hf_fixtures import HUB_FP32_SUFFIXES, hf_logits, make_hf_model, write_fused_hub, write_save_pretrained
from tests.model.parity_utils import (
    assert_rel_close,
    hf_causal_mask,
    hf_position_embeddings,
    our_attention_ctx,
    our_gdn_ctx,
    our_layer,
    our_layer_ctx,
    our_moe_ctx,
    to_torch,
)

REL = 2e-5  # fp32 parity: max abs error <= REL * max |ref|
BF16_RMS_REL = 5e-2  # bf16 weights + compute vs HF fp32: rms error / rms logit
BF16_MAX_REL = 0.15  # ... and max error / max logit (HF's own bf16 reaches ~6e-2 here)
BF16_ARGMAX_AGREE = 0.9
BATCH = 2


def _rope(theta: float, partial: float, mrope: list[int]) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial, "mrope_section": mrope}


#: name -> (HF config overrides on top of hf_fixtures.TINY_HF_CONFIG, our runtime kwargs, seq len T)
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {
    # 35B-like pattern, GQA 4:1, GDN 2 key / 4 value heads (dk 8 != dv 12), rotary 4 of 16, chunk 16
    "lin3full_gqa4": (
        dict(hidden_size=32, num_hidden_layers=4, layer_types=[LINEAR] * 3 + [FULL],
             num_attention_heads=4, num_key_value_heads=1, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=12,
             rope_parameters=_rope(1e4, 0.25, [1, 1, 0])),
        dict(gdn_chunk_size=16), 21),
    # 2 groups of [lin, full], MHA 2:2, GDN 1 key / 3 value heads (dk 16 > dv 8), rotary 12 of 24,
    # 8 experts top-3, chunk 64 with T = 70 (two chunks, the last partial)
    "linfull_x2_mha": (
        dict(hidden_size=48, num_hidden_layers=4, layer_types=[LINEAR, FULL] * 2,
             num_attention_heads=2, num_key_value_heads=2, head_dim=24,
             linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=16, linear_value_head_dim=8,
             num_experts=8, num_experts_per_tok=3, moe_intermediate_size=8, shared_expert_intermediate_size=20,
             rope_parameters=_rope(1e6, 0.5, [2, 2, 2])),
        dict(gdn_chunk_size=64), 70),
    # attention first, GQA 8:2, full rotary, GDN 2:2 heads (dk 12 != dv 8), 6 experts top-1, eps 1e-5
    "fulllinlin_gqa8_2": (
        dict(hidden_size=24, num_hidden_layers=3, layer_types=[FULL, LINEAR, LINEAR],
             num_attention_heads=8, num_key_value_heads=2, head_dim=8,
             linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=12, linear_value_head_dim=8,
             num_experts=6, num_experts_per_tok=1, moe_intermediate_size=12, shared_expert_intermediate_size=8,
             rms_norm_eps=1e-5, rope_parameters=_rope(5e5, 1.0, [1, 1, 2])),
        dict(gdn_chunk_size=16), 19),
    # non-repeating pattern (one group of 4), GQA 4:2, 35B rope (theta 1e7, 0.25), top-k = all experts
    "nonrepeating": (
        dict(hidden_size=32, num_hidden_layers=4, layer_types=[LINEAR, FULL, FULL, LINEAR],
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             num_experts=8, num_experts_per_tok=8, moe_intermediate_size=8, shared_expert_intermediate_size=16,
             rope_parameters=_rope(1e7, 0.25, [1, 1, 0])),
        dict(gdn_chunk_size=16), 37),
}
NAMES = list(CONFIGS)
PATHS = ("orbax", "load_hf")


@dataclass
class Built:
    name: str
    hf: Any  # Qwen3_5MoeForCausalLM, fp32
    cfg: ModelConfig
    models: dict[str, CloverModel]  # by PATHS
    sp_dir: Path
    hub_dir: Path
    ids: np.ndarray  # [B, T]
    ref: np.ndarray  # HF logits [B, T, V]


def _ids(seed: int, b: int, t: int, vocab: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, (b, t))


def _build(name: str, root: Path) -> Built:
    hf_over, runtime, t = CONFIGS[name]
    seed = NAMES.index(name)
    hf = make_hf_model(seed=seed, **hf_over)
    sp_dir = write_save_pretrained(hf, root / "save_pretrained")
    hub_dir = write_fused_hub(hf, root / "hub_fp32", dtype=torch.float32, max_shard_bytes=40_000)
    ck_cfg, tree = load_params_checkpoint(convert.convert_hf_to_orbax(sp_dir, root / "orbax"))
    ck_cfg = ck_cfg.replace(**runtime)
    m_orbax = model_from_params(ck_cfg, stack_layers(ck_cfg, tree))
    hub_cfg, m_hub = load_hf(hub_dir, **runtime)
    assert hub_cfg == ck_cfg, "the two load paths read different configs"
    ids = _ids(100 + seed, BATCH, t, hub_cfg.vocab_size)
    return Built(name, hf, ck_cfg, {"orbax": m_orbax, "load_hf": m_hub}, sp_dir, hub_dir, ids, hf_logits(hf, ids))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = _build(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


# shared jitted wrappers (nnx.jit caches by graphdef + shapes)
_forward = nnx.jit(lambda m, ids, pos, seg: m(ids, pos, seg))
_extend = nnx.jit(lambda m, ids, cache: m.extend(ids, cache))
_gdn = nnx.jit(lambda layer, x, ctx: layer.gdn(x, ctx, None)[0])
_attn = nnx.jit(lambda layer, x, ctx: layer.attn(x, ctx, None)[0])
_moe = nnx.jit(lambda layer, x, ctx: layer.moe(x, ctx)[0])
_norm = nnx.jit(lambda norm, x: norm(x))


def forward(model: CloverModel, ids: Any, positions: Any = None, segment_ids: Any = None) -> np.ndarray:
    pos = None if positions is None else jnp.asarray(positions, jnp.int32)
    seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    return np.asarray(_forward(model, jnp.asarray(ids, jnp.int32), pos, seg))


def _first_layer(cfg: ModelConfig, kind: str) -> int:
    return cfg.layer_types.index(kind)


def _hidden(seed: int, b: int, t: int, d: int) -> np.ndarray:
    return np.random.RandomState(seed).randn(b, t, d).astype(np.float32)


# ------------------------------------------------------------------------------------------
# 1. full-model logits
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", NAMES)
def test_logits_parity(built, name, path):
    b = built(name)
    assert b.cfg.num_hidden_layers == len(CONFIGS[name][0]["layer_types"])
    ours = forward(b.models[path], b.ids)
    assert ours.dtype == np.float32
    assert_rel_close(ours, b.ref, REL, f"{name}/{path} logits")


def test_configs_cover_the_brief():
    """The config set really varies what it claims to (guards edits to CONFIGS)."""
    cfgs = [ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe_text", **over}) for over, _, _ in CONFIGS.values()]
    assert {c.partial_rotary_factor for c in cfgs} >= {0.25, 0.5, 1.0}
    assert len({c.num_attention_heads // c.num_key_value_heads for c in cfgs}) >= 3
    assert all(c.linear_key_head_dim != c.linear_value_head_dim for c in cfgs[:3])
    assert len({c.layer_types for c in cfgs}) == len(cfgs)
    assert any(c.group_size == c.num_hidden_layers and c.layer_types[0] == LINEAR for c in cfgs)  # non-repeating
    assert len({(c.num_experts, c.num_experts_per_tok) for c in cfgs}) == len(cfgs)
    for (_, runtime, t) in CONFIGS.values():
        assert t % runtime["gdn_chunk_size"] != 0 and t > runtime["gdn_chunk_size"]


# ------------------------------------------------------------------------------------------
# 2. per-module parity (localises a full-model failure)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_gdn_layer_parity(built, name):
    b = built(name)
    i = _first_layer(b.cfg, LINEAR)
    t = CONFIGS[name][2]
    x = _hidden(1, BATCH, t, b.cfg.hidden_size)
    ref = b.hf.model.layers[i].linear_attn(to_torch(x)).numpy()
    ours = np.asarray(_gdn(our_layer(b.models["load_hf"], i), jnp.asarray(x), our_gdn_ctx(b.cfg, BATCH, t)))
    assert_rel_close(ours, ref, REL, f"{name} layer {i} GatedDeltaNet")


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_attention_layer_parity(built, name):
    b = built(name)
    i = _first_layer(b.cfg, FULL)
    t = CONFIGS[name][2]
    x = _hidden(2, BATCH, t, b.cfg.hidden_size)
    # positions offset per row, so RoPE is checked away from position 0 too
    pos = np.arange(t)[None] + np.array([[0], [5]])
    xt = to_torch(x)
    ref, _ = b.hf.model.layers[i].self_attn(
        xt, position_embeddings=hf_position_embeddings(b.hf, xt, pos), attention_mask=hf_causal_mask(BATCH, t))
    ours = np.asarray(_attn(our_layer(b.models["load_hf"], i), jnp.asarray(x), our_attention_ctx(b.cfg, pos)))
    assert_rel_close(ours, ref.numpy(), REL, f"{name} layer {i} attention")


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_moe_block_parity(built, name):
    b = built(name)
    i = b.cfg.num_hidden_layers - 1
    t = CONFIGS[name][2]
    x = _hidden(3, BATCH, t, b.cfg.hidden_size)
    ref = b.hf.model.layers[i].mlp(to_torch(x)).numpy()
    ours = np.asarray(_moe(our_layer(b.models["load_hf"], i), jnp.asarray(x), our_moe_ctx(BATCH, t)))
    assert_rel_close(ours, ref, REL, f"{name} layer {i} MoE")


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_each_decoder_layer_parity(built, name):
    """Every layer, every submodule (input norm, mixer, post norm, MoE) of ours on HF's own input to
    that submodule (real activations of the token sequence, no error carried over from earlier
    layers) equals HF's: the failure message names the first bad layer and submodule."""
    b = built(name)
    hf_text = b.hf.model
    h = hf_text.embed_tokens(torch.as_tensor(b.ids, dtype=torch.long))
    t = b.ids.shape[1]
    pos = np.broadcast_to(np.arange(t), (BATCH, t))
    pe = hf_position_embeddings(b.hf, h, pos)
    mask = hf_causal_mask(BATCH, t)
    ctx = our_layer_ctx(b.cfg, pos)
    j = lambda x: jnp.asarray(x.numpy())  # noqa: E731
    for i, kind in enumerate(b.cfg.layer_types):
        ours, hl = our_layer(b.models["load_hf"], i), hf_text.layers[i]
        where = f"{name} layer {i} ({kind})"
        xn = hl.input_layernorm(h)
        assert_rel_close(_norm(ours.input_norm, j(h)), xn.numpy(), REL, f"{where} input_layernorm")
        if kind == FULL:
            mixed, _ = hl.self_attn(xn, position_embeddings=pe, attention_mask=mask)
            assert_rel_close(_attn(ours, j(xn), ctx["attn"]), mixed.numpy(), REL, f"{where} self_attn")
        else:
            mixed = hl.linear_attn(xn)
            assert_rel_close(_gdn(ours, j(xn), ctx["gdn"]), mixed.numpy(), REL, f"{where} linear_attn")
        h = h + mixed
        hn = hl.post_attention_layernorm(h)
        assert_rel_close(_norm(ours.post_norm, j(h)), hn.numpy(), REL, f"{where} post_attention_layernorm")
        moe = hl.mlp(hn)
        assert_rel_close(_moe(ours, j(hn), {"valid": ctx["valid"]}), moe.numpy(), REL, f"{where} mlp")
        h = h + moe
    final = hf_text.norm(h)
    assert_rel_close(_norm(b.models["load_hf"].final_norm, j(h)), final.numpy(), REL, f"{name} final norm")


# ------------------------------------------------------------------------------------------
# 3. cached decoding
# ------------------------------------------------------------------------------------------


def test_cached_decoding_parity(built):
    """extend(2 tokens) on an empty cache (fewer than the conv ring's K - 1 = 3), extend(15 tokens)
    continuing from the cache (chunked prefill: crosses the GDN chunk of 16 with a carried state and
    ring), then 4 single-token steps; logits equal HF's full forward and ours."""
    b = built("lin3full_gqa4")
    model = b.models["load_hf"]
    t = b.ids.shape[1]
    steps = [2, 15] + [1] * (t - 17)
    cache = model.init_cache(BATCH, t + 3)  # slack: unused slots must stay invisible
    outs, s = [], 0
    for n in steps:
        logits, cache = _extend(model, jnp.asarray(b.ids[:, s:s + n]), cache)
        outs.append(np.asarray(logits))
        s += n
    dec = np.concatenate(outs, axis=1)
    assert s == t and int(cache["index"]) == t
    assert_rel_close(dec[:, :17], b.ref[:, :17], REL, "prefill (2 + 15 tokens) vs HF")
    assert_rel_close(dec, b.ref, REL, "cached decoding vs HF full forward")
    assert_rel_close(dec, forward(model, b.ids), REL, "cached decoding vs our full forward")


# ------------------------------------------------------------------------------------------
# 4. packed rows
# ------------------------------------------------------------------------------------------


def test_packed_rows_parity(built):
    """Each row: doc 1 | doc 2 | 3 pads (segment 0), positions restarting per document; every
    document's logits equal HF run on that document alone. Second documents cross the GDN chunk
    border (chunk 16)."""
    b = built("lin3full_gqa4")
    vocab = b.cfg.vocab_size
    pad = 3
    splits = [(13, 9), (4, 18)]
    t = sum(splits[0]) + pad
    rows, segs, docs = [], [], []
    for r, (n1, n2) in enumerate(splits):
        d1, d2 = _ids(200 + 2 * r, 1, n1, vocab)[0], _ids(201 + 2 * r, 1, n2, vocab)[0]
        rows.append(np.concatenate([d1, d2, np.zeros(pad, int)]))
        segs.append(np.concatenate([np.full(n1, 1), np.full(n2, 2), np.zeros(pad, int)]))
        docs.append([(0, d1), (n1, d2)])
    ids, seg = np.stack(rows), np.stack(segs)
    assert ids.shape == (BATCH, t)
    pos = np.asarray(document_positions(jnp.asarray(seg, jnp.int32)))
    np.testing.assert_array_equal(pos[0, :14], list(range(13)) + [0])
    for path in PATHS:
        packed = forward(b.models[path], ids, pos, seg)
        for r in range(BATCH):
            for start, doc in docs[r]:
                ref = hf_logits(b.hf, doc[None])[0]
                assert_rel_close(packed[r, start:start + len(doc)], ref, REL,
                                 f"{path} row {r} doc at {start} (len {len(doc)})")


# ------------------------------------------------------------------------------------------
# 5. dense MoE path
# ------------------------------------------------------------------------------------------


def test_dense_moe_parity(built):
    b = built("lin3full_gqa4")
    cfg, model = load_hf(b.hub_dir, moe_impl="dense", **CONFIGS[b.name][1])
    assert cfg.moe_impl == "dense"
    assert_rel_close(forward(model, b.ids), b.ref, REL, "moe_impl=dense logits")


# ------------------------------------------------------------------------------------------
# 6. bf16
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_hub(built, tmp_path_factory):
    """The `nonrepeating` model written as on the hub: bf16, fp32 A_log / GDN norm."""
    b = built("nonrepeating")
    return b, write_fused_hub(b.hf, tmp_path_factory.mktemp("bf16") / "hub_bf16")


@torch.no_grad()
def test_bf16_checkpoint_fp32_compute_parity(bf16_hub):
    """A bf16 checkpoint read with dtype=float32 equals HF fp32 on the same bf16-rounded weights at
    the fp32 tolerance: exact check of reading / upcasting bf16 (and the fp32 A_log / norm) files."""
    b, hub = bf16_hub
    _, model = load_hf(hub, dtype=jnp.float32, **CONFIGS[b.name][1])
    hf_rounded = copy.deepcopy(b.hf)
    for n, p in hf_rounded.named_parameters():
        if not n.endswith(HUB_FP32_SUFFIXES):
            p.copy_(p.to(torch.bfloat16).float())
    ref = hf_logits(hf_rounded, b.ids)
    assert np.abs(ref - b.ref).max() > 1e3 * REL * np.abs(b.ref).max()  # the rounding matters
    assert_rel_close(forward(model, b.ids), ref, REL, "bf16 checkpoint, fp32 compute")


def test_bf16_close_to_hf_fp32(bf16_hub):
    """bf16 params + compute vs HF fp32 (original weights). These random tiny models are sensitive to
    bf16 (HF itself in bf16 lands at about 6e-2 max / 2e-2 rms relative error on this config; ours
    at about the same), so: rms error <= 5e-2 of the rms logit, max error <= 0.15 of the max logit,
    argmax equal on >= 90% of positions; plus dtype plumbing (params bf16 except fp32 A_log /
    dt_bias, fp32 logits) and bf16 really being used (error far above the fp32 one)."""
    b, hub = bf16_hub
    cfg, model = load_hf(hub, dtype=jnp.bfloat16, **CONFIGS[b.name][1])
    assert cfg.dtype == "bfloat16" and cfg.param_dtype == "bfloat16"
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            want = jnp.float32 if path[-1] in ("A_log", "dt_bias") else jnp.bfloat16
            assert var[...].dtype == want, (path, var[...].dtype)
    ours = forward(model, b.ids)
    assert ours.dtype == np.float32
    rms = lambda x: float(np.sqrt(np.mean(np.square(x))))  # noqa: E731
    rms_rel = rms(ours - b.ref) / rms(b.ref)
    assert rms_rel <= BF16_RMS_REL, f"bf16 rms error {rms_rel:.3e} of the rms logit"
    assert_rel_close(ours, b.ref, BF16_MAX_REL, "bf16 logits vs HF fp32")
    agree = float(np.mean(ours.argmax(-1) == b.ref.argmax(-1)))
    assert agree >= BF16_ARGMAX_AGREE, f"bf16 argmax agrees with HF fp32 on {agree:.0%} of positions"
    fp32_err = np.abs(forward(b.models["load_hf"], b.ids) - b.ref).max()
    assert np.abs(ours - b.ref).max() > 10 * fp32_err
