"""The LoRA recipe's real SFT step compiled for one TPU v5p host (configs/agent_mix_lora.yaml at small
widths: 2 layers of the small-cpu preset and rank 128, all TPU-tile multiples so that layout padding
stays small, rows of 8192 tokens, the recipe's v5p-8 layout of one row per chip after the
complementary copy). Oracles: the argument bytes counted from the param shapes,
the rule table and the dtype rule (frozen params in the compute dtype with no optimizer state,
adapters and the full-trainable params as fp32 masters with AdamW moments), and the LoRA analytic
step count (`sft.step_flops`), which the compiled program's FLOPs must match as the full fine-tuning
plans do (tests/train/test_aot.py)."""

from __future__ import annotations

import math
import re

from flax import nnx

from clover_jax.model.clover_model import abstract_model
from clover_jax.model.lora import ADAPTER_PATTERN
from clover_jax.parallel.sharding import make_mesh, param_shardings
from train.aot import check, parse_topology, topology_devices
from train.state import FP32_ONLY_PATTERNS

RECIPE = "configs/agent_mix_lora.yaml"
SMALL = ["model.preset=small-cpu", "model.num_hidden_layers=2", "model.layer_types=[linear_attention,full_attention]",
         "data.batch_size=4", "train.micro_batches=2", "lora.rank=128", "lora.alpha=256"]


def test_lora_step_on_v5p_8_holds_a_bf16_base_and_sharded_adapters():
    import launch
    from sft.config import load_sft_config, model_config_from
    from sft.lora import train_model_config

    (p,) = launch._sft_compile_plans(RECIPE, SMALL, ["v5p-8"])
    assert check(p) is p and p.fits and p.compiled
    assert p.mesh_shape["fsdp"] == 4 and (p.micro_batches, p.micro_batch, p.seq_len) == (2, 2, 8192)
    cfg = load_sft_config(RECIPE, SMALL)
    mcfg = train_model_config(cfg, model_config_from(cfg.model, None))
    assert mcfg.lora_rank == 128 and mcfg.param_dtype == mcfg.dtype == "bfloat16"
    model = abstract_model(mcfg)
    shard = param_shardings(model, make_mesh(cfg.mesh, topology_devices(parse_topology("v5p-8"))))
    trained = (ADAPTER_PATTERN,) + cfg.lora.full_trainable
    exact = 4 * 8192 * (3 * 4 + 1) // 4  # the batch: ids, segments, positions (int32), loss mask (bool) over 4 chips
    adapters = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(map(str, path))
        node = shard
        for key in path:
            node = node[key]
        shape = var.get_value().shape
        n = math.prod(node.shard_shape(shape))
        if any(re.search(t, name) for t in trained):
            exact += (4 + 2 + 4) * n  # fp32 master, bf16 mu, fp32 nu
        else:  # frozen: no optimizer state; the compute dtype unless the model keeps it fp32
            exact += (4 if any(re.search(f, name) for f in FP32_ONLY_PATTERNS) else 2) * n
        if re.search(ADAPTER_PATTERN, name):
            adapters += 1
            assert 4 * n == math.prod(shape), (name, shape, node.spec)  # every adapter factor split over the 4 chips
    assert adapters > 0
    assert exact <= p.argument_bytes <= 1.05 * exact, (p.argument_bytes, exact)
    # the compiled step does the work the LoRA count says: no frozen weight gradients, the adapters,
    # the experts' merges and grouped-matmul weight gradients
    assert abs(p.flops_per_chip * p.topology.chips / p.analytic_flops - 1) < 0.10, p.table()
    assert p.model_flops < p.analytic_flops
