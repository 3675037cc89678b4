"""Analytic FLOP count of one masked-diffusion SFT step (docs/design.md 3.3): what the compiled
step's count (`train.hlo_cost`) is checked against, and the numerator of the plan's MFU.

Per optimizer step, ``rows`` packed rows of ``seq_len`` tokens; the complementary copy doubles them
(``copies`` = 2), and every copy runs the clean and the noisy stream through all layers. Forward
FLOPs (a matmul of m x k by k x n = 2mkn), per token of either stream:

- ``dense``: 2 x the matmul weights a token touches: attention q (+ gate), k, v, o projections; GDN
  in / out projections and the depthwise conv taps; the router, k of the E routed experts, the
  shared expert and its gate. Embedding lookup, norms and scalars: none.
- ``attention`` (full-attention layers), per row: 4 H D per visible (query, key) pair; the clean
  stream is causal: T (T + 1) / 2 pairs; a noisy query of block b sees the b * bs clean keys before
  its block and the bs noisy keys of it: T (T + bs) / 2 pairs. One document per row (packing
  only removes pairs; the kernels skip whole tiles, never per document).
- ``gdn`` (linear-attention layers), per value head: the clean stream's chunked delta rule as the
  TPU phase kernels run it (chunk C, `pallas_kernels.gdn.phase_math`: k k^T, the doubling triangular
  inverse, w = T (beta k), u = T (beta v), w S, q k^T, q S, P delta, the state update) and the noisy
  stream's readouts (`gdn.block_phase_math`): per readout tile of R = max(bs, C) rows, q S, q k^T
  and P v on the tile, plus, when blocks start inside chunks (bs < C), Mn = q k^T and Mn delta.
- ``lm_head``: the logits of every noisy position, 2 D V (the CE skips chunks without a loss token
  at run time; a static count cannot, so this is the upper bound the compiled program also has).

``model`` = 3 x forward (backward = 2 x forward) is the step's model FLOPs (MFU); ``executed`` adds
the layer stack's forward once more under ``remat: full`` (recomputed in the backward; the CE's
custom VJP recomputes nothing), what the GDN kernels run beyond that count
(``gdn_executed_extra``): their backward is counted from its own matmuls, not as 2 x the forward
(the phase split saves the inverse, recomputes the WY form and the chunk states, and its parallel
kernels recompute P, delta and the noisy softmax), and at ``gdn_lanes`` (TPU: 128) the kernels run
dk, dv zero-padded to whole lane tiles; and, when the attention runs as a flash-style kernel (splash
on TPU, our flash kernel on GPU), the scores its backward recomputes: per visible pair the forward
does 2 matmuls (q k^T, p v) and autodiff's backward 4 (dv, dp, dq, dk), while the kernels' dq pass
runs 3 (q k^T, do v^T, ds k) and their dk/dv pass 4 (q k^T, do v^T, p^T do, ds^T q): 3 more, i.e.
1.5 x the attention forward (``attention_recompute``).

With LoRA adapters (``cfg.lora_rank`` > 0; `clover_jax.model.lora`) every base weight is frozen: the
backward computes no weight gradient for it (``frozen_weight_grads``: the forward FLOPs of every
weight matmul, embedding lookup excluded), and the adapters add their own work. ``model`` counts what
LoRA needs: the adapters factored on every token (``x A`` then ``(x A) B``, forward, input gradient
and the A / B gradients: 3 x ``adapters``). ``executed`` counts what our layers run: a projection's
adapter as in ``model``, but the routed experts merge ``W + s A B`` once per micro-batch and layer
(2 E in r out per weight, ``adapters_run``; its backward is the two products for dA and dB), and
their grouped matmuls then compute the merged weight's gradient (the tgmm) as full fine-tuning does
(``weight_grads_run``). MFU of a LoRA plan is thus over the FLOPs LoRA needs, not full fine-tuning's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from clover_jax.config import FULL, ModelConfig

__all__ = ["StepFlops", "sft_step_flops"]


@dataclass(frozen=True)
class StepFlops:
    """Forward FLOPs of one SFT step by term (all chips together) and the step totals."""

    dense: float
    attention: float
    gdn: float
    lm_head: float
    recompute: float  # the layer stack's forward again (remat full), else 0
    gdn_executed_extra: float = 0.0  # what the GDN kernels run minus the 3 x forward (+ remat) count
    attention_recompute: float = 0.0  # a flash-style attention backward's recomputed scores, else 0
    frozen_weight_grads: float = 0.0  # LoRA: the weight gradients frozen weights do not need (their forward)
    adapters: float = 0.0  # LoRA: the adapters' forward, factored per token (what LoRA needs)
    adapters_run: float = 0.0  # LoRA: the adapters' forward as run (projections factored, expert stacks merged)
    weight_grads_run: float = 0.0  # LoRA: frozen weight gradients run anyway (the merged experts' tgmm)

    @property
    def forward(self) -> float:
        return self.dense + self.attention + self.gdn + self.lm_head

    @property
    def model(self) -> float:
        """Forward + backward (2 x forward; with LoRA less the frozen weight gradients, plus the
        factored adapters): the FLOPs MFU counts."""
        return 3.0 * self.forward - self.frozen_weight_grads + 3.0 * self.adapters

    @property
    def executed(self) -> float:
        """What the step runs: model FLOPs + the rematerialised forward + the GDN kernels' extra +
        the attention kernels' recomputed scores (LoRA: the adapters as run, not as counted in
        `model`, and the frozen weight gradients run anyway)."""
        lora = 3.0 * (self.adapters_run - self.adapters) + self.weight_grads_run
        return self.model + lora + self.recompute + self.gdn_executed_extra + self.attention_recompute


def _dense_per_token(cfg: ModelConfig) -> tuple[float, float]:
    """(forward FLOPs per token of a full-attention layer, of a GDN layer), MoE block included."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attn = d * 2 * cfg.num_attention_heads * hd + 2 * d * cfg.num_key_value_heads * hd + cfg.num_attention_heads * hd * d
    gdn = d * (cfg.gdn_conv_channels + cfg.gdn_value_dim + 2 * cfg.linear_num_value_heads) + cfg.gdn_value_dim * d
    gdn += cfg.gdn_conv_channels * cfg.linear_conv_kernel_dim  # depthwise conv: one MAC per tap and channel
    moe = d * cfg.num_experts + cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size
    moe += 3 * d * cfg.shared_expert_intermediate_size + d
    return 2.0 * (attn + moe), 2.0 * (gdn + moe)


