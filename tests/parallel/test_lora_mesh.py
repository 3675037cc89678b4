"""LoRA adapters under FSDP, expert and context parallelism: a short training run of the adapted
model on a (fsdp=2, expert=2, context=2) mesh equals the one-device run (the harness of
test_context.py: every param randomised, adapters included; plain SGD, so a wrong gradient shows in
the next step's loss), and the adapters shard like their base weight's outer dims."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from clover_jax.model import lora
from clover_jax.model.clover_model import abstract_model, create_model, model_to_params
from clover_jax.parallel import sharding as sh
from tests.model.parity_utils import FAST_COMPILE, FP32_REL, assert_rel_close
from tests.parallel.test_context import CFG, STEPS, _batches, _train

LCFG = CFG.replace(lora_rank=2, lora_alpha=4.0)


def test_adapters_shard_like_their_base_weight():
    specs = sh.param_specs(abstract_model(LCFG), sh.make_mesh(sh.MeshConfig(fsdp=2, expert=2, tensor=2)))
    g0, g1 = specs["groups"]["layer_0"], specs["groups"]["layer_1"]
    assert g0["moe"]["wi_gate"] == P(None, "expert", "fsdp", "tensor")
    assert g0["moe"]["wi_gate_lora_a"] == P(None, "expert", "fsdp", None)
    # B's rank dim takes fsdp (its other dims do not): no adapter is replicated over fsdp
    assert g0["moe"]["wi_gate_lora_b"] == P(None, "expert", "fsdp", "tensor")
    assert g1["attn"]["q_proj"]["lora_a"] == P(None, "fsdp", None)
    assert g1["attn"]["q_proj"]["lora_b"] == P(None, "fsdp", "tensor")


def test_lora_training_on_fsdp_expert_context_mesh_equals_single_device():
    init = jax.jit(lambda: model_to_params(create_model(LCFG, seed=0))).lower().compile(compiler_options=FAST_COMPILE)
    rs = np.random.RandomState(1)
    params = jax.tree.map(lambda w: jnp.asarray(np.asarray(w) + 0.1 * rs.normal(size=w.shape).astype(np.float32)), init())
    length, block = 64, 32
    batches = _batches(length, block)
    _, (ref_loss, ref_ar, ref_bd, ref_grads) = _train(params, batches, block, base_cfg=LCFG)
    mesh = sh.make_mesh(sh.MeshConfig(fsdp=2, expert=2, context=2))
    _, (loss, ar, bd, grads) = _train(params, batches, block, mesh, base_cfg=LCFG)
    for i in range(STEPS):
        assert_rel_close(loss[i], ref_loss[i], FP32_REL, f"step {i} loss")
    assert_rel_close(ar[0], ref_ar[0], FP32_REL, "AR logits")
    assert_rel_close(bd[0], ref_bd[0], FP32_REL, "block logits")
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    assert any(lora.is_adapter(jax.tree_util.keystr(p, simple=True, separator=".")) for p, _ in flat)
    scale = max(float(jnp.max(jnp.abs(g[0]))) for g in jax.tree.leaves(ref_grads))
    for (path, g), r in zip(flat, jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g[0], r[0], rtol=0, atol=FP32_REL * scale, err_msg=jax.tree_util.keystr(path))
