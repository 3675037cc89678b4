"""bench/decode_cost.py: the byte and expert counts behind its decode roofline, against hand counts.

The expected values are computed here from the configs' shapes, written out term by term."""

from __future__ import annotations

import math

import numpy as np

from clover_jax.config import get_preset
from tests.bench.bench_import import bench_module

dc = bench_module("decode_cost")


def test_independent_routing_expectation_by_hand_and_by_sampling():
    # 32 tokens x top 8 of 256: the 163; one token: exactly k
    assert math.isclose(dc._independent(256, 8, 32), 256 * (1 - (1 - 8 / 256) ** 32))
    assert round(dc._independent(256, 8, 32)) == 163 and dc._independent(256, 8, 1) == 8
    rng = np.random.default_rng(0)
    draws = [len({e for _ in range(32) for e in rng.choice(256, 8, replace=False)}) for _ in range(400)]
    assert abs(np.mean(draws) - dc._independent(256, 8, 32)) < 1.0


def test_random_routing_touch_counts():
    cfg = get_preset("clover-35b-a3b")
    got = dc.random_touch(cfg, 32, [8, 32], trials=40)
    one, eight = got["batch1"], got["batch8"]
    assert one["ar"] == 8 and one["block_c8"] == 8 and one["block_c32"] <= 32
    assert abs(one["block_free"] - one["independent_block"]) < 3  # iid logits: the independent case
    assert one["commit"] == one["block_free"]
    assert eight["block_c8"] <= 8 * 8 and abs(eight["ar"] - eight["independent_ar"]) < 3


def test_forward_cost_by_hand():
    cfg = get_preset("clover-35b-a3b")
    d, v, i = cfg.hidden_size, cfg.vocab_size, cfg.moe_intermediate_size
    n_gdn = sum(t == "linear_attention" for t in cfg.layer_types)
    n_attn = cfg.num_hidden_layers - n_gdn
    # per layer: router, shared expert (+ gate), two norms; GDN / attention mixers
    qkv_z = d * (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
                 + 2 * cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    gdn = (qkv_z + 2 * d * cfg.linear_num_value_heads + cfg.gdn_conv_channels * cfg.linear_conv_kernel_dim
           + 2 * cfg.linear_num_value_heads + cfg.linear_value_head_dim
           + cfg.linear_num_value_heads * cfg.linear_value_head_dim * d)
    hd = cfg.head_dim
    attn = d * cfg.num_attention_heads * hd * 2 + 2 * d * cfg.num_key_value_heads * hd \
        + cfg.num_attention_heads * hd * d + 2 * hd
    per_layer = d * cfg.num_experts + 3 * d * cfg.shared_expert_intermediate_size + d + 2 * d
    dense = n_gdn * gdn + n_attn * attn + cfg.num_hidden_layers * per_layer + d
    head = v * d
    expert = 3 * d * i
    state = n_gdn * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    kv = n_attn * 2 * cfg.num_key_value_heads * hd * 2
    got = dc.forward_cost(cfg, 8, 1, 100, 1, True)
    assert got["bytes"] == 2 * (dense + head + 8 * cfg.num_hidden_layers * expert) + 2 * state + kv * 101
    free = dc.forward_cost(cfg, 163, 32, 100, 1, False)
    assert free["bytes"] - 2 * 155 * cfg.num_hidden_layers * expert == \
        2 * (dense + head + 8 * cfg.num_hidden_layers * expert) + state + kv * 132
    # ~3B active parameters: the AR step reads ~6 GB of bf16 weights
    active_gb = 2 * (dense + head + 8 * cfg.num_hidden_layers * expert) / 1e9
    assert 5.5 < active_gb < 6.5
