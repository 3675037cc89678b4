"""Frozen configs of the generic trainer: optimizer, loop, checkpoints, logging.

Every section is a frozen dataclass, so `clover_jax.yaml_config.from_tree` builds it from YAML with
key/type checking, and the whole trainer config is hashable (usable as a jit static argument).
Regex lists match with `re.search` against dotted param paths such as
``groups.layer_0.gdn.A_log`` (see `train.optimizer.param_paths`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from clover_jax.yaml_config import ConfigError

#: Default no-weight-decay patterns: norm scales, biases, the GDN decay parameters and the Clover
#: calibration scalars (decaying them would pull the calibration towards 0, not towards its init).
DEFAULT_NO_DECAY: tuple[str, ...] = (
    r"(^|\.)scale$",
    r"(^|\.)bias$",
    r"(^|\.)A_log$",
    r"(^|\.)dt_bias$",
    r"bd_gdn_softmax_scalars",
)


#: platforms of `TrainConfig.compiler_options` (jax's `Device.platform` names)
COMPILER_PLATFORMS = ("tpu", "gpu", "cpu")


class TrainConfigError(ConfigError):
    """A trainer config value that cannot work; the message names the field (a `ConfigError`, so
    the CLI reports it like any other config mistake)."""


def _check_regexes(name: str, patterns: tuple[str, ...] | None) -> None:
    for p in patterns or ():
        try:
            re.compile(p)
        except re.error as e:
            raise TrainConfigError(f"{name}: bad regex {p!r}: {e}") from None


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW + linear warmup + decay + global-norm clipping.

    Schedule (step s counts updates from 0): warmup ``lr * (s + 1) / warmup_steps`` for
    ``s < warmup_steps`` (the first update is not wasted at lr 0); then from ``lr`` down to
    ``lr * min_lr_ratio`` at ``s = decay_steps`` (default: the run's ``train.steps``) following
    ``decay``; flat at the end value after that.

    `trainable` (None = every param) and `frozen` select the params that train: a param trains
    iff it matches some `trainable` pattern (or `trainable` is None) and no `frozen` pattern.
    Frozen params get no update and no optimizer state.
    """

    lr: float = 3e-4
    warmup_steps: int = 0
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    decay_steps: int | None = None
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    no_decay: tuple[str, ...] = DEFAULT_NO_DECAY
    trainable: tuple[str, ...] | None = None
    frozen: tuple[str, ...] = ()
    mu_dtype: Literal["float32", "bfloat16"] | None = None  # None: same as the param

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise TrainConfigError(f"optimizer.lr must be >= 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise TrainConfigError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps is not None and self.decay_steps < self.warmup_steps:
            raise TrainConfigError(
                f"optimizer.decay_steps ({self.decay_steps}) < optimizer.warmup_steps ({self.warmup_steps})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise TrainConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise TrainConfigError(f"optimizer.clip_norm must be > 0 or null, got {self.clip_norm}")
        for name in ("no_decay", "trainable", "frozen"):
            _check_regexes(f"optimizer.{name}", getattr(self, name))


@dataclass(frozen=True)
class TrainConfig:
    """The loop: `steps` optimizer updates, each over `micro_batches` accumulated micro-batches.

    `param_dtype` is the dtype of the master weights the optimizer updates (the model's compute
    dtype is `ModelConfig.dtype`). `eval_every` / `log_every` count optimizer steps; 0 disables eval.

    `on_nonfinite`: what a step with a NaN/Inf loss, gradient norm or update does: ``stop`` (the run
    ends with an error naming the step, saving nothing after it) or ``skip`` (the update is dropped;
    `max_skipped` skipped updates in a row then stop the run as ``stop`` does). `resume`: ``check``
    refuses to resume a checkpoint written with another config where the recipe says it must match
    (model, data, optimizer, ...); ``force`` resumes anyway and logs the differences.

    `compiler_options`: XLA options of the train step's compile, per platform (``tpu``, ``gpu``,
    ``cpu``): only the entry of the platform the step compiles for applies (another backend would
    reject an option it does not know), e.g. ``{tpu: {xla_jf_spmd_threshold_for_windowed_einsum_mib:
    1000000}}`` makes the TPU compiler all-gather the FSDP weights of a dense projection instead of
    streaming them through a windowed-einsum loop.
    """

    steps: int = 100
    micro_batches: int = 1
    seed: int = 0
    eval_every: int = 0
    eval_steps: int = 1
    log_every: int = 1
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_skipped: int = 5
    resume: Literal["check", "force"] = "check"
    compiler_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for platform, opts in self.compiler_options.items():
            if platform not in COMPILER_PLATFORMS:
                raise TrainConfigError(f"train.compiler_options: unknown platform {platform!r} "
                                       f"(expected one of {', '.join(COMPILER_PLATFORMS)})")
            if not isinstance(opts, dict):
                raise TrainConfigError(f"train.compiler_options.{platform}: expected a mapping of XLA "
                                       f"options, got {type(opts).__name__}")
        for name in ("steps", "micro_batches", "log_every", "eval_steps", "max_skipped"):
            if getattr(self, name) < 1:
                raise TrainConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise TrainConfigError(f"train.eval_every must be >= 0, got {self.eval_every}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in `dir` (None: no checkpoints): every `every_steps` steps (0: only the
    final one), the newest `keep` kept; `async_save` writes in a background thread.
    `save_frozen: false`: a checkpoint holds only the params the optimizer trains (LoRA: the
    adapters); the frozen ones are re-read from the run's initial weights on resume and export,
    checked against a fingerprint the checkpoint keeps (`train.checkpoint`)."""

    dir: str | None = None
    every_steps: int = 1000
    keep: int = 3
    async_save: bool = True
    save_on_sigterm: bool = True
    save_final: bool = True
    save_frozen: bool = True

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise TrainConfigError(f"checkpoint.every_steps must be >= 0, got {self.every_steps}")
        if self.keep < 1:
            raise TrainConfigError(f"checkpoint.keep must be >= 1, got {self.keep}")


@dataclass(frozen=True)
class WandbConfig:
    """`mode` None means: the `WANDB_MODE` environment variable, else "offline" (no network)."""

    mode: Literal["offline", "online", "disabled"] | None = None
    project: str = "clover-jax"
    entity: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class LoggingConfig:
    """`metrics.jsonl` (and wandb files) go to `run_dir`; a console table row every
    `console_every` logged steps; a progress bar when `progress` ("auto": when stderr is a TTY)."""

    run_dir: str = "runs/train"
    console_every: int = 1
    progress: Literal["auto", "on", "off"] = "auto"
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        if self.console_every < 0:
            raise TrainConfigError(f"logging.console_every must be >= 0, got {self.console_every}")


@dataclass(frozen=True)
class TrainerConfig:
    """All trainer sections together (what `train.loop.run` takes)."""

    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


__all__ = [
    "DEFAULT_NO_DECAY", "CheckpointConfig", "LoggingConfig", "OptimizerConfig", "TrainConfig",
    "TrainConfigError", "TrainerConfig", "WandbConfig",
]
