"""PNG plots of `clover_jax.decoding.calibrate` (matplotlib, Agg backend, no display needed).

- `quality_vs_speed.png`: quality vs tokens per forward, one curve per block size (points = the
  thresholds / overrides of that size), the AR baseline as a star;
- `history_share.png`: mean softmax share of the history unit vs block size, one line per GDN layer
  (only when the sweep recorded it);
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


def write_plots(out: Path, rows: list[dict[str, Any]], loss_rows: list[dict[str, Any]],
                scalars: list[dict[str, Any]], quality: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    by_size: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["mode"] != "ar":
            by_size[(r["mode"], r["block_size"])].append(r)
    for (mode, k), rs in sorted(by_size.items()):
        rs = sorted(rs, key=lambda r: r["tokens_per_forward"])
        label = f"block {k}" + ("" if mode == "threshold" else f" ({mode})")
        ax.plot([r["tokens_per_forward"] for r in rs], [r[quality] for r in rs], "o-", label=label)
    for r in rows:
        if r["mode"] == "ar":
            ax.plot([r["tokens_per_forward"]], [r[quality]], "k*", markersize=12, label="AR greedy")
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel(quality)
    ax.set_title("quality vs speed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
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


__all__ = ["write_plots"]