def _gdn_chunk_flops(c: int, k: int, v: int) -> float:
    """Forward matmul FLOPs of one chunk of C tokens of one head (K key, V value dims), phase split."""
    inverse = 2 * math.ceil(math.log2(c)) * 2 * c**3  # two C x C x C products per doubling step
    intra = 2 * c * c * k + inverse + 2 * c * c * k + 2 * c * c * v        # k k^T, T, w, u
    return intra + 2 * c * k * v + 2 * c * k * v + 2 * c * c * k + 2 * c * c * v + 2 * c * k * v


def _gdn_readout_flops(t: int, bs: int, c: int, k: int, v: int) -> float:
    """Forward matmul FLOPs of the noisy stream of one row and head (readout tiles of max(bs, C))."""
    r = max(bs, c)
    per_tile = 2 * r * k * v + 2 * r * r * k + 2 * r * r * v            # q S, q k^T, P v
    if bs < c:
        per_tile += 2 * c * c * k + 2 * c * c * v                       # Mn = q k^T, Mn delta
    return (t // r) * per_tile


def _gdn_chunk_backward_flops(c: int, k: int, v: int) -> float:
    """Backward matmul FLOPs of one chunk of one head, phase split (no inverse: it is saved): the WY
    recompute (2), the state recompute (2), the dS sweep (5) and the parallel backward (18)."""
    cck, ccv, ckv = 2 * c * c * k, 2 * c * c * v, 2 * c * k * v
    return 11 * cck + 6 * ccv + 10 * ckv


def _gdn_readout_backward_flops(t: int, bs: int, c: int, k: int, v: int) -> float:
    """Backward matmul FLOPs of the noisy stream of one row and head: in the dS sweep the readouts'
    state cotangent (and Mn, Mn^T dr for blocks inside chunks), in the parallel kernel the readout
    and softmax recompute and their cotangents."""
    if bs < c:
        cck, ccv, ckv = 2 * c * c * k, 2 * c * c * v, 2 * c * k * v
        return (t // c) * (7 * cck + 7 * ccv + 3 * ckv)
    return (t // bs) * (3 * 2 * bs * bs * k + 3 * 2 * bs * bs * v + 3 * 2 * bs * k * v)


def _lora_flops(cfg: ModelConfig, tokens: float, micro_batches: int) -> dict[str, float]:
    """The LoRA terms of `StepFlops` for ``tokens`` token-streams (both streams) per step, from the
    adapter shapes of the model `cfg` builds (its `lora_targets` decide which weights have one)."""
    from flax import nnx

    from clover_jax.model.clover_model import abstract_model
    from clover_jax.model.lora import adapter_pairs

    state = nnx.to_flat_state(nnx.state(abstract_model(cfg), nnx.Param))
    params = {".".join(map(str, k)): v.get_value() for k, v in state}
    k = cfg.num_experts_per_tok
    factored = projections = merge = wgrad = 0.0
    for base, (a, b) in adapter_pairs(params).items():
        d_in, r, d_out = a.shape[-2], a.shape[-1], b.shape[-1]
        if base.endswith(".kernel"):  # a projection [layers, in, out]: every token, factored
            f = math.prod(a.shape[:-2]) * 2 * r * (d_in + d_out) * tokens
            factored, projections = factored + f, projections + f
        else:  # an expert stack [layers, E, in, out]: k of the E experts per token
            layers, e = math.prod(a.shape[:-3]), a.shape[-3]
            factored += layers * k * 2 * r * (d_in + d_out) * tokens
            merge += layers * e * 2 * d_in * r * d_out
            wgrad += layers * k * 2 * d_in * d_out * tokens
    return {"adapters": factored, "adapters_run": projections + micro_batches * merge, "weight_grads_run": wgrad}


def sft_step_flops(cfg: ModelConfig, *, rows: int, seq_len: int, block_size: int, copies: int = 2,
                   remat: str = "full", gdn_lanes: int = 1, flash_backward: bool = False,
                   micro_batches: int = 1) -> StepFlops:
    """The analytic count of one SFT step of ``rows`` x ``seq_len`` tokens (module docstring).
    ``remat``: the layer stack's policy; "full" recomputes its forward in the backward.
    ``micro_batches``: gradient accumulation steps (LoRA: the experts merge their adapters once each).
    ``gdn_lanes``: the GDN kernels run dk, dv rounded up to a multiple of it (executed count only).
    ``flash_backward``: the attention backward runs as split dq / dk-dv kernels that recompute the
    scores (``attn_backend`` splash or flash); False for the jnp reference (autodiff saves them)."""
    if seq_len % block_size:
        raise ValueError(f"seq_len {seq_len} is not a multiple of block_size {block_size}")
    n_rows = copies * rows  # noisy rows; each also has its clean stream
    tokens = n_rows * seq_len  # per stream
    t, bs = seq_len, block_size
    n_full = sum(1 for lt in cfg.layer_types if lt == FULL)
    n_gdn = len(cfg.layer_types) - n_full
    attn_tok, gdn_tok = _dense_per_token(cfg)
    dense = 2 * tokens * (n_full * attn_tok + n_gdn * gdn_tok)
    pairs = t * (t + 1) / 2 + t * (t + bs) / 2  # clean + noisy stream, per row
    attention = n_full * n_rows * 4.0 * cfg.num_attention_heads * cfg.head_dim * pairs
    c = min(cfg.gdn_chunk_size, t)
    kd, vd, nv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    clean = (t // c) * _gdn_chunk_flops(c, kd, vd)
    noisy = _gdn_readout_flops(t, bs, c, kd, vd)
    gdn = n_gdn * n_rows * nv * (clean + noisy)
    ke, ve = (-(-d // gdn_lanes) * gdn_lanes for d in (kd, vd))
    gdn_fwd_run = n_gdn * n_rows * nv * ((t // c) * _gdn_chunk_flops(c, ke, ve) + _gdn_readout_flops(t, bs, c, ke, ve))
    gdn_bwd_run = n_gdn * n_rows * nv * ((t // c) * _gdn_chunk_backward_flops(c, ke, ve)
                                         + _gdn_readout_backward_flops(t, bs, c, ke, ve))
    runs = 2 if remat == "full" else 1  # the GDN forward kernels run once more under remat full
    lm_head = 2.0 * tokens * cfg.hidden_size * cfg.vocab_size
    layers = dense + attention + gdn
    lora: dict[str, float] = {}
    if cfg.lora_rank:  # every weight matmul frozen (`dense` counts the depthwise conv taps too: tiny)
        lora = {**_lora_flops(cfg, 2 * tokens, micro_batches), "frozen_weight_grads": dense + lm_head}
        layers += lora["adapters_run"]  # inside the layers: recomputed under remat full
    return StepFlops(dense=dense, attention=attention, gdn=gdn, lm_head=lm_head,
                     recompute=layers if remat == "full" else 0.0,
                     gdn_executed_extra=runs * gdn_fwd_run + gdn_bwd_run - (2 + runs) * gdn,
                     attention_recompute=1.5 * attention if flash_backward else 0.0, **lora)
