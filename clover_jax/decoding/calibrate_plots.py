"""PNG plots of `clover_jax.decoding.calibrate` (matplotlib, Agg backend, no display needed).

- `quality_vs_speed.png`: quality vs tokens per forward, one series per (block size, calibration)
  (`quality_series`: a colour per block size, a line style per calibration, so the learned-gamma and
  gamma = 0 points of one size are never one zig-zag line), each series' points ordered and
  labelled by threshold, the AR baseline as a star;
- `history_share.png`: mean softmax share of the history unit vs block size, one line per GDN layer
  (only when the sweep recorded it);
- `history_position.png`: that share vs the position inside the block (as a fraction of the block),
  one panel per GDN layer, one line per block size (learned calibration, mean over thresholds);
- `loss_vs_t.png`: masked-token loss vs noise level t, one line per block size;
- `scalars.png`: learned alpha, beta, gamma per GDN layer (x) and head (one marker per head).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any


def _save(fig: Any, path: Path) -> Path:
    """Lays out, writes (100 dpi) and closes one figure; returns its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


#: axis labels with units, by the sweep's quality metric
QUALITY_LABELS = {"validity": "tool-call validity (fraction of turns)",
                  "bfcl_accuracy": "argument accuracy (fraction of turns)",
                  "exact_match": "exact match (fraction of turns)",
                  "ar_agreement": "agreement with AR (fraction of tokens)"}
_STYLES = ("-", "--", ":", "-.")


def calibration_label(row: dict[str, Any]) -> str:
    """The history-unit calibration of a sweep row: "learned" or its overrides ("gamma=0", ...)."""
    parts = [] if row.get("gamma", "learned") == "learned" else [f"gamma={row['gamma']:g}"]
    if row.get("alpha_scale", 1.0) != 1.0:
        parts.append(f"alpha x{row['alpha_scale']:g}")
    if row.get("beta_shift", 0.0) != 0.0:
        parts.append(f"beta {row['beta_shift']:+g}")
    return ", ".join(parts) or "learned"


def quality_series(rows: list[dict[str, Any]]) -> dict[tuple[str, int, int, str], list[dict[str, Any]]]:
    """(mode, block size, sub-block size, calibration label) -> that series' rows ordered by
    threshold; AR rows are left out (one point, drawn apart)."""
    series: dict[tuple[str, int, int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["mode"] != "ar":
            series[(r["mode"], r["block_size"], r.get("sub_block_size", 0) or 0, calibration_label(r))].append(r)
    return {k: sorted(v, key=lambda r: r["threshold"]) for k, v in sorted(series.items())}


def write_plots(out: Path, rows: list[dict[str, Any]], loss_rows: list[dict[str, Any]],
                scalars: list[dict[str, Any]], quality: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = quality_series(rows)
    sizes = sorted({k[1] for k in series})
    cals = sorted({k[3] for k in series}, key=lambda c: (c != "learned", c))
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, max(len(sizes), 1)))
    for (mode, k, sb, cal), rs in series.items():
        label = f"block {k}" + (f" sub {sb}" if sb else "") + ("" if mode == "threshold" else f" {mode}") + f", {cal}"
        xs, ys = [r["tokens_per_forward"] for r in rs], [r[quality] for r in rs]
        ax.plot(xs, ys, _STYLES[cals.index(cal) % len(_STYLES)], marker="o", color=colors[sizes.index(k)], label=label)
        for r, x, y in zip(rs, xs, ys):
            ax.annotate(f"{r['threshold']:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6)
    for r in rows:
        if r["mode"] == "ar":
            ax.plot([r["tokens_per_forward"]], [r[quality]], "k*", markersize=12, label="AR greedy")
    ax.set_xlabel("tokens per forward (generated tokens / model calls)")
    ax.set_ylabel(QUALITY_LABELS.get(quality, quality))
    ax.set_title("quality vs speed (point labels: commit threshold)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    written.append(_save(fig, out / "quality_vs_speed.png"))

    hist_rows = [r for r in rows if r["mode"] != "ar" and "history_share_L0" in r]
    hist_cols = sorted({c for r in hist_rows for c in r if c.startswith("history_share_L")}, key=lambda c: int(c[15:]))
    if hist_cols:
        fig, ax = plt.subplots(figsize=(6, 4))
        for c in hist_cols:
            per_k: dict[int, list[float]] = defaultdict(list)
            for r in hist_rows:
                per_k[r["block_size"]].append(r[c])
            ks = sorted(per_k)
            ax.plot(ks, [sum(per_k[k]) / len(per_k[k]) for k in ks], "o-", label=f"GDN layer {c[15:]}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size")
        ax.set_ylabel("mean history-unit softmax share")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(_save(fig, out / "history_share.png"))
        written += _history_position_plot(out, rows)

    if loss_rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        per: dict[int, list[dict]] = defaultdict(list)
        for r in loss_rows:
            per[r["block_size"]].append(r)
        for k, rs in sorted(per.items()):
            rs = sorted(rs, key=lambda r: r["t"])
            ax.plot([r["t"] for r in rs], [r["loss"] for r in rs], "o-", label=f"block {k}")
        ax.set_xlabel("mask ratio t")
        ax.set_ylabel("masked-token CE")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(_save(fig, out / "loss_vs_t.png"))

    if scalars:
        fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
        for ax, name in zip(axes, ("alpha", "beta", "gamma")):
            ax.scatter([s["gdn_layer"] for s in scalars], [s[name] for s in scalars], c=[s["head"] for s in scalars],
                       cmap="viridis", s=18)
            ax.set_xlabel("GDN layer")
            ax.set_title(name)
            ax.grid(alpha=0.3)
        written.append(_save(fig, out / "scalars.png"))
    return written


def _history_position_plot(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    import warnings

    import matplotlib.pyplot as plt
    import numpy as np

    pos = [r for r in rows if isinstance(r.get("history_share_by_position"), list) and calibration_label(r) == "learned"]
    if not pos:
        return []
    n_layers = len(pos[0]["history_share_by_position"])
    sizes = sorted({r["block_size"] for r in pos})
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, len(sizes)))
    fig, axes = plt.subplots(1, n_layers, figsize=(4.2 * n_layers, 3.6), squeeze=False, sharey=True)
    for layer, ax in enumerate(axes[0]):
        for color, k in zip(colors, sizes):
            per = np.stack([np.asarray(r["history_share_by_position"][layer], np.float64)
                            for r in pos if r["block_size"] == k])
            with warnings.catch_warnings():  # a position no token reached is NaN in every row: a gap
                warnings.simplefilter("ignore", RuntimeWarning)
                mean = np.nanmean(per, axis=0)
            ax.plot((np.arange(k) + 0.5) / k, mean, "o-", ms=3, color=color, label=f"block {k}")
        ax.set_xlabel("position in the block (fraction of its size)")
        ax.set_title(f"GDN layer {layer}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("history-unit softmax share")
    axes[0][-1].legend(fontsize=7)
    return [_save(fig, out / "history_position.png")]


__all__ = ["QUALITY_LABELS", "calibration_label", "quality_series", "write_plots"]
