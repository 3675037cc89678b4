"""The block-size calibration study's arithmetic and report (docs/guides/calibration.md).

The study decodes models trained at several block sizes (``trained``: an int, or a name: ``"mix"``
for the model trained on a mix of sizes, ``"curriculum"`` for the one trained on a block-size
schedule) at every decode block size, threshold and history-unit calibration, each model once per
training seed (``seed``, 0 when absent). Its rows are `calibrate` sweep rows
(`clover_jax.decoding.calibrate.run_setting`) with ``trained`` and ``seed`` added, and, where the
sweep kept them, ``per_prompt`` results (lists over the eval prompts, the same prompts for every
row: ``validity``, ``bfcl_accuracy``, ``exact_match`` per prompt, ``tokens`` and ``nfe`` for tokens
per forward). The calibration of a row is `calibrate_plots.calibration_label` ("learned", "gamma=0",
or a fitted value's label set by the study as ``calibration``). Every number is the mean over the
model's seeds.

- `penalty_matrix`: the mismatch penalty, quality at decode size B' of the model trained at B minus
  that of the model trained at B' (the native model) at B', same threshold, learned calibration:
  0 on the diagonal, negative where decoding at a size the model was not trained for costs quality;
- `recovery`: per calibration, the share of that penalty it wins back:
  (q_cal - q_learned) / (q_native - q_learned), for cells whose penalty is not ~0;
- `native_by_threshold` / `ar_quality`: each model at its own block size per threshold (quality and
  tokens per forward), and its AR quality, the ceiling;
- `write_report`: markdown tables of these, the absolute quality and speed behind the penalty, the
  comparisons of the named models (mix, curriculum) with the largest native size and each other,
  each number with its 95% intervals over seeds and over prompts (`study_stats`; the recovery share,
  a ratio, over prompts only), the penalty heat map and the quality-vs-speed plots, and the answer
  in sentences built from the same numbers, naming the differences the intervals separate.
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from clover_jax.decoding.calibrate_plots import QUALITY_LABELS, calibration_label, write_plots
from clover_jax.decoding.study_stats import Interval, bootstrap_indices, bootstrap_interval, t_interval

__all__ = ["ar_quality", "native_by_threshold", "penalty_matrix", "recovery", "summarize", "write_report"]

Key = tuple[Any, int]  # (trained block size or a name, decode block size)
_EPS = 1e-9
_NAMED = ("mix", "curriculum")  # the report's order of named models, after the native sizes
_MEAN_METRICS = ("validity", "bfcl_accuracy", "exact_match")  # per-prompt 0/1 results, averaged
_MIN_PENALTY = 0.02  # `recovery`: a smaller penalty has no share to speak of


def _cal(row: dict[str, Any]) -> str:
    return row.get("calibration") or calibration_label(row)


class _Cells:
    """The cells (trained, decode size) of `metric` in the threshold-mode rows at `threshold` and
    `calibration` (or, with `ar`, the AR rows: decode size 1): per cell, the row of each seed."""

    def __init__(self, rows: Iterable[dict[str, Any]], metric: str, threshold: float | None = None,
                 calibration: str = "learned", ar: bool = False):
        self.metric = metric
        self.rows: dict[Key, dict[int, dict[str, Any]]] = defaultdict(dict)
        for r in rows:
            if ar:
                if r["mode"] != "ar":
                    continue
            elif not (r["mode"] == "threshold" and abs(r["threshold"] - threshold) < _EPS and _cal(r) == calibration):
                continue
            key, seed = (r["trained"], int(r["block_size"])), int(r.get("seed", 0))
            if seed in self.rows[key]:
                raise ValueError(f"study rows: two rows for trained {key[0]}, block {key[1]}, threshold {threshold}, "
                                 f"calibration {calibration!r}, seed {seed}")
            self.rows[key][seed] = r
        self._boot: dict[Key, np.ndarray | None] = {}

    def __contains__(self, key: Key) -> bool:
        return key in self.rows

    def keys(self) -> list[Key]:
        return list(self.rows)

    def seed_values(self, key: Key) -> dict[int, float]:
        return {s: float(r[self.metric]) for s, r in sorted(self.rows[key].items())}

    def mean(self, key: Key) -> float:
        return float(np.mean(list(self.seed_values(key).values())))

    def boot(self, key: Key, idx_BP: np.ndarray) -> np.ndarray | None:
        """f64 [B]: the cell's mean over seeds on each prompt resample; None without per-prompt results."""
        if key not in self._boot:
            per_seed = []
            for r in self.rows[key].values():
                p = r.get("per_prompt")
                if not p:
                    per_seed = None
                    break
                if self.metric in _MEAN_METRICS:
                    per_seed.append(np.asarray(p[self.metric], np.float64)[idx_BP].mean(axis=1))
                elif self.metric == "tokens_per_forward":
                    t, n = np.asarray(p["tokens"], np.float64), np.asarray(p["nfe"], np.float64)
                    per_seed.append(t[idx_BP].sum(axis=1) / np.maximum(n[idx_BP].sum(axis=1), 1.0))
                else:
                    per_seed = None
                    break
            self._boot[key] = None if per_seed is None else np.mean(per_seed, axis=0)
        return self._boot[key]


