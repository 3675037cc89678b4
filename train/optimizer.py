"""AdamW with warmup + decay schedule, global-norm clipping, a weight-decay mask and trainable subsets.

Param selection is by regex on the dotted path of each leaf of the params pytree
(``groups.layer_0.gdn.A_log``, ``embed.embedding``, ``layers.3.moe.wo`` for the per-layer form).
The optax transform is ``multi_transform({"train": clip -> adamw, "frozen": set_to_zero})``:
optax hands the "train" branch a tree where frozen leaves are `optax.MaskedNode`, so frozen params
hold no Adam moments, and the clipping norm covers only trainable gradients.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from train.config import OptimizerConfig, TrainConfigError

TRAIN, FROZEN = "train", "frozen"


def path_str(path: tuple[Any, ...]) -> str:
    """Dotted form of a pytree key path: ``('groups', 'layer_0', 'gdn', 'A_log')`` ->
    ``groups.layer_0.gdn.A_log`` (list indices and attribute names become plain parts)."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def param_paths(tree: Any) -> Any:
    """Same structure as `tree`, each leaf replaced by its dotted path string."""
    return jax.tree_util.tree_map_with_path(lambda p, _: path_str(p), tree)


def _matches(patterns: tuple[str, ...], path: str) -> bool:
    return any(re.search(p, path) for p in patterns)


def _check_patterns_match(name: str, patterns: tuple[str, ...], paths: list[str]) -> None:
    """A selection regex that matches nothing is almost surely a typo that would silently train (or
    freeze) the wrong set, so it is an error naming the pattern and showing real paths."""
    for p in patterns:
        if not any(re.search(p, s) for s in paths):
            examples = ", ".join(paths[:4])
            raise TrainConfigError(f"optimizer.{name}: pattern {p!r} matches no param (paths look like: {examples})")


def trainable_mask(cfg: OptimizerConfig, params: Any) -> Any:
    """Tree of Python bools (params' structure): True where the param trains. Raises if a
    `trainable`/`frozen` pattern matches nothing, or if nothing trains."""
    paths = param_paths(params)
    flat = jax.tree.leaves(paths)
    if cfg.trainable is not None:
        _check_patterns_match("trainable", cfg.trainable, flat)
    _check_patterns_match("frozen", cfg.frozen, flat)

    def is_trainable(path: str) -> bool:
        selected = cfg.trainable is None or _matches(cfg.trainable, path)
        return selected and not _matches(cfg.frozen, path)

    mask = jax.tree.map(is_trainable, paths)
    if not any(jax.tree.leaves(mask)):
        raise TrainConfigError(
            f"optimizer: no trainable params (trainable={cfg.trainable!r}, frozen={cfg.frozen!r})")
    return mask


def decay_mask(cfg: OptimizerConfig, params: Any) -> Any:
    """Tree of bools: True where weight decay applies (path matches no `no_decay` pattern).
    Works on optax's masked trees too (`MaskedNode` subtrees have no leaves and stay as they are)."""
    return jax.tree_util.tree_map_with_path(lambda p, _: not _matches(cfg.no_decay, path_str(p)), params)


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> Callable[[jax.Array], jax.Array]:
    """Learning rate as a function of the update count (int array, from 0); see `OptimizerConfig`."""
    peak, warm = cfg.lr, cfg.warmup_steps
    end = cfg.decay_steps if cfg.decay_steps is not None else total_steps
    floor = peak * cfg.min_lr_ratio
    span = max(end - warm, 1)

    def schedule(step: jax.Array) -> jax.Array:
        s = jnp.asarray(step, jnp.float32)
        warm_lr = peak * (s + 1.0) / max(warm, 1)
        frac = jnp.clip((s - warm) / span, 0.0, 1.0)
        if cfg.decay == "cosine":
            decayed = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(math.pi * frac))
        elif cfg.decay == "linear":
            decayed = peak - (peak - floor) * frac
        else:
            decayed = jnp.full_like(s, peak)
        return jnp.where(s < warm, warm_lr, decayed)

    return schedule


@dataclass(frozen=True)
class Optimizer:
    """The optax transform plus what the train step needs to know about it.

    `trainable_mask(params)` is evaluated at trace time (Python bools), so the step differentiates
    only trainable leaves and leaves frozen params untouched (bit for bit).
    """

    tx: optax.GradientTransformation
    schedule: Callable[[jax.Array], jax.Array]
    config: OptimizerConfig

    def trainable_mask(self, params: Any) -> Any:
        return trainable_mask(self.config, params)

    def init(self, params: Any) -> Any:
        return self.tx.init(params)


def build_optimizer(cfg: OptimizerConfig, total_steps: int) -> Optimizer:
    """AdamW(schedule) after global-norm clipping on trainable params; zero updates elsewhere."""
    schedule = make_schedule(cfg, total_steps)
    mu_dtype = None if cfg.mu_dtype is None else jnp.dtype(cfg.mu_dtype)
    train_chain = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm is not None else []
    train_chain.append(optax.adamw(
        schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, mu_dtype=mu_dtype, weight_decay=cfg.weight_decay,
        mask=lambda p: decay_mask(cfg, p),
    ))

    def labels(params: Any) -> Any:
        return jax.tree.map(lambda t: TRAIN if t else FROZEN, trainable_mask(cfg, params))

    tx = optax.multi_transform({TRAIN: optax.chain(*train_chain), FROZEN: optax.set_to_zero()}, labels)
    return Optimizer(tx=tx, schedule=schedule, config=cfg)


__all__ = ["Optimizer", "build_optimizer", "decay_mask", "make_schedule", "param_paths", "path_str",
           "trainable_mask"]
