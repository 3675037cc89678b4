"""The SFT run's loss summary (``<run_dir>/summary.json``) and plot (``<run_dir>/loss.png``), read
from its metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["loss_summary", "plot_losses"]


def loss_summary(metrics_path: Path, window: int = 100) -> dict[str, Any]:
    """First vs last `window` logged steps: mean train loss (and masked CE) and mean held-out loss
    of the evals in those windows (each window at most half the run, so they never overlap)."""
    recs = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval/loss" in r]
    out: dict[str, Any] = {"steps_logged": len(train)}
    if train:
        w = max(1, min(window, len(train) // 2))
        for k in ("loss", "ce"):
            vals = [r[k] for r in train if k in r]
            if vals:
                out[f"train_{k}_first"] = float(np.mean(vals[:w]))
                out[f"train_{k}_last"] = float(np.mean(vals[-w:]))
        out["window_steps"] = w
        first_end, last_start = train[w - 1]["step"], train[-w]["step"]
        if evals:
            first = [r["eval/loss"] for r in evals if r["step"] <= first_end] or [evals[0]["eval/loss"]]
            last = [r["eval/loss"] for r in evals if r["step"] >= last_start] or [evals[-1]["eval/loss"]]
            out["eval_loss_first"], out["eval_loss_last"] = float(np.mean(first)), float(np.mean(last))
            out["eval_evals"] = len(evals)
    return out


def plot_losses(metrics_path: Path, out: Path) -> None:
    """Train loss and held-out CE against the step, as a PNG (nothing without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    recs = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    tr = [(r["step"], r["loss"]) for r in recs if "loss" in r]
    ev = [(r["step"], r["eval/loss"]) for r in recs if "eval/loss" in r]
    if tr:
        ax.plot(*zip(*tr), label="train loss", lw=1)
    if ev:
        ax.plot(*zip(*ev), "o-", label="held-out masked CE (mean over t)", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