Terms = list[tuple[float, _Cells, Key]]  # a linear combination of cell means: sum of coef * cell


def _value(terms: Terms) -> float:
    """The combination of the cells' means over seeds."""
    return float(sum(c * cells.mean(k) for c, cells, k in terms))


def _boots(terms: Terms, idx_BP: np.ndarray | None) -> np.ndarray | None:
    """f64 [B]: the combination on each prompt resample; None without per-prompt results in every term."""
    if idx_BP is None:
        return None
    boots = [(c, cells.boot(k, idx_BP)) for c, cells, k in terms]
    return None if any(b is None for _, b in boots) else sum(c * b for c, b in boots)


def _ratio_interval(num: Terms, den: Terms, idx_BP: np.ndarray | None) -> Interval:
    """num / den with its prompt interval only: a ratio of combinations has no t-interval over seeds."""
    b_num, b_den = _boots(num, idx_BP), _boots(den, idx_BP)
    prompts = None
    if b_num is not None and b_den is not None:
        with np.errstate(divide="ignore", invalid="ignore"):  # a resample without a penalty: nan, dropped
            ratio = b_num / b_den
        prompts = bootstrap_interval(ratio)
    return Interval(_value(num) / _value(den), None, prompts)


def _interval(terms: Terms, idx_BP: np.ndarray | None) -> Interval:
    """The combination's mean over seeds with its seed and prompt intervals (`study_stats`)."""
    mean = _value(terms)
    by_model: dict[Any, dict[int, float]] = {}
    for c, cells, k in terms:
        vals = cells.seed_values(k)
        per = by_model.setdefault(k[0], dict.fromkeys(vals, 0.0))
        if set(per) != set(vals):
            raise ValueError(f"study rows: trained {k[0]} has seeds {sorted(per)} in one cell, {sorted(vals)} in another")
        for s, v in vals.items():
            per[s] += c * v
    seeds = t_interval([list(v.values()) for v in by_model.values()])
    boots = _boots(terms, idx_BP)
    prompts = None if boots is None else bootstrap_interval(boots)
    return Interval(mean, seeds, prompts)


def _prompt_indices(rows: list[dict[str, Any]]) -> np.ndarray | None:
    """The report's prompt resamples (`study_stats.bootstrap_indices`) over the rows' eval prompts;
    None when no row has per-prompt results."""
    lengths = {len(next(iter(r["per_prompt"].values()))) for r in rows if r.get("per_prompt")}
    if len(lengths) > 1:
        raise ValueError(f"study rows: per-prompt results over different numbers of prompts {sorted(lengths)}")
    return bootstrap_indices(lengths.pop()) if lengths else None


# ---------------------------------------------------------------------------------------- numbers
def _penalty_terms(q: _Cells) -> dict[Key, Terms]:
    return {(t, d): [(1.0, q, (t, d)), (-1.0, q, (d, d))] for (t, d) in q.keys() if (d, d) in q}


def _means(cells: _Cells) -> dict[Key, float]:
    return {k: cells.mean(k) for k in cells.keys()}


