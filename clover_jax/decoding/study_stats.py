"""95% intervals of the calibration study's numbers (`study_report`): over training seeds and over
eval prompts.

Every number of the study's tables is a linear combination of cell means: a cell (model, decode
setting) is measured once per training seed of that model, on the same eval prompts for every model;
its value is the mean over those seeds. A penalty is one cell minus another model's, an average
penalty a sum of such terms. Two intervals are given for each combination:

- over seeds (`t_interval`): the models are independent samples (each seed a separately trained
  model), so the combination ``sum_m c_m * mean_s(y_ms)`` (``y_ms``: model m's terms at seed s) has
  variance ``sum_m var_s(y_m) / n_m``, with Welch-Satterthwaite degrees of freedom; for one cell this
  is the ordinary t-interval ``mean +- t(n-1) * sd / sqrt(n)``. None when a model in it has one seed.
- over prompts (`bootstrap_interval`): the eval prompts are resampled with replacement (the same
  resample for every model and seed: the prompts are shared, so differences are paired), the
  combination recomputed on each resample (`n_boot` of them, a fixed seed: the report is
  reproducible), and the 2.5 / 97.5% percentiles taken. None without per-prompt results.

A difference is *separated* when each interval it has excludes 0 and the seed interval is there
(`Interval.separated`): a prompt bootstrap alone says nothing about how far another training seed
moves the number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["Interval", "bootstrap_indices", "bootstrap_interval", "t_interval"]

LEVEL = 0.95
N_BOOT = 2000


@dataclass(frozen=True)
class Interval:
    """A number with its 95% intervals: `seeds` over training seeds, `prompts` over eval prompts
    ((low, high); None where it cannot be computed: module docstring)."""

    mean: float
    seeds: tuple[float, float] | None = None
    prompts: tuple[float, float] | None = None

    @staticmethod
    def _excludes_zero(iv: tuple[float, float] | None) -> bool:
        return iv is not None and (iv[0] > 0 or iv[1] < 0)

    @property
    def separated(self) -> bool:
        """The seed interval excludes 0, and so does the prompt interval where there is one."""
        return self._excludes_zero(self.seeds) and (self.prompts is None or self._excludes_zero(self.prompts))

    @property
    def prompts_only(self) -> bool:
        """The prompt interval excludes 0 but the difference is not `separated` (one seed, or the seed
        interval holds 0): it may be what another training seed would undo."""
        return self._excludes_zero(self.prompts) and not self.separated


def _t_quantile(p: float, df: float) -> float:
    from scipy.stats import t  # scipy: a dependency of jax

    return float(t.ppf(p, df))


def t_interval(per_model: Sequence[Sequence[float]], level: float = LEVEL) -> tuple[float, float] | None:
    """The interval of ``sum_m mean(y_m)`` over independent models (`per_model`: each model's terms
    per seed, y_m [n_m]): Welch-Satterthwaite (module docstring); None when a model has < 2 seeds."""
    ys = [np.asarray(y, np.float64) for y in per_model]
    if not ys or any(len(y) < 2 for y in ys):
        return None
    mean = float(sum(y.mean() for y in ys))
    v = [float(y.var(ddof=1)) / len(y) for y in ys]
    se2 = sum(v)
    if se2 == 0.0:  # every seed gave the same number
        return (mean, mean)
    df = se2**2 / sum(vi**2 / (len(y) - 1) for vi, y in zip(v, ys))
    half = _t_quantile(0.5 + level / 2, df) * math.sqrt(se2)
    return (mean - half, mean + half)


def bootstrap_indices(n_prompts: int, n_boot: int = N_BOOT, seed: int = 0) -> np.ndarray:
    """int [n_boot, n_prompts]: prompt resamples with replacement (the same for every number of a report)."""
    return np.random.default_rng(seed).integers(n_prompts, size=(n_boot, n_prompts))


def bootstrap_interval(stat_B: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The percentile interval of a statistic computed on each prompt resample (`stat_B`: f64 [B],
    one value per row of `bootstrap_indices`); resamples where it is undefined (nan) are dropped."""
    vals = np.asarray(stat_B, np.float64)
    vals = vals[~np.isnan(vals)]
    if not len(vals):
        return (float("nan"), float("nan"))
    lo, hi = np.quantile(vals, [(1 - level) / 2, (1 + level) / 2])
    return (float(lo), float(hi))
