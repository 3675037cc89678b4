"""Run logging: `metrics.jsonl`, a console table, a progress bar, wandb (offline by default).

The step's metrics stay on the device until a log step, so logging never stalls the dispatch
queue more than once per `log_every` steps. A logged record holds the means over the steps since
the previous record (scalars) plus throughput over the same wall-clock window:

    {"step", "loss", "tokens_per_s", "steps_per_s", "elapsed_s", "eta_s", "lr", "grad_norm",
     <every other scalar metric>, "mfu" (with flops_per_step and peak_flops),
     <array metrics as lists>, "<name>.max_min_ratio", "<name>.frac_zero" (array metrics),
     "eval/<metric>" (on eval steps; a namespaced eval metric, e.g. "decode/<metric>", as is)}

Array metrics (per-expert loads [L, E]) are summarised per layer over the last axis: the worst
layer's max/min ratio (min clamped to 1, so an empty expert gives the max load) and the fraction
of zero entries; the console and wandb get only the summaries. Only process 0 writes anything.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Mapping, TextIO

import jax
import numpy as np

from train.config import LoggingConfig

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id.txt"
_HEADER_EVERY = 20


def array_summary(name: str, value: np.ndarray) -> dict[str, float]:
    """Load-balance summary of a count array [..., E]: worst max/min ratio over rows, zero fraction."""
    v = np.asarray(value, np.float64).reshape(-1, np.shape(value)[-1]) if np.ndim(value) else np.asarray([[value]])
    ratio = float(np.max(v.max(axis=1) / np.maximum(v.min(axis=1), 1.0)))
    return {f"{name}.max_min_ratio": ratio, f"{name}.frac_zero": float(np.mean(v == 0))}


def _step_of(line: str) -> int | None:
    """Step of a metrics.jsonl line; None for a blank or torn line (a process killed mid-write)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _fmt_duration(s: float | None) -> str:
    if s is None or not np.isfinite(s):
        return "-"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def _accuracy_key(record: Mapping[str, Any]) -> str | None:
    for k in record:
        if "acc" in k and not k.startswith(("eval/", "decode/")) and isinstance(record[k], float):
            return k
    return None


def resolve_wandb_mode(mode: str | None) -> str:
    """Config value, else `WANDB_MODE`, else offline. Unknown env values are an error."""
    mode = mode or os.environ.get("WANDB_MODE") or "offline"
    mode = {"dryrun": "offline", "run": "online"}.get(mode, mode)
    if mode not in ("offline", "online", "disabled"):
        raise ValueError(f"wandb mode must be offline|online|disabled, got {mode!r} (WANDB_MODE or logging.wandb.mode)")
    return mode