def penalty_matrix(rows: list[dict[str, Any]], quality: str, threshold: float) -> dict[Key, float]:
    """(trained B, decode B') -> q(B at B') - q(B' at B') (learned calibration), for every B' that
    has a native model (module docstring)."""
    return {k: _value(terms) for k, terms in _penalty_terms(_Cells(rows, quality, threshold)).items()}


def _recovery_cells(rows: list[dict[str, Any]], quality: str, threshold: float, calibration: str,
                    min_penalty: float) -> dict[Key, tuple[Terms, Terms]]:
    """(trained, decode) -> (numerator, denominator) terms of the recovered share (`recovery`)."""
    learned, cal = _Cells(rows, quality, threshold), _Cells(rows, quality, threshold, calibration)
    out = {}
    for (t, d), terms in _penalty_terms(learned).items():
        pen = _value(terms)
        if t != d and pen <= -min_penalty and (t, d) in cal:
            out[(t, d)] = ([(1.0, cal, (t, d)), (-1.0, learned, (t, d))], [(-c, q, k) for c, q, k in terms])
    return out


def recovery(rows: list[dict[str, Any]], quality: str, threshold: float, calibration: str,
             min_penalty: float = _MIN_PENALTY) -> dict[Key, float]:
    """(trained B, decode B') -> the share of the mismatch penalty that ``calibration`` recovers, for
    off-diagonal cells that lose at least ``min_penalty`` against the native model (a ratio of two ~0
    numbers says nothing; a cell that beats the native model, e.g. the mix's, has nothing to recover)."""
    return {k: _value(num) / _value(den) for k, (num, den) in _recovery_cells(rows, quality, threshold, calibration,
                                                                               min_penalty).items()}


def _named(t: Any) -> bool:
    return not isinstance(t, int)


def summarize(rows: list[dict[str, Any]], quality: str, threshold: float) -> dict[str, Any]:
    """The numbers the report's answer states: mean off-diagonal penalty of the native models, each
    named model's (mix, curriculum) mean against the native models, and each calibration's mean
    recovery."""
    pen = penalty_matrix(rows, quality, threshold)
    off = [v for (t, d), v in pen.items() if t != d and not _named(t)]
    named = {n: [v for (t, d), v in pen.items() if t == n] for n in sorted({t for t, _ in pen if _named(t)}, key=_order)}
    cals = sorted({_cal(r) for r in rows if r["mode"] == "threshold"} - {"learned"})
    rec = {c: recovery(rows, quality, threshold, c) for c in cals}
    vs_native = {n: sum(v) / len(v) for n, v in named.items() if v}
    return {"quality": quality, "threshold": threshold, "cells": len(off),
            "mean_penalty": sum(off) / len(off) if off else float("nan"),
            "worst_penalty": min(off) if off else float("nan"),
            "mix_mean_vs_native": vs_native.get("mix", float("nan")), "named_mean_vs_native": vs_native,
            "recovery": {c: (sum(v.values()) / len(v) if v else float("nan")) for c, v in rec.items()},
            "recovery_cells": {c: len(v) for c, v in rec.items()}}


