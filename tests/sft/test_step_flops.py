"""The analytic SFT step count (`sft.step_flops`) on a config small enough to count by hand, and
its attention pair counts against a brute-force count of the block-diffusion mask."""

import numpy as np
import pytest

from clover_jax.config import ModelConfig
from sft.step_flops import sft_step_flops

CFG = ModelConfig(vocab_size=16, hidden_size=8, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                  num_attention_heads=2, num_key_value_heads=1, head_dim=4, linear_num_key_heads=1,
                  linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4, linear_conv_kernel_dim=4,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6, shared_expert_intermediate_size=5,
                  gdn_chunk_size=4, partial_rotary_factor=0.5, mrope_section=(1, 0, 0))


def test_counts_by_hand():
    f = sft_step_flops(CFG, rows=1, seq_len=8, block_size=4, copies=2, remat="full")
    # weights a token touches: attention 8*2*2*4 (q + gate) + 2*8*4 (k, v) + 8*8 (o) = 256; GDN in
    # 8*(16 + 8 + 4) + out 8*8 + conv 16*4 = 352; MoE router 32 + 2 experts 288 + shared 120 + gate 8
    # = 448. 2 copies x 8 tokens = 16 per stream, 32 both: 32 * 2 * (256 + 448 + 352 + 448)
    assert f.dense == 32 * 2 * (256 + 448 + 352 + 448) == 96256
    # pairs per row: clean 8*9/2 = 36, noisy 8*12/2 = 48 (block 0: 4 noisy keys; block 1: 4 clean + 4
    # noisy, 4 queries each); 4 H D = 32 per pair; 2 rows
    assert f.attention == 2 * 32 * (36 + 48) == 5376
    # GDN per value head and row: 2 chunks of 4 x (8 matmuls of 128 in the phase split: k k^T, w, u,
    # w S, q S, q k^T, P delta, the state update; + the inverse 2*2*2*64 = 512), and 2 noisy blocks
    # (= chunks: no block starts inside one) x (128 + 128 + 128); 2 heads, 2 rows
    assert f.gdn == 2 * 2 * (2 * (8 * 128 + 512) + 2 * 3 * 128) == 15360
    assert f.lm_head == 16 * 2 * 8 * 16 == 4096
    assert f.forward == 121088 and f.model == 3 * 121088
    # the GDN backward as the phase kernels run it, per head and row: 2 chunks x (11 + 6 + 10)
    # matmuls of 128 and 2 noisy blocks x 9 x 128 = 9216, 2 heads, 2 rows, minus 2 x the forward
    assert f.gdn_executed_extra == 2 * 2 * (2 * 27 * 128 + 2 * 9 * 128) - 2 * 15360 == 6144
    # remat full: the layers' forward again
    assert f.executed == 3 * 121088 + (96256 + 5376 + 15360) + 6144
    assert sft_step_flops(CFG, rows=1, seq_len=8, block_size=4, remat="none").executed == 3 * 121088 + 6144
    # blocks of 2 inside the chunks of 4: per chunk q S, q k^T and P v on the chunk's tile, and the
    # mid-chunk readouts' Mn = q k^T and Mn delta (5 x 128 per chunk instead of 3 per block)
    g = sft_step_flops(CFG, rows=1, seq_len=8, block_size=2, copies=2)
    assert g.gdn == 2 * 2 * (2 * (8 * 128 + 512) + 2 * 5 * 128) == 17408
    # executed on 8 lanes: dk = dv = 4 run as 8 (C k k^T-type products 2x, k S-type 4x, the inverse
    # 1x); model FLOPs unchanged
    p = sft_step_flops(CFG, rows=1, seq_len=8, block_size=4, copies=2, gdn_lanes=8)
    fwd8 = 2 * 2 * (2 * (3 * 256 + 2 * 256 + 3 * 512 + 512) + 2 * (512 + 256 + 256))
    bwd8 = 2 * 2 * (2 * (11 * 256 + 6 * 256 + 10 * 512) + 2 * 3 * (256 + 256 + 512))
    assert p.model == f.model and p.gdn_executed_extra == 2 * fwd8 + bwd8 - 4 * 15360
    # a flash-style backward (dq kernel: 3 tile matmuls, dk/dv kernel: 4) runs 7 products per visible
    # pair where autodiff runs 4 (the forward: 2): 3 more = 1.5 x the attention forward, executed only
    fk = sft_step_flops(CFG, rows=1, seq_len=8, block_size=4, remat="none", flash_backward=True)
    assert fk.attention_recompute == 2 * 3 * 2 * 4 * 2 * (36 + 48) and fk.model == 3 * 121088  # rows x 3 x 2 D H x pairs
    assert fk.executed == 3 * 121088 + 6144 + 8064


