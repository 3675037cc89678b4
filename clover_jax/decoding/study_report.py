"""The block-size calibration study's arithmetic and report (issue 20, docs/calibration_study.md).

The study decodes models trained at several block sizes (``trained``: an int, or ``"mix"`` for the
model trained on a mix of sizes) at every decode block size, threshold and history-unit
calibration. Its rows are `calibrate` sweep rows (`clover_jax.decoding.calibrate.run_setting`) with
``trained`` added; the calibration of a row is `calibrate_plots.calibration_label` ("learned",
"gamma=0", or a fitted value's label set by the study as ``calibration``).

- `penalty_matrix`: the mismatch penalty, quality at decode size B' of the model trained at B minus
  that of the model trained at B' (the native model) at B', same threshold, learned calibration:
  0 on the diagonal, negative where decoding at a size the model was not trained for costs quality;
- `recovery`: per calibration, the share of that penalty it wins back:
  (q_cal - q_learned) / (q_native - q_learned), for cells whose penalty is not ~0;
- `native_by_threshold` / `ar_quality`: each model at its own block size per threshold (quality and
  tokens per forward), and its AR quality, the ceiling;
- `write_report`: markdown tables of these, the absolute quality and speed behind the penalty, the
  penalty heat map and the quality-vs-speed plots, and the answer in sentences built from the same
  numbers.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from clover_jax.decoding.calibrate_plots import QUALITY_LABELS, calibration_label, write_plots

__all__ = ["ar_quality", "native_by_threshold", "penalty_matrix", "recovery", "summarize", "write_report"]

Key = tuple[Any, int]  # (trained block size or "mix", decode block size)
_EPS = 1e-9


def _cal(row: dict[str, Any]) -> str:
    return row.get("calibration") or calibration_label(row)


def _quality(rows: Iterable[dict[str, Any]], quality: str, threshold: float, calibration: str) -> dict[Key, float]:
    """(trained, decode size) -> quality of the threshold-mode rows at ``threshold`` and ``calibration``."""
    out: dict[Key, float] = {}
    for r in rows:
        if r["mode"] == "threshold" and abs(r["threshold"] - threshold) < _EPS and _cal(r) == calibration:
            key = (r["trained"], int(r["block_size"]))
            if key in out:
                raise ValueError(f"study rows: two rows for trained {key[0]}, block {key[1]}, threshold {threshold}, "
                                 f"calibration {calibration!r}")
            out[key] = float(r[quality])
    return out


def penalty_matrix(rows: list[dict[str, Any]], quality: str, threshold: float) -> dict[Key, float]:
    """(trained B, decode B') -> q(B at B') - q(B' at B') (learned calibration), for every B' that
    has a native model (module docstring)."""
    q = _quality(rows, quality, threshold, "learned")
    return {(t, d): v - q[(d, d)] for (t, d), v in q.items() if (d, d) in q}


def recovery(rows: list[dict[str, Any]], quality: str, threshold: float, calibration: str,
             min_penalty: float = 0.02) -> dict[Key, float]:
    """(trained B, decode B') -> the share of the mismatch penalty that ``calibration`` recovers, for
    off-diagonal cells that lose at least ``min_penalty`` against the native model (a ratio of two ~0
    numbers says nothing; a cell that beats the native model, e.g. the mix's, has nothing to recover)."""
    learned, cal = _quality(rows, quality, threshold, "learned"), _quality(rows, quality, threshold, calibration)
    out = {}
    for (t, d), pen in penalty_matrix(rows, quality, threshold).items():
        if t != d and pen <= -min_penalty and (t, d) in cal:
            out[(t, d)] = (cal[(t, d)] - learned[(t, d)]) / (-pen)
    return out


def summarize(rows: list[dict[str, Any]], quality: str, threshold: float) -> dict[str, Any]:
    """The numbers the report's answer states: mean off-diagonal penalty, the mix model's mean
    shortfall against the native models, and each calibration's mean recovery."""
    pen = penalty_matrix(rows, quality, threshold)
    off = [v for (t, d), v in pen.items() if t != d and t != "mix"]
    mix = [v for (t, d), v in pen.items() if t == "mix"]
    cals = sorted({_cal(r) for r in rows if r["mode"] == "threshold"} - {"learned"})
    rec = {c: recovery(rows, quality, threshold, c) for c in cals}
    return {"quality": quality, "threshold": threshold, "cells": len(off),
            "mean_penalty": sum(off) / len(off) if off else float("nan"),
            "worst_penalty": min(off) if off else float("nan"),
            "mix_mean_vs_native": sum(mix) / len(mix) if mix else float("nan"),
            "recovery": {c: (sum(v.values()) / len(v) if v else float("nan")) for c, v in rec.items()},
            "recovery_cells": {c: len(v) for c, v in rec.items()}}


def native_by_threshold(rows: list[dict[str, Any]], quality: str) -> dict[tuple[Any, float], tuple[float, float]]:
    """(trained B, threshold) -> (quality, tokens per forward) of the model decoded at its own block size
    (learned calibration): the speed / quality trade-off each model offers where it was trained."""
    out = {}
    for r in rows:
        if r["mode"] == "threshold" and _cal(r) == "learned" and r["trained"] == int(r["block_size"]):
            out[(r["trained"], float(r["threshold"]))] = (float(r[quality]), float(r["tokens_per_forward"]))
    return out


def ar_quality(rows: list[dict[str, Any]], quality: str) -> dict[Any, float]:
    """trained -> quality of AR greedy decoding (the ceiling block decoding is measured against)."""
    return {r["trained"]: float(r[quality]) for r in rows if r["mode"] == "ar"}


def _native_md(cells: dict[tuple[Any, float], tuple[float, float]]) -> list[str]:
    trained = sorted({t for t, _ in cells}, key=_order)
    thresholds = sorted({h for _, h in cells})
    lines = ["| trained = decoded | " + " | ".join(f"threshold {h:g}" for h in thresholds) + " |",
             "|---|" + "---|" * len(thresholds)]
    for t in trained:
        vals = [("{:.3f} @ {:.2f}".format(*cells[(t, h)]) if (t, h) in cells else "") for h in thresholds]
        lines.append(f"| {t} | " + " | ".join(vals) + " |")
    return lines


def _label(t: Any) -> str:
    return "mix" if t == "mix" else str(t)


def _order(t: Any) -> tuple[bool, int]:
    """Sort key of trained block sizes: ascending, the mix model last."""
    return (t == "mix", t if t != "mix" else 0)


def _matrix_md(cells: dict[Key, float], fmt: str = "{:+.3f}") -> list[str]:
    trained = sorted({t for t, _ in cells}, key=_order)
    decoded = sorted({d for _, d in cells})
    lines = ["| trained \\ decoded | " + " | ".join(f"block {d}" for d in decoded) + " |",
             "|---|" + "---|" * len(decoded)]
    for t in trained:
        vals = [fmt.format(cells[(t, d)]) if (t, d) in cells else "" for d in decoded]
        lines.append(f"| {_label(t)} | " + " | ".join(vals) + " |")
    return lines


def _heatmap(cells: dict[Key, float], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    trained = sorted({t for t, _ in cells}, key=_order)
    decoded = sorted({d for _, d in cells})
    m = np.full((len(trained), len(decoded)), np.nan)
    for (t, d), v in cells.items():
        m[trained.index(t), decoded.index(d)] = v
    lim = max(float(np.nanmax(np.abs(m))), 1e-3)
    fig, ax = plt.subplots(figsize=(1.2 * len(decoded) + 2, 0.8 * len(trained) + 1.5))
    im = ax.imshow(m, cmap="RdBu", vmin=-lim, vmax=lim)
    for i in range(len(trained)):
        for j in range(len(decoded)):
            if not np.isnan(m[i, j]):
                ax.text(j, i, f"{m[i, j]:+.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(decoded)), [str(d) for d in decoded])
    ax.set_yticks(range(len(trained)), [_label(t) for t in trained])
    ax.set_xlabel("decode block size")
    ax.set_ylabel("trained block size")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="quality difference vs the native model")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(out: Path, rows: list[dict[str, Any]], *, quality: str, threshold: float, command: str,
                 title: str = "Block-size calibration study") -> Path:
    """``out``/calibration_study.md with its PNGs beside it (module docstring); returns the md path."""
    out.mkdir(parents=True, exist_ok=True)
    s = summarize(rows, quality, threshold)
    pen = penalty_matrix(rows, quality, threshold)
    qname = QUALITY_LABELS.get(quality, quality)
    heat = _heatmap(pen, out / "penalty_matrix.png", f"mismatch penalty: {qname}, threshold {threshold:g}")
    by_trained: dict[Any, list[dict]] = defaultdict(list)
    for r in rows:
        by_trained[r["trained"]].append(r)
    plots = []
    for t, rs in sorted(by_trained.items(), key=lambda kv: _order(kv[0])):
        d = out / f"trained_{_label(t)}"
        d.mkdir(exist_ok=True)
        plots += [p.relative_to(out) for p in write_plots(d, rs, [], [], quality)]
    rec_line = "; ".join(f"{c}: {v:+.0%} of the penalty ({s['recovery_cells'][c]} cells)"
                         for c, v in s["recovery"].items()) or "no calibration other than the learned one was run"
    lines = [f"# {title}", "", f"Regenerate: `{command}`", "", "## Answer", "",
             f"Decoding at a block size the model was not trained at changes {qname} by "
             f"{s['mean_penalty']:+.3f} on average over {s['cells']} (trained, decoded) pairs at threshold "
             f"{threshold:g} (worst {s['worst_penalty']:+.3f}); the model trained on the mix of sizes is "
             f"{s['mix_mean_vs_native']:+.3f} against the native models. Calibration recovers: {rec_line}.",
             "", f"## Mismatch penalty ({qname}, threshold {threshold:g}, learned calibration)", "",
             *_matrix_md(pen), "", f"![penalty matrix]({heat.name})", ""]
    absolute = _quality(rows, quality, threshold, "learned")
    speed = _quality(rows, "tokens_per_forward", threshold, "learned")
    ar = ar_quality(rows, quality)
    lines += [f"## {qname} and tokens per forward (threshold {threshold:g}, learned calibration)", "",
              *_matrix_md(absolute, "{:.3f}"), "", *_matrix_md(speed, "{:.2f}"), ""]
    if ar:
        lines += ["AR greedy decoding (one token per forward) of the same models: " + ", ".join(
            f"trained {_label(t)} {v:.3f}" for t, v in sorted(ar.items(), key=lambda kv: _order(kv[0]))
        ) + ".", ""]
    native = native_by_threshold(rows, quality)
    if native:
        lines += [f"## Each model at its own block size: {qname} @ tokens per forward, by threshold", "",
                  *_native_md(native), ""]
    for c in s["recovery"]:
        lines += [f"## Share of the penalty recovered by {c}", "", *_matrix_md(recovery(rows, quality, threshold, c),
                                                                                  "{:+.0%}"), ""]
    if any("history_share_mean" in r for r in rows if r["mode"] == "threshold"):
        share = _quality([r for r in rows if isinstance(r.get("history_share_mean"), float)], "history_share_mean",
                         threshold, "learned")
        lines += [f"## History-unit softmax share (mean over GDN layers and canvas tokens, threshold {threshold:g}, "
                  "learned calibration)", "", *_matrix_md(share, "{:.3f}"), "",
                  "Per GDN layer vs block size: `trained_<B>/history_share.png`; vs the position inside the block: "
                  "`trained_<B>/history_position.png` (below).", ""]
    lines += ["## Plots per trained model", "", "Quality vs tokens per forward (one series per decode block size and "
              "calibration, points labelled by threshold, AR as a star), the history-unit share per layer vs block "
              "size and vs the position inside the block.", "", *[f"![{p}]({p})" for p in plots], ""]
    md = out / "calibration_study.md"
    md.write_text("\n".join(lines))
    return md
