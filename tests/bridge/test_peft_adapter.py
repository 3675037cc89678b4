"""PEFT adapter export of LoRA params (clover_jax.bridge.peft_adapter) against transformers + peft.

A tiny random HF `Qwen3_5MoeForCausalLM` (every parameter random, `hf_fixtures`) is read into our
model; random non-zero adapters go on every default target (attention, GDN and shared-expert
projections, the routed experts) plus the router and the shared-expert gate. Oracles,
criterion of the HF parity tests, ``max|ours - ref| <= REL * max|ref|``:

* our adapted model's AR logits (fp32) = transformers' model with the same base weights and our
  adapter dir loaded by ``peft.PeftModel.from_pretrained``, and = transformers' model loaded plainly
  from our merged export (`sft.export.export_params`, the default export). transformers runs in fp64
  (eager experts: torch's grouped_mm has no fp64): with adapters this large its own fp32 forward is
  ~2e-5 off its fp64 one, so an fp32-vs-fp32 comparison would measure both sides' rounding;
* the adapter's tensor names and shapes = the state dict ``peft.get_peft_model`` builds on the tiny
  model from our ``adapter_config.json`` (PEFT's own naming, not ours);
* a partial target set (some layers, one part of a fused weight): PEFT's own merge
  (``merge_and_unload``) of our adapter = our merged export, weight by weight.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from flax import nnx

from clover_jax.api import load_hf
from clover_jax.bridge import peft_adapter as pa
from clover_jax.model import lora
from clover_jax.model.clover_model import abstract_model, model_from_params, model_to_params
from clover_jax.model.params import flatten, unflatten
from tests.hf_fixtures import hf_logits, make_hf_model, read_all_tensors, write_save_pretrained


REL = 2e-5
RANK, ALPHA = 4, 6.0  # scale 1.5: a wrong alpha / rank pattern shows
EXTRA_TARGETS = (r"\.moe\.router\.kernel$", r"\.moe\.shared_gate\.kernel$")  # (the LM head takes no adapter)


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _lora_params(base_cfg, base_params, targets, seed: int = 1):
    """(LoRA config, stacked params): the base weights of ``base_params`` and random non-zero
    adapters on ``targets`` (std 0.5 / sqrt(fan-in): the update moves the logits by O(1))."""
    lcfg = base_cfg.replace(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=targets)
    shapes = flatten(model_to_params(abstract_model(lcfg)))
    base = flatten(jax.device_get(base_params))
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in shapes.items():
        if lora.is_adapter(k):
            out[k] = (0.5 / np.sqrt(v.shape[-2]) * rng.standard_normal(v.shape)).astype(np.float32)
        else:
            out[k] = base[k]
    return lcfg, unflatten(out)


def _merged_export(lcfg, params, out):
    """Our default (merged) export of the LoRA params, fp32, format qwen."""
    from sft.config import ExportConfig, SFTConfig
    from sft.export import export_params
    from train.config import LoggingConfig

    cfg = SFTConfig(export=ExportConfig(format="qwen", dtype="float32"), logging=LoggingConfig(run_dir=f"{out}_run"))
    return export_params(cfg, lcfg, None, params, 1, out=out, overwrite=False)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(tmp dir, ModelConfig, base params) of the tiny HF model read by our bridge (fp32, AR)."""
    tmp = tmp_path_factory.mktemp("peft")
    hf_dir = write_save_pretrained(make_hf_model(seed=0), tmp / "hf")
    cfg, model = load_hf(hf_dir, dtype=jnp.float32)
    return tmp, cfg, model_to_params(model)


def _fp64(model):
    """An HF model in fp64 (the routed experts in their eager loop: grouped_mm has no fp64)."""
    model.config._experts_implementation = "eager"
    return model.double().eval()


def _peft_model(adapter_dir, fp64: bool = False):
    base = make_hf_model(seed=0)
    return peft.PeftModel.from_pretrained(_fp64(base) if fp64 else base, str(adapter_dir)).eval()


def test_peft_loads_our_adapter_and_gives_our_logits(base):
    tmp, cfg, base_params = base
    lcfg, params = _lora_params(cfg, base_params, lora.DEFAULT_TARGETS + EXTRA_TARGETS)
    ids = np.asarray(jax.random.randint(jax.random.key(0), (2, 19), 0, cfg.vocab_size))
    ours = np.asarray(nnx.jit(lambda m, x: m(x))(model_from_params(lcfg, params), jnp.asarray(ids)))
    base_logits = hf_logits(_fp64(make_hf_model(seed=0)), ids)
    assert _rel_err(ours, base_logits) > 0.05  # the adapters matter

    out = pa.write_peft_adapter(lcfg, params, tmp / "adapter")
    conf = json.loads((out / pa.ADAPTER_CONFIG).read_text())
    # the fused weights: one adapter of 3r / 2r with alpha scaled alike (scale alpha / r kept)
    assert conf["rank_pattern"] == {"linear_attn.in_proj_qkv": 3 * RANK, "mlp.experts.gate_up_proj": 2 * RANK}
    assert conf["alpha_pattern"] == {"linear_attn.in_proj_qkv": 3 * ALPHA, "mlp.experts.gate_up_proj": 2 * ALPHA}
    assert sorted(conf["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight"]
    assert "self_attn.q_proj" in conf["target_modules"] and "mlp.shared_expert_gate" in conf["target_modules"]

    # names and shapes: what PEFT itself builds from our config on the same model
    built = peft.get_peft_model(make_hf_model(seed=0), peft.LoraConfig.from_pretrained(str(out)))
    want = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(built).items()}
    got = {k: v.shape for k, v in read_all_tensors(out).items()}
    assert got == want
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight" in got  # gate_up, nested
    assert got["base_model.model.model.layers.0.mlp.experts.lora_B.weight"] == (cfg.hidden_size, RANK * cfg.num_experts)

    peft_logits = hf_logits(_peft_model(out, fp64=True), ids)
    assert _rel_err(ours, peft_logits) <= REL, _rel_err(ours, peft_logits)

    merged = _merged_export(lcfg, params, tmp / "merged")
    from transformers import Qwen3_5MoeForCausalLM

    merged_logits = hf_logits(_fp64(Qwen3_5MoeForCausalLM.from_pretrained(merged, attn_implementation="eager")), ids)
    assert _rel_err(ours, merged_logits) <= REL, _rel_err(ours, merged_logits)


