"""Post-hoc calibration of the history unit per target block size, without retraining
(`launch.py calibrate --config F --fit`; issue 20, the study's calibration (c)).

The history unit's logit carries gamma * log B (docs/design.md 3.2), learned at the training block
size(s). For a target size B' the fit shifts every GDN layer's and head's gamma by one scalar
delta (the learned per-head structure kept) to minimise the masked-token CE of the two-stream
forward at B' (`calibrate.masked_loss_table`: reference tokens masked at each of ``t_values``,
pooled over masked tokens) on the CALIBRATION split (`fit.calibration`), never the eval split
(`eval`). Search: a grid of deltas that includes 0, then a golden-section refinement around the
best grid point; the result is the best point evaluated, so the fitted loss is never above the
learned one on that split.

Writes ``<out_dir>/fit/fit.json`` (per target size: delta, the mean fitted gamma, the loss before
and after, the curve) and, with `fit.write_checkpoints`, ``<out_dir>/fit/block<B>/``: an HF
checkpoint whose scalars carry the fitted gamma, the source checkpoint's tokenizer beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
from flax import nnx

__all__ = ["fit_gamma_shift", "run_fit", "with_gamma_shift"]

_GOLDEN = (np.sqrt(5.0) - 1.0) / 2.0


def with_gamma_shift(model: Any, delta: float) -> Any:
    """A copy of ``model`` (`nnx.clone`: new variables; a split/merge would share them and shift
    the original too) with every GDN layer's gamma (column 2 of `bd_gdn_softmax_scalars`
    [groups, nv, 3]) plus ``delta``; ``model`` is unchanged."""
    out = nnx.clone(model)
    for j in range(out.cfg.group_size):
        sub = getattr(out.groups, f"layer_{j}")
        if hasattr(sub, "gdn"):
            var = sub.gdn.bd_gdn_softmax_scalars
            var[...] = var[...].at[..., 2].add(delta)
    return out


def fit_gamma_shift(loss_of: Callable[[float], float], deltas: tuple[float, ...],
                    refine_steps: int) -> tuple[float, dict[float, float]]:
    """argmin over delta of ``loss_of`` (grid, then golden section between the best point's grid
    neighbours); returns (best delta, every evaluated delta -> loss)."""
    grid = sorted(set(deltas) | {0.0})
    seen: dict[float, float] = {}

    def at(d: float) -> float:  # each delta evaluated once (a forward per noise level)
        if d not in seen:
            seen[d] = loss_of(d)
        return seen[d]

    for d in grid:
        at(d)
    i = min(range(len(grid)), key=lambda k: seen[grid[k]])
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    a, b = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    for _ in range(refine_steps if hi > lo else 0):
        fa, fb = at(a), at(b)
        if fa <= fb:
            hi, b = b, a
            a = hi - _GOLDEN * (hi - lo)
        else:
            lo, a = a, b
            b = lo + _GOLDEN * (hi - lo)
    best = min(seen, key=lambda d: (seen[d], abs(d)))
    return best, seen


def _pooled_loss(rows: list[dict]) -> float:
    n = sum(r["masked_tokens"] for r in rows)
    return sum(r["loss"] * r["masked_tokens"] for r in rows if r["masked_tokens"]) / max(n, 1)


def run_fit(cfg: Any, *, generate_record: Any = None, print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """The fit of a `CalibrateConfig` ``cfg`` (its checkpoint, out_dir and `fit` section; its
    `eval` section is never read). Returns what fit.json holds."""
    from clover_jax.api import save_hf
    from clover_jax.decoding.calibrate import (EvalSetConfig, FitConfig, LossEvalConfig, build_examples,
                                               eval_records, masked_loss_table, scalar_table)
    from clover_jax.decoding.cli import load_checkpoint
    from clover_jax.decoding.generator import DecodeError
    from clover_jax.yaml_config import from_tree

    fc: FitConfig = cfg.fit
    if not cfg.checkpoint:
        raise DecodeError("calibrate --fit: set checkpoint=DIR")
    split = from_tree(EvalSetConfig, dict(fc.calibration), where="fit.calibration")
    if cfg.eval.source == "jsonl" and split.source == "jsonl" and split.path == cfg.eval.path:
        raise DecodeError(f"fit.calibration.path {split.path} is the eval split: fit on a split of its own")
    mcfg, model, tok = load_checkpoint(cfg.checkpoint)
    if mcfg.mode != "block" or mcfg.mask_token_id is None:
        raise DecodeError(f"{cfg.checkpoint}: the fit needs a block-diffusion checkpoint with a mask token")
    locations: list[str] = []
    examples = build_examples(tok, eval_records(split, locations, generate_record=generate_record), locations)
    if not examples:
        raise DecodeError("calibrate --fit: the calibration split is empty")
    out = Path(cfg.out_dir) / "fit"
    out.mkdir(parents=True, exist_ok=True)
    learned_gamma = float(np.mean([s["gamma"] for s in scalar_table(model)]))
    result: dict[str, Any] = {"checkpoint": str(cfg.checkpoint), "calibration": dict(fc.calibration),
                              "examples": len(examples), "learned_gamma_mean": learned_gamma, "targets": {}}
    for k in fc.block_sizes:
        lcfg = LossEvalConfig(block_sizes=(k,), t_values=fc.t_values, n=fc.n, seed=fc.seed)

        def loss_of(delta: float) -> float:
            return _pooled_loss(masked_loss_table(with_gamma_shift(model, delta), examples, lcfg, mcfg.mask_token_id))

        delta, curve = fit_gamma_shift(loss_of, fc.deltas, fc.refine_steps)
        entry = {"delta": delta, "gamma_mean": learned_gamma + delta, "loss_learned": curve[0.0],
                 "loss_fitted": curve[delta], "curve": {f"{d:.4f}": v for d, v in sorted(curve.items())}}
        if fc.write_checkpoints:
            path = save_hf(with_gamma_shift(model, delta), mcfg, out / f"block{k}", dtype=None,
                           source_dir=cfg.checkpoint, overwrite=True)
            entry["checkpoint"] = str(path)
        result["targets"][str(k)] = entry
        print_fn(f"block {k}: gamma shift {delta:+.3f} (mean gamma {learned_gamma:.3f} -> {learned_gamma + delta:.3f}), "
                 f"masked CE on the calibration split {curve[0.0]:.4f} -> {curve[delta]:.4f}")
    (out / "fit.json").write_text(json.dumps(result, indent=1) + "\n")
    print_fn(f"wrote {out / 'fit.json'}")
    return result
