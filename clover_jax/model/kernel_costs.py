"""What the model's TPU kernels cost in a compiled step, for the HLO walk of `train.hlo_cost`
(its `kernel_cost` hook): the splash attention calls, which carry no cost estimate, and the
grouped matmuls of the MoE, whose estimates count their worst-case buffer.

- splash (`splash_mha_fwd / dq / dkv`): the matmul FLOPs of the tiles the kernel runs for the
  stream its shapes name (`splash_cost.kernel_cost`), at the training block
  size.
- grouped matmuls (XLA's `ragged_dot` kernel `ragged-dot-*`, megablox `gmm` / `tgmm`): under expert
  parallelism the receive buffer holds `ep * n * min(k, E_local)` rows (`moe`'s dropless worst
  case) but the kernels run only the tiles of the groups' rows (megablox: a grid of
  `group_tiles.sum()` tiles), and balanced routing fills `n * k` of them: their FLOPs are scaled by
  that fill (`ep_buffer_fill`), and so are their bytes (the rows' operand and result tiles; the
  weights they read scale with the tiles run too).
"""

from __future__ import annotations

from typing import Any, Callable

from ..config import ModelConfig
from .splash_cost import kernel_cost as splash_kernel_cost

__all__ = ["GROUPED_MATMUL_KERNELS", "ep_buffer_fill", "step_kernel_cost"]

#: kernel names (instruction name less its numeric suffix) of the grouped matmuls in a TPU program
GROUPED_MATMUL_KERNELS = ("ragged-dot-none", "gmm", "tgmm")


def ep_buffer_fill(num_experts: int, k: int, ep: int) -> float:
    """Share of the expert-parallel receive buffer (`ep * n * min(k, E / ep)` rows per device) that
    balanced routing fills (`n * k` rows: each of the ep sources sends n k / ep). 1 without EP."""
    if ep < 1 or num_experts % ep:
        raise ValueError(f"ep_buffer_fill: {num_experts} experts over {ep} expert shards")
    return k / (ep * min(k, num_experts // ep))


def step_kernel_cost(cfg: ModelConfig, expert_shards: int, block_size: int, context: int = 1) -> Callable[..., Any]:
    """The `kernel_cost(name, operands, results, estimate)` hook for a step of `cfg` with the experts
    over `expert_shards` devices, the noisy stream at `block_size` (1: clean stream only) and each
    row over `context` shards in `cfg.context_layout`."""
    fill = ep_buffer_fill(cfg.num_experts, cfg.num_experts_per_tok, expert_shards)

    def cost(name: str, operands: tuple, results: tuple, estimate: tuple[float, float] | None):
        if name.startswith("splash_mha"):
            return splash_kernel_cost(name, operands, results, block_size=block_size, context=context,
                                      layout=cfg.context_layout)
        if name in GROUPED_MATMUL_KERNELS and estimate is not None:
            return estimate[0] * fill, estimate[1] * fill
        return None

    return cost
