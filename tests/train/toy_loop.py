"""The toy LM trained by `train.loop.run` with the knobs the fault tests turn (shared helper, no tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from tests.train.test_train_toy import ToyBatches, toy_loss, toy_params


def trainer_config(run_dir: Path, ckpt_dir: Path | None, *, steps: int = 12, every: int = 4, keep: int = 3,
                   lr: float = 3e-2, async_save: bool = True, **train: Any):
    from train.config import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainConfig, TrainerConfig, WandbConfig

    train.setdefault("log_every", 1)
    return TrainerConfig(
        train=TrainConfig(steps=steps, micro_batches=2, **train),
        optimizer=OptimizerConfig(lr=lr, warmup_steps=3, decay="cosine"),
        checkpoint=CheckpointConfig(dir=None if ckpt_dir is None else str(ckpt_dir), every_steps=every, keep=keep,
                                    async_save=async_save),
        logging=LoggingConfig(run_dir=str(run_dir), progress="off", console_every=0,
                              wandb=WandbConfig(mode="disabled")),
    )


def toy_run(run_dir: Path, ckpt_dir: Path | None, *, loss_fn: Callable = toy_loss,
            run_config: dict | None = None, must_match: tuple[str, ...] = (), messages: list | None = None,
            batches: Callable | None = None, **kw: Any):
    """Trains the toy; returns the LoopResult. `messages` collects the loop's console lines;
    `batches(data_state)` replaces the toy stream."""
    from train.logging import MetricsLogger
    from train.loop import run
    from train.optimizer import build_optimizer
    from train.state import init_train_state
    from train.step import make_train_step

    cfg = trainer_config(run_dir, ckpt_dir, **kw)
    opt = build_optimizer(cfg.optimizer, cfg.train.steps)
    step = make_train_step(loss_fn, opt, micro_batches=cfg.train.micro_batches, on_nonfinite=cfg.train.on_nonfinite)
    logger = MetricsLogger(cfg.logging, total_steps=cfg.train.steps, log_every=cfg.train.log_every)
    if messages is not None:
        logger.message = messages.append  # type: ignore[method-assign]
    try:
        return run(step, lambda: init_train_state(toy_params(), opt, seed=cfg.train.seed),
                   batches or (lambda data_state: ToyBatches(seed=7, state=data_state)), config=cfg,
                   run_config=run_config if run_config is not None else {"optimizer": {"lr": kw.get("lr", 3e-2)}},
                   logger=logger, resume_must_match=must_match)
    finally:
        logger.close()


def losses(run_dir: Path) -> dict[int, float]:
    path = Path(run_dir) / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def steps_on_disk(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in Path(ckpt_dir).iterdir() if p.name.isdigit())
