"""The recipe's `lora:` section: low-rank adapters instead of full fine-tuning.

With ``lora.rank > 0`` the run's model gains adapters on `lora.targets` (`clover_jax.model.lora`), the
optimizer trains only the adapters and the `lora.full_trainable` params (the block-mode scalars and
conv taps by default: tiny, and new in a Qwen checkpoint), and every frozen param is held in the
model's compute dtype (`model.dtype`): no fp32 master copy and no Adam moments for the base model.
The adapters keep fp32 masters (`train.state.FP32_ONLY_PATTERNS`).

The end-of-run export merges the adapters into the weights (both formats); `launch.py export
--adapters` writes them as a PEFT adapter instead.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from clover_jax.config import ModelConfig
from clover_jax.model.lora import ADAPTER_PATTERN, DEFAULT_TARGETS
from clover_jax.yaml_config import ConfigError
from train.config import OptimizerConfig

__all__ = ["DEFAULT_FULL_TRAINABLE", "LoraConfig", "describe", "frozen_dtype", "optimizer_config", "train_model_config"]

#: Trained in full beside the adapters: the Clover block-mode GDN scalars and right conv taps.
DEFAULT_FULL_TRAINABLE: tuple[str, ...] = (r"\.bd_gdn_softmax_scalars$", r"\.conv_(q|k|v)\.right$")


@dataclass(frozen=True)
class LoraConfig:
    """rank: adapter rank r (0: full fine-tuning, no adapters); alpha: the update is scaled by
    alpha / r; targets: regexes over base weight paths (``groups.layer_0.attn.q_proj.kernel``,
    ``groups.layer_0.moe.wi_gate``; empty: every attention / GDN / shared-expert projection and the
    routed experts, `clover_jax.model.lora.DEFAULT_TARGETS`); full_trainable: regexes of params
    trained in full beside the adapters; dropout: the rate of the projections' adapters' input
    dropout while training (PEFT's lora_dropout; the routed experts' adapters have none, as PEFT's
    for fused expert parameters, `clover_jax.model.lora`)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()
    full_trainable: tuple[str, ...] = DEFAULT_FULL_TRAINABLE

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"lora.rank must be >= 0 (0: no adapters), got {self.rank}")
        if self.rank and self.alpha <= 0:
            raise ConfigError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        for name in ("targets", "full_trainable"):
            for p in getattr(self, name):
                try:
                    re.compile(p)
                except re.error as e:
                    raise ConfigError(f"lora.{name}: {p!r} is not a regex ({e})") from None

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def train_model_config(cfg: Any, mcfg: ModelConfig) -> ModelConfig:
    """The model config a run trains: `mcfg` with the adapters of `cfg.lora` and its param dtype
    (`train.param_dtype`; with adapters the base is loaded in the compute dtype, `frozen_dtype`)."""
    lc = cfg.lora
    if not lc.enabled:
        return mcfg.replace(param_dtype=cfg.train.param_dtype)
    return mcfg.replace(param_dtype=mcfg.dtype, lora_rank=lc.rank, lora_alpha=float(lc.alpha),
                        lora_targets=tuple(lc.targets) or DEFAULT_TARGETS, lora_dropout=float(lc.dropout))


def frozen_dtype(mcfg: ModelConfig) -> str | None:
    """The dtype frozen params are held in: the compute dtype with adapters, else None (the master
    dtype, as every param)."""
    return mcfg.dtype if mcfg.lora_rank else None


def optimizer_config(cfg: Any) -> OptimizerConfig:
    """`cfg.optimizer`, with adapters: trainable = the adapters + `lora.full_trainable` (a recipe
    that also sets `optimizer.trainable` is refused: one place says what trains)."""
    oc = cfg.optimizer
    if not cfg.lora.enabled:
        return oc
    if oc.trainable is not None:
        raise ConfigError("optimizer.trainable and lora.rank > 0 both say what trains: with adapters, list "
                          "params trained in full under lora.full_trainable")
    return dataclasses.replace(oc, trainable=(ADAPTER_PATTERN,) + tuple(cfg.lora.full_trainable))


def describe(params: Any, optimizer: Any, dropout: float = 0.0) -> str:
    """One line: trainable vs total params (adapters, in full) for the run's log, and where the
    adapters' `dropout` applies."""
    import jax

    from train.optimizer import param_paths

    mask = jax.tree.leaves(optimizer.trainable_mask(params))
    leaves = jax.tree.leaves(params)
    paths = jax.tree.leaves(param_paths(params))
    total = sum(math.prod(x.shape) for x in leaves)
    adapters = sum(math.prod(x.shape) for x, p in zip(leaves, paths) if re.search(ADAPTER_PATTERN, p))
    trained = sum(math.prod(x.shape) for x, m in zip(leaves, mask) if m)
    line = (f"LoRA: {trained:,} trainable params of {total:,} ({100 * trained / max(total, 1):.2f}%: "
            f"{adapters:,} in adapters, {trained - adapters:,} trained in full)")
    if dropout:
        experts = any(re.search(r"_lora_a$", p) for p in paths)
        line += f"; dropout {dropout:g} on the projections' adapters" + (
            " (the routed experts' adapters, merged into their weights, have none)" if experts else "")
    return line