def test_partial_targets_merge_in_peft_as_in_our_export(base):
    """Adapters on some layers only (`groups.layer_1` = layers 1 and 3), on one part of each fused
    weight (in_proj_k of in_proj_qkv, wi_up of gate_up_proj): per-layer names, zero blocks, nesting
    that differs by layer; PEFT's merge of the adapter = our merged export."""
    tmp, cfg, base_params = base
    targets = (r"\.gdn\.in_proj_k\.kernel$", r"\.moe\.wi_up$", r"groups\.layer_1\.moe\.wo$",
               r"groups\.layer_1\.attn\.o_proj\.kernel$", r"\.moe\.shared_down_proj\.kernel$")
    lcfg, params = _lora_params(cfg, base_params, targets, seed=2)
    out = pa.write_peft_adapter(lcfg, params, tmp / "adapter_partial")
    conf = json.loads((out / pa.ADAPTER_CONFIG).read_text())
    assert sorted(conf["target_modules"]) == ["linear_attn.in_proj_qkv", "mlp.shared_expert.down_proj",
                                              "self_attn.o_proj"]  # every full-attention layer has it
    assert sorted(conf["target_parameters"]) == ["layers.1.mlp.experts.down_proj", "layers.3.mlp.experts.down_proj",
                                                 "mlp.experts.gate_up_proj"]
    built = peft.get_peft_model(make_hf_model(seed=0), peft.LoraConfig.from_pretrained(str(out)))
    want = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(built).items()}
    got = {k: v.shape for k, v in read_all_tensors(out).items()}
    assert got == want
    assert "base_model.model.model.layers.0.mlp.experts.lora_A.weight" in got  # gate_up alone: not nested
    assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight" in got

    with torch.no_grad():
        peft_merged = {k: v.float().numpy() for k, v in _peft_model(out).merge_and_unload().state_dict().items()}
    from transformers import Qwen3_5MoeForCausalLM

    ours = Qwen3_5MoeForCausalLM.from_pretrained(_merged_export(lcfg, params, tmp / "merged_partial"),
                                                 attn_implementation="eager").state_dict()
    base_sd = make_hf_model(seed=0).state_dict()
    changed = 0
    for k, v in ours.items():
        np.testing.assert_allclose(peft_merged[k], v.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
        changed += not torch.equal(v, base_sd[k])
    # q/v rows of in_proj_qkv, gate rows of gate_up_proj stay exactly the base (zero blocks)
    qkv = "model.layers.0.linear_attn.in_proj_qkv.weight"
    kd = cfg.gdn_key_dim
    np.testing.assert_array_equal(peft_merged[qkv][:kd], base_sd[qkv].numpy()[:kd])
    assert not np.array_equal(peft_merged[qkv][kd:2 * kd], base_sd[qkv].numpy()[kd:2 * kd])
    # in_proj_qkv (2 GDN layers), gate_up_proj (4), down_proj and o_proj (2 each), shared down_proj (4)
    assert changed == 2 + 4 + 2 + 2 + 4


def test_refusals(base, tmp_path):
    tmp, cfg, base_params = base
    with pytest.raises(pa.PeftExportError, match="no LoRA adapters"):
        pa.write_peft_adapter(cfg, jax.device_get(base_params), tmp_path / "a")
    # a param trained in full that transformers' model has: refused, naming pattern and param
    paths = ["groups.layer_0.input_norm.scale", "groups.layer_0.gdn.bd_gdn_softmax_scalars",
             "groups.layer_0.gdn.conv_q.right", "groups.layer_0.gdn.conv_q.kernel"]
    with pytest.raises(pa.PeftExportError, match=r"'\\\\.input_norm\\\\.scale\$'.*groups.layer_0.input_norm.scale"):
        pa.check_full_trainable(paths, (r"\.input_norm\.scale$",))
    # the Clover block-mode tensors are not in transformers' model: left out, and listed
    assert pa.check_full_trainable(paths, (r"\.bd_gdn_softmax_scalars$", r"\.conv_(q|k|v)\.right$")) == paths[1:3]
    # a non-empty target is refused without overwrite
    lcfg, params = _lora_params(cfg, base_params, (r"\.attn\.q_proj\.kernel$",))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("other model")
    with pytest.raises(pa.CheckpointError, match="not empty"):
        pa.write_peft_adapter(lcfg, params, tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "other model"