@pytest.mark.parametrize("t,bs", [(64, 4), (96, 32), (128, 16)])
def test_attention_pairs_match_the_mask(t, bs):
    """Clean: causal; noisy: clean keys strictly before the query's block start + its own block."""
    q = np.arange(t)[:, None]
    k = np.arange(t)[None, :]
    clean = (k <= q).sum()
    noisy = (k < q - q % bs).sum() + (k // bs == q // bs).sum()
    cfg = CFG.replace(layer_types=("full_attention", "full_attention"))
    f = sft_step_flops(cfg, rows=1, seq_len=t, block_size=bs, copies=1)
    assert f.attention == 2 * 4 * 2 * 4 * (clean + noisy)  # 2 layers x 4 H D x pairs (1 row)
    with pytest.raises(ValueError, match="multiple of block_size"):
        sft_step_flops(CFG, rows=1, seq_len=t + 1, block_size=bs)


def test_lora_counts_by_hand():
    """LoRA rank 2 on every default target of CFG: the frozen weights' gradients leave the count,
    the adapters join it (factored in `model`; in `executed` the projections factored and the
    experts merged once per micro-batch, their grouped matmuls' weight gradient still run)."""
    full = sft_step_flops(CFG, rows=1, seq_len=8, block_size=4, copies=2, remat="full")
    f = sft_step_flops(CFG.replace(lora_rank=2, lora_alpha=4.0), rows=1, seq_len=8, block_size=4, copies=2,
                       remat="full", micro_batches=3)
    assert (f.dense, f.attention, f.gdn, f.lm_head) == (full.dense, full.attention, full.gdn, full.lm_head)
    # per token, 2 r (in + out) per adapter: attention q 8->16 (with the gate) 96, k 8->4 48, v 48,
    # o 8->8 64 = 256; GDN q, k 8->4 48 each, v, z 8->8 64 each, b, a 8->2 40 each, out 8->8 64 = 368;
    # the shared expert 8->5, 8->5, 5->8: 52 each, both layers 312; the experts factored, k = 2 of
    # them per token: 2 x (8->6, 8->6, 6->8: 56 each) per layer = 672. 32 token-streams.
    assert f.adapters == 32 * (256 + 368 + 312 + 672) == 51456
    # run: the projections factored, the 3 expert stacks merged per layer and micro-batch: 2 layers x
    # 4 experts x 3 x 2 * 8 * 2 * 6
    assert f.adapters_run == 32 * (256 + 368 + 312) + 3 * 2 * 4 * 3 * 192 == 43776
    assert f.frozen_weight_grads == full.dense + full.lm_head == 100352
    assert f.weight_grads_run == 2 * 2 * 3 * (2 * 8 * 6) * 32 == 36864  # the k experts' tgmm per token
    assert f.model == 3 * 121088 - 100352 + 3 * 51456
    # remat full recomputes the layers with their adapters
    assert f.recompute == full.recompute + 43776
    assert f.executed == f.model + 3 * (43776 - 51456) + 36864 + f.recompute + full.gdn_executed_extra
    # without the experts as targets: no merge, no expert weight gradient run
    g = sft_step_flops(CFG.replace(lora_rank=2, lora_targets=(r"\.attn\.(q|k|v|o)_proj\.kernel$",)), rows=1,
                       seq_len=8, block_size=4, copies=2, remat="none")
    assert g.adapters == g.adapters_run == 32 * 256 and g.weight_grads_run == 0
    assert g.model == 3 * 121088 - 100352 + 3 * 32 * 256 and g.executed == g.model + g.gdn_executed_extra