class MetricsLogger:
    """Collects device metrics per step and writes a record every `log_every` steps (or on demand).

    `flops_per_step` (model FLOPs of one optimizer step) and `peak_flops` (peak FLOP/s of all
    devices together) enable the MFU column.
    """

    def __init__(
        self, cfg: LoggingConfig, *, total_steps: int, log_every: int = 1, run_config: Mapping[str, Any] | None = None,
        flops_per_step: float | None = None, peak_flops: float | None = None, stream: TextIO | None = None,
        is_main: bool | None = None,
    ):
        self.cfg = cfg
        self.total_steps = total_steps
        self.log_every = log_every
        self.run_config = dict(run_config or {})
        self.flops_per_step, self.peak_flops = flops_per_step, peak_flops
        self.stream = stream
        self.is_main = jax.process_index() == 0 if is_main is None else is_main
        self.run_dir = Path(cfg.run_dir)
        self._window: list[tuple[dict[str, Any], Any, bool]] = []  # (metrics, tokens, timed)
        self._jsonl: TextIO | None = None
        self._wandb: Any = None
        self._bar: Any = None
        self._rows = 0
        self._started = False

    # ------------------------------------------------------------------------------------------ setup
    def start(self, start_step: int) -> None:
        """Opens the outputs. On a resume, records after `start_step` (from steps that are about to be
        re-run) are dropped from `metrics.jsonl`, so the file stays one record per step."""
        self._start_step = self._last_step = start_step
        self._t_window = self._t_start = time.perf_counter()
        self._first_step_s: float | None = None
        self._started = True
        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / METRICS_FILE
        if path.exists():
            kept = [ln for ln in path.read_text().splitlines() if _step_of(ln) is not None and _step_of(ln) <= start_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(ln + "\n" for ln in kept))
            os.replace(tmp, path)
        self._jsonl = path.open("a")
        self._start_wandb()
        if self.cfg.progress == "on" or (self.cfg.progress == "auto" and sys.stderr.isatty()):
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, initial=start_step, unit="step", file=sys.stderr,
                             dynamic_ncols=True, desc="train")

    def _start_wandb(self) -> None:
        mode = resolve_wandb_mode(self.cfg.wandb.mode)
        if mode == "disabled":
            return
        import wandb

        id_file = self.run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id)
        w = self.cfg.wandb
        self._wandb = wandb.init(project=w.project, entity=w.entity, name=w.name, dir=str(self.run_dir),
                                 mode=mode, config=self.run_config, id=run_id, resume="allow")

    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stdout

    def message(self, text: str) -> None:
        """A line on the console (above the progress bar)."""
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.write(text, file=self._out())
        else:
            print(text, file=self._out(), flush=True)

    # ------------------------------------------------------------------------------------------ records
    def record(self, step: int, metrics: Mapping[str, Any], tokens: int | Any, *,
               eval_metrics: Mapping[str, Any] | None = None, force: bool = False) -> dict[str, Any] | None:
        """Adds one step's (device) metrics; writes a record when `step` is a log step, on `force`,
        or when eval metrics come with it. Returns the record written, if any."""
        if not self._started:
            raise RuntimeError("MetricsLogger.start() must be called before record()")
        timed = True
        if self._first_step_s is None:
            # the first step of a process includes compilation: keep it out of the throughput
            jax.block_until_ready(metrics)
            now = time.perf_counter()
            self._first_step_s, self._t_window, timed = now - self._t_window, now, False
        self._window.append((dict(metrics), tokens, timed))
        if self._bar is not None:
            self._bar.update(step - self._last_step)
        self._last_step = step
        if force or eval_metrics is not None or step % self.log_every == 0 or step == self.total_steps:
            return self.flush(step, eval_metrics)
        return None

    def flush(self, step: int, eval_metrics: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        if not self._window:
            return None
        window = jax.device_get([(m, t) for m, t, _ in self._window])
        timed = [t for (_, t), (_, _, is_timed) in zip(window, self._window) if is_timed]
        now = time.perf_counter()
        dt = now - self._t_window
        if not timed:  # only the first step: its time (compilation included) is all there is
            timed, dt = [t for _, t in window], self._first_step_s or dt
        self._t_window = now
        self._window = []
        n_timed = len(timed)
        tokens = float(sum(float(np.sum(t)) for t in timed))

        rec: dict[str, Any] = {"step": int(step)}
        keys = list(dict.fromkeys(k for m, _ in window for k in m))
        for k in keys:
            vals = [np.asarray(m[k]) for m, _ in window if k in m]
            mean = np.mean(np.stack(vals).astype(np.float64), axis=0)
            if mean.ndim == 0:
                rec[k] = float(mean)
            else:
                rec[k] = mean.tolist()
                rec.update(array_summary(k, mean))
        rec["tokens_per_s"] = tokens / dt if dt > 0 else 0.0
        rec["steps_per_s"] = n_timed / dt if dt > 0 else 0.0
        rec["elapsed_s"] = now - self._t_start
        left = self.total_steps - step
        rec["eta_s"] = left / rec["steps_per_s"] if rec["steps_per_s"] > 0 else None
        if self.flops_per_step and self.peak_flops:
            rec["mfu"] = self.flops_per_step * rec["steps_per_s"] / self.peak_flops
        for k, v in (eval_metrics or {}).items():
            v = np.asarray(v)
            # a namespaced name (``decode/validity``) is logged as is, the others as ``eval/<name>``
            rec[k if "/" in k else f"eval/{k}"] = float(v) if v.ndim == 0 else v.tolist()
        self._write(rec)
        return rec

    def _write(self, rec: dict[str, Any]) -> None:
        if not self.is_main:
            return
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(rec) + "\n")
        self._jsonl.flush()
        scalars = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"}
        if self._wandb is not None:
            self._wandb.log(scalars, step=rec["step"])
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{rec.get('loss', float('nan')):.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        if self.cfg.console_every and (self._rows % self.cfg.console_every == 0 or "eval/loss" in rec):
            self._console_row(rec)
        self._rows += 1

    def _console_row(self, rec: dict[str, Any]) -> None:
        acc = _accuracy_key(rec)
        cols = [("step", f"{rec['step']}/{self.total_steps}", 13), ("loss", f"{rec.get('loss', float('nan')):.4f}", 9)]
        if acc:
            cols.append((acc[:10], f"{rec[acc]:.4f}", 10))
        if "lr" in rec:
            cols.append(("lr", f"{rec['lr']:.3e}", 10))
        if "grad_norm" in rec:
            cols.append(("grad_norm", f"{rec['grad_norm']:.3f}", 10))
        cols.append(("tok/s", f"{rec['tokens_per_s']:.1f}", 11))
        if "mfu" in rec:
            cols.append(("mfu", f"{100 * rec['mfu']:.1f}%", 7))
        cols.append(("eta", _fmt_duration(rec["eta_s"]), 9))
        extras = [f"{k}={rec[k]:.4g}" for k in rec if k.startswith(("eval/", "decode/")) and isinstance(rec[k], float)]
        for k in rec:
            if k.endswith(".max_min_ratio"):
                base = k[: -len(".max_min_ratio")]
                extras.append(f"{base}: max/min={rec[k]:.2f} empty={100 * rec[base + '.frac_zero']:.1f}%")
        if self._rows % (_HEADER_EVERY * max(self.cfg.console_every, 1)) == 0:
            self.message(" | ".join(name.rjust(w) for name, _, w in cols))
        self.message(" | ".join(val.rjust(w) for _, val, w in cols) + ("  " + "  ".join(extras) if extras else ""))

    # ------------------------------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


__all__ = ["METRICS_FILE", "MetricsLogger", "array_summary", "resolve_wandb_mode"]