def native_by_threshold(rows: list[dict[str, Any]], quality: str) -> dict[tuple[Any, float], tuple[float, float]]:
    """(trained B, threshold) -> (quality, tokens per forward) of the model decoded at its own block size
    (learned calibration), means over seeds: the speed / quality trade-off each model offers where it
    was trained."""
    acc: dict[tuple[Any, float], list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        if r["mode"] == "threshold" and _cal(r) == "learned" and r["trained"] == int(r["block_size"]):
            acc[(r["trained"], float(r["threshold"]))].append((float(r[quality]), float(r["tokens_per_forward"])))
    return {k: (float(np.mean([q for q, _ in v])), float(np.mean([s for _, s in v]))) for k, v in acc.items()}


def ar_quality(rows: list[dict[str, Any]], quality: str) -> dict[Any, float]:
    """trained -> quality of AR greedy decoding (the ceiling block decoding is measured against), mean over seeds."""
    return {t: v for (t, _), v in _means(_Cells(rows, quality, ar=True)).items()}


# ---------------------------------------------------------------------------------------- markdown
def _label(t: Any) -> str:
    return str(t)


def _order(t: Any) -> tuple[int, int, str]:
    """Sort key of trained labels: native sizes ascending, then the mix, the curriculum, other names."""
    if isinstance(t, int):
        return (0, t, "")
    return (1, _NAMED.index(t) if t in _NAMED else len(_NAMED), str(t))


def _cell(iv: Interval | float, fmt: str, mark: bool = False) -> str:
    """``mean ±seeds (±prompts)``: the half-widths of the 95% intervals (`_LEGEND`); with `mark`, `*`
    where the intervals separate the number from 0 and `°` where only the prompt interval does."""
    if not isinstance(iv, Interval):
        return fmt.format(iv)
    half = fmt.replace("+", "")
    s = fmt.format(iv.mean)
    if iv.seeds is not None:
        s += " ±" + half.format((iv.seeds[1] - iv.seeds[0]) / 2)
    if iv.prompts is not None:
        s += " (±" + half.format((iv.prompts[1] - iv.prompts[0]) / 2) + ")"
    if mark:
        s += "\\*" if iv.separated else "°" if iv.prompts_only else ""
    return s


_LEGEND = ("Each number is the mean over the model's training seeds, ± the half-width of its 95% t-interval over "
           "seeds (absent with one seed), (± that of its 95% bootstrap interval over the eval prompts) where the "
           "per-prompt results were kept.")
_MARKS = ("\\* marks a difference the intervals separate from 0 (the seed interval, and the prompt interval where "
          "there is one, exclude 0); ° one only the prompt interval separates (one seed, or the seed interval "
          "holds 0).")


def _matrix_md(cells: dict[Key, Interval | float], fmt: str = "{:+.3f}", mark: bool = False) -> list[str]:
    trained = sorted({t for t, _ in cells}, key=_order)
    decoded = sorted({d for _, d in cells})
    lines = ["| trained \\ decoded | " + " | ".join(f"block {d}" for d in decoded) + " |",
             "|---|" + "---|" * len(decoded)]
    for t in trained:
        vals = [_cell(cells[(t, d)], fmt, mark) if (t, d) in cells else "" for d in decoded]
        lines.append(f"| {_label(t)} | " + " | ".join(vals) + " |")
    return lines


def _native_md(q: dict[tuple[Any, float], Interval], speed: dict[tuple[Any, float], float]) -> list[str]:
    trained = sorted({t for t, _ in q}, key=_order)
    thresholds = sorted({h for _, h in q})
    lines = ["| trained = decoded | " + " | ".join(f"threshold {h:g}" for h in thresholds) + " |",
             "|---|" + "---|" * len(thresholds)]
    for t in trained:
        vals = [f"{_cell(q[(t, h)], '{:.3f}')} @ {speed[(t, h)]:.2f}" if (t, h) in q else "" for h in thresholds]
        lines.append(f"| {t} | " + " | ".join(vals) + " |")
    return lines


def _heatmap(cells: dict[Key, float], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def _mean_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (trained, setting) with its numbers averaged over seeds (what the plots draw)."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["trained"], r["mode"], r["block_size"], r["threshold"], r.get("sub_block_size", 0), _cal(r))].append(r)
    out = []
    for rs in groups.values():
        m = {k: v for k, v in rs[0].items() if k != "per_prompt"}
        for k, v in m.items():
            if isinstance(v, float) and all(isinstance(r.get(k), (int, float)) for r in rs):
                m[k] = float(np.mean([r[k] for r in rs]))
            elif isinstance(v, list) and len(rs) > 1:
                try:
                    with warnings.catch_warnings():  # a position no token reached: nan in every seed
                        warnings.simplefilter("ignore", RuntimeWarning)
                        m[k] = np.nanmean(np.asarray([r[k] for r in rs], np.float64), axis=0).tolist()
                except (ValueError, KeyError, TypeError):  # ragged or absent: the first seed's
                    pass
        out.append(m)
    return out


_NAMES = {"mix": "the model trained on the mix of sizes", "curriculum": "the model trained on the block-size curriculum"}


def _name(t: Any) -> str:
    """The answer's words for a named model; ``<model>_c<C>``: that model trained with the block coreset C."""
    m = re.fullmatch(r"(.+)_c(\d+)", str(t))
    if m:
        base = _NAMES.get(m.group(1), f"the block-{m.group(1)} model")
        return f"{base} with the block coreset C = {m.group(2)}"
    return _NAMES.get(t, f"the {t} model")


def _span(iv: Interval, fmt: str) -> str:
    parts = [f"seeds {fmt.format(iv.seeds[0])} to {fmt.format(iv.seeds[1])}"] if iv.seeds else []
    parts += [f"prompts {fmt.format(iv.prompts[0])} to {fmt.format(iv.prompts[1])}"] if iv.prompts else []
    return f"{fmt.format(iv.mean)} (95%: {', '.join(parts)})" if parts else fmt.format(iv.mean)


def write_report(out: Path, rows: list[dict[str, Any]], *, quality: str, threshold: float, command: str,
                 title: str = "Block-size calibration study") -> Path:
    """``out``/calibration_study.md with its PNGs beside it (module docstring); returns the md path."""
    out.mkdir(parents=True, exist_ok=True)
    idx = _prompt_indices(rows)
    s = summarize(rows, quality, threshold)
    q = _Cells(rows, quality, threshold)
    pen_terms = _penalty_terms(q)
    pen = {k: (Interval(0.0) if k[0] == k[1] else _interval(terms, idx)) for k, terms in pen_terms.items()}
    qname = QUALITY_LABELS.get(quality, quality)
    heat = _heatmap({k: v.mean for k, v in pen.items()}, out / "penalty_matrix.png",
                    f"mismatch penalty: {qname}, threshold {threshold:g}")
    by_trained: dict[Any, list[dict]] = defaultdict(list)
    for r in _mean_rows(rows):
        by_trained[r["trained"]].append(r)
    plots = []
    for t, rs in sorted(by_trained.items(), key=lambda kv: _order(kv[0])):
        d = out / f"trained_{_label(t)}"
        d.mkdir(exist_ok=True)
        plots += [p.relative_to(out) for p in write_plots(d, rs, [], [], quality)]

    # the answer: the averages with their intervals, then which differences the intervals separate
    off = [terms for (t, d), terms in pen_terms.items() if t != d and not _named(t)]
    mean_pen = _interval([(c / len(off), qq, k) for terms in off for c, qq, k in terms], idx) if off else None
    named = sorted({t for t, _ in pen_terms if _named(t)}, key=_order)
    native = sorted({t for t, _ in q.keys() if not _named(t)})
    # each named model against the largest native size and against each other, at every decode size
    comparisons: dict[tuple[Any, Any], dict[int, Interval]] = {}
    pairs = [(n, native[-1]) for n in named if native] + [(b, a) for i, a in enumerate(named) for b in named[i + 1:]]
    for a, b in pairs:
        comparisons[(a, b)] = {d: _interval([(1.0, q, (a, d)), (-1.0, q, (b, d))], idx)
                               for d in sorted({d for _, d in q.keys()}) if (a, d) in q and (b, d) in q}
    answer = []
    if mean_pen is not None:
        answer.append(f"Decoding at a block size the model was not trained at changes {qname} by "
                      f"{_span(mean_pen, '{:+.3f}')} on average over {s['cells']} (trained, decoded) pairs at "
                      f"threshold {threshold:g} (worst {s['worst_penalty']:+.3f}).")
    for n in named:
        terms = [x for (t, d), ts in pen_terms.items() if t == n for x in ts]
        k = sum(1 for t, _ in pen_terms if t == n)
        answer.append(f"Against the native models, {_name(n)} is "
                      f"{_span(_interval([(c / k, qq, kk) for c, qq, kk in terms], idx), '{:+.3f}')} on average.")
    rec_line = "; ".join(f"{c}: {v:+.0%} of the penalty ({s['recovery_cells'][c]} cells)"
                         for c, v in s["recovery"].items()) or "no calibration other than the learned one was run"
    answer.append(f"Calibration recovers: {rec_line}.")
    diffs = {f"{t} vs native {d} at block {d}": iv for (t, d), iv in pen.items() if t != d}
    diffs.update({f"{a} - {b} at block {d}": iv for (a, b), ivs in comparisons.items() for d, iv in ivs.items()
                  if d != b})  # X - 32 at block 32 is the penalty cell (X, 32), already counted
    sep = [f"{k} ({iv.mean:+.3f})" for k, iv in diffs.items() if iv.separated]
    weak = [k for k, iv in diffs.items() if iv.prompts_only]
    if sep:
        answer.append(f"The intervals separate {len(sep)} of {len(diffs)} differences: " + "; ".join(sep) + ".")
    else:
        answer.append(f"The intervals separate none of the {len(diffs)} differences"
                      + (" (every model has one training seed: no interval over seeds)."
                         if all(iv.seeds is None for iv in diffs.values()) else "."))
    if weak:
        answer.append(f"Only the prompt interval separates {len(weak)} more (what another training seed may undo): "
                      + "; ".join(weak) + ".")

    lines = [f"# {title}", "", f"Regenerate: `{command}`", "", "## Answer", "", " ".join(answer), "",
             _LEGEND + " " + _MARKS, "",
             f"## Mismatch penalty ({qname}, threshold {threshold:g}, learned calibration)", "",
             *_matrix_md(pen, mark=True), "", f"![penalty matrix]({heat.name})", ""]
    if comparisons:
        decoded = sorted({d for ivs in comparisons.values() for d in ivs})
        lines += [f"## Comparisons ({qname}, threshold {threshold:g}, learned calibration, same decode block size)", "",
                  "| difference | " + " | ".join(f"block {d}" for d in decoded) + " |", "|---|" + "---|" * len(decoded)]
        lines += [f"| {a} - {b} | " + " | ".join(_cell(ivs[d], "{:+.3f}", True) if d in ivs else "" for d in decoded)
                  + " |" for (a, b), ivs in comparisons.items()] + [""]
    speed = _Cells(rows, "tokens_per_forward", threshold)
    lines += [f"## {qname} and tokens per forward (threshold {threshold:g}, learned calibration)", "",
              *_matrix_md({k: _interval([(1.0, q, k)], idx) for k in q.keys()}, "{:.3f}"), "",
              *_matrix_md({k: _interval([(1.0, speed, k)], idx) for k in speed.keys()}, "{:.2f}"), ""]
    ar = _Cells(rows, quality, ar=True)
    if ar.keys():
        lines += ["AR greedy decoding (one token per forward) of the same models: " + ", ".join(
            f"trained {_label(k[0])} {_cell(_interval([(1.0, ar, k)], idx), '{:.3f}')}"
            for k in sorted(ar.keys(), key=lambda k: _order(k[0]))) + ".", ""]
    own = native_by_threshold(rows, quality)
    if own:
        qs = {h: _Cells(rows, quality, h) for _, h in own}
        own_q = {(t, h): _interval([(1.0, qs[h], (t, t))], idx) for t, h in own}
        lines += [f"## Each model at its own block size: {qname} @ tokens per forward, by threshold", "",
                  *_native_md(own_q, {k: v[1] for k, v in own.items()}), ""]
    for c in s["recovery"]:
        cells = {k: _ratio_interval(num, den, idx)
                 for k, (num, den) in _recovery_cells(rows, quality, threshold, c, _MIN_PENALTY).items()}
        lines += [f"## Share of the penalty recovered by {c}", "", "(A ratio: its interval is over prompts only.)", "",
                  *_matrix_md(cells, "{:+.0%}"), ""]
    if any("history_share_mean" in r for r in rows if r["mode"] == "threshold"):
        share = _Cells([r for r in rows if isinstance(r.get("history_share_mean"), float)], "history_share_mean",
                       threshold)
        lines += [f"## History-unit softmax share (mean over GDN layers and canvas tokens, threshold {threshold:g}, "
                  "learned calibration)", "", *_matrix_md({k: _interval([(1.0, share, k)], None) for k in share.keys()},
                                                          "{:.3f}"), "",
                  "Per GDN layer vs block size: `trained_<B>/history_share.png`; vs the position inside the block: "
                  "`trained_<B>/history_position.png` (below).", ""]
    lines += ["## Plots per trained model", "", "Quality vs tokens per forward (one series per decode block size and "
              "calibration, points labelled by threshold, AR as a star; means over seeds), the history-unit share per "
              "layer vs block size and vs the position inside the block.", "", *[f"![{p}]({p})" for p in plots], ""]
    md = out / "calibration_study.md"
    md.write_text("\n".join(lines))
    return md
