"""`python launch.py data --config F [--batches N] [--show K] [k=v ...]`: inspect an SFT mix without
training (no weights read, nothing compiled).

The recipe's data exactly as `launch.py sft` builds it (`sft.recipe.open_data`: same sources,
tokenizer, `block_align`, packing), then N training batches drawn from the packed iterator. Printed:

- per source: records read / kept / bad (load time) / filtered, the train/eval split, documents drawn,
  render failures, packed tokens and loss (trained) tokens, overlong documents split / dropped and
  hard cuts, and the share of the documents drawn next to the configured weight's share;
- the first bad record (load time) and the first render failure of each source, as ``file:line: reason``;
- totals: rows, padding fraction and pieces (documents or split parts) per row at ``seq_len``;
- the CE chunks holding loss tokens: the share of each chip's CE chunks (``loss.chunk_tokens``
  positions of the noisy rows) that hold a masked token, at the drawn loss-token share, for
  `launch.py compile --ce-share` (`ce_chunk_share`);
- ``--show K``: the first K packed rows as text, segment by segment (source, ``file:line``), with the
  loss-masked (trained) spans highlighted: rich markup on a terminal, ``⟦...⟧`` markers in a file.

Errors are the pipeline's: a missing file names the source and path, a bad record ``file:line``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from sft.config import SFTConfig, check_data_root, model_config_from
from sft.data import SFTData
from sft.data.packing import Piece

__all__ = ["MixReport", "TRAIN_OPEN", "TRAIN_CLOSE", "draw_report", "open_mix", "render_samples", "run_data"]

#: plain-text markers around trained (loss-masked) spans, when the output is not a terminal
TRAIN_OPEN, TRAIN_CLOSE = "⟦", "⟧"


@dataclass
class MixReport:
    """What `draw_report` measured: `stats` = the iterator's `stats()` after the batches; `rows` =
    rows drawn; `pieces_per_row` / `pad_fraction` over the non-empty rows; `samples` = the first
    rows as pieces (for `--show`)."""

    stats: dict[str, Any]
    weights: dict[str, float]
    seq_len: int
    batches: int
    rows: int
    pieces_per_row: float
    pad_fraction: float
    seconds: float
    loss_fraction: float = 0.0  # loss (trained) tokens per token of the drawn rows
    samples: list[list[Piece]] = field(default_factory=list)


def open_mix(cfg: SFTConfig) -> SFTData:
    """The recipe's SFTData without reading weights or writing an init checkpoint: the tokenizer and
    architecture come from `model.init_from` when it exists here, else the built-in Qwen3.6 tokenizer
    and the preset / overrides."""
    from sft.recipe import data_source, open_data

    check_data_root(cfg)
    init = Path(cfg.model.init_from) if cfg.model.init_from else None
    ck_cfg = tok_dir = None
    if init is not None and init.exists():
        _, _, ck_cfg, tok_dir = data_source(cfg)
    return open_data(cfg, model_config_from(cfg.model, ck_cfg), tok_dir)


def draw_report(data: SFTData, batches: int, show: int = 0) -> MixReport:
    """Draw `batches` training batches (host 0 of 1) and measure them (see MixReport)."""
    t0 = time.perf_counter()
    it = data.train_iterator()
    samples: list[list[Piece]] = []
    rows = pieces = pad = loss = 0
    for _ in range(batches):
        batch = next(it)
        seg = batch["segment_ids"]
        used = seg.max(axis=1) > 0  # empty rows only complete a finite eval batch; none here
        rows += int(used.sum())
        pieces += int(seg.max(axis=1)[used].sum())
        pad += int((seg[used] == 0).sum())
        loss += int(np.asarray(batch["loss_mask"])[used].sum())
        samples += it.last_rows[: max(0, show - len(samples))]
    cells = max(1, rows * data.cfg.seq_len)
    return MixReport(stats=it.stats(), weights={s.config.name: s.config.weight for s in data.sources},
                     seq_len=data.cfg.seq_len, batches=batches, rows=rows, pieces_per_row=pieces / max(1, rows), pad_fraction=pad / cells,
                     seconds=time.perf_counter() - t0, samples=samples, loss_fraction=loss / cells)


_COLUMNS = ("source", "weight %", "drawn %", "tokens %", "read", "kept", "bad", "filtered", "train/eval", "docs", "render bad",
            "tokens", "loss tok", "split", "dropped", "cuts")


def table_rows(rep: MixReport) -> list[tuple[str, ...]]:
    """One tuple of cells per source (in `_COLUMNS` order), then a totals row."""
    src = rep.stats["sources"]
    wsum = sum(rep.weights.values())
    docs = sum(s["docs"] + s["render_bad"] for s in src.values()) or 1
    tokens = sum(s["tokens"] for s in src.values()) or 1
    out = []
    for name, s in src.items():
        drawn = s["docs"] + s["render_bad"]
        out.append((name, f"{100 * rep.weights[name] / wsum:.1f}", f"{100 * drawn / docs:.1f}",
                    f"{100 * s['tokens'] / tokens:.1f}", str(s["read"]),
                    str(s["kept"]), str(s["bad"]), str(s["filtered"]), f"{s['train']}/{s['eval']}", str(s["docs"]),
                    str(s["render_bad"]), str(s["tokens"]), str(s["loss_tokens"]), str(s["overlong_split"]),
                    str(s["overlong_dropped"] + s["dropped_no_loss"]), str(s["hard_cuts"])))
    first = _COLUMNS.index("read")
    tot = [str(sum(int(r[i].split("/")[0]) for r in out)) for i in range(first, len(_COLUMNS))]
    tot[_COLUMNS.index("train/eval") - first] = (f"{sum(s['train'] for s in src.values())}/"
                                                 f"{sum(s['eval'] for s in src.values())}")
    out.append(("total", "100.0", "100.0", "100.0", *tot))
    return out


def print_report(rep: MixReport, out: TextIO, terminal: bool) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out, highlight=False, soft_wrap=False, width=None if terminal else 200,
                      force_terminal=terminal, no_color=not terminal)
    t = Table(box=box.SIMPLE_HEAVY if terminal else box.ASCII, title=None)
    for i, c in enumerate(_COLUMNS):
        t.add_column(c, justify="left" if i == 0 else "right", no_wrap=True)
    rows = table_rows(rep)
    for i, r in enumerate(rows):
        t.add_row(*r, end_section=i == len(rows) - 2)
    console.print(t)
    for name, s in rep.stats["sources"].items():
        if s.get("first_bad"):
            console.print(f"{name}: first bad record: {s['first_bad']}", markup=False)
        if s.get("first_render_bad"):
            console.print(f"{name}: first render failure: {s['first_render_bad']}", markup=False)
    out.write(f"{rep.batches} batch(es), {rep.rows} rows x {rep.seq_len} tokens: padding {100 * rep.pad_fraction:.1f}%, "
              f"{rep.pieces_per_row:.2f} pieces per row; drawn in {rep.seconds:.1f} s\n"
              "drawn % / tokens %: shares of the documents / packed tokens drawn; split: overlong documents cut at "
              "message boundaries; dropped: overlong (overlong=drop) or loss-free pieces; cuts: messages cut at seq_len\n")


def render_samples(rep: MixReport, tok: Any, names: list[str], markup: bool) -> str:
    """The sample rows as text: a header per segment, trained spans in rich markup (bold green) or
    between TRAIN_OPEN / TRAIN_CLOSE."""
    from rich.markup import escape

    lines = []
    for r, row in enumerate(rep.samples):
        for k, p in enumerate(row, start=1):
            head = (f"--- row {r} segment {k}: source {names[p.source]}, {p.loc or '?'} (piece {p.ref[1]}), "
                    f"{len(p)} tokens, {int(p.mask.sum())} trained ---")
            lines.append(f"[bold cyan]{escape(head)}[/]" if markup else head)
            text = []
            edges = np.flatnonzero(np.diff(p.mask.astype(np.int8))) + 1
            for a, b in zip(np.r_[0, edges], np.r_[edges, len(p)]):
                s = tok.decode(p.ids[a:b].tolist(), skip_special_tokens=False)
                if markup:
                    text.append(f"[bold green]{escape(s)}[/]" if p.mask[a] else escape(s))
                else:
                    text.append(f"{TRAIN_OPEN}{s}{TRAIN_CLOSE}" if p.mask[a] else s)
            lines.append("".join(text))
    return "\n".join(lines)


def ce_chunk_share(cfg: SFTConfig, loss_fraction: float, chips: int) -> tuple[float, int, int, float]:
    """(share of a chip's CE chunks holding a loss token, CE positions per chip per micro-batch, chunks
    per chip per micro-batch, masked share of the CE positions) for the noisy stream's CE
    (`sft.loss.weighted_ce` under a mesh: each chip sweeps its own positions in chunks of
    `loss.chunk_tokens`, loss tokens first, and skips the chunks without one). A loss token is
    masked at the mean noise level (1/2 per copy with complementary masking). An estimate from the
    mean: a chip whose rows mask more than the mean runs one chunk more."""
    n = cfg.data.batch_size // cfg.train.micro_batches * cfg.noise.copies * cfg.data.seq_len // max(chips, 1)
    level = 0.5 if cfg.noise.complementary else (cfg.noise.t_min + cfg.noise.t_max) / 2
    c = max(1, min(cfg.loss.chunk_tokens, n))
    chunks = -(-n // c)
    masked = level * loss_fraction
    return min(chunks, -(-int(np.ceil(masked * n)) // c)) / max(chunks, 1), n, chunks, masked


def run_data(cfg: SFTConfig, batches: int, show: int, out: TextIO | None = None, chips: int = 32) -> int:
    """`launch.py data`: open, draw, print (module docstring) to `out` (default: sys.stdout)."""
    from rich.console import Console

    out = out or sys.stdout
    t0 = time.perf_counter()
    data = open_mix(cfg)
    opened = time.perf_counter() - t0
    rep = draw_report(data, batches, show)
    terminal = out.isatty()
    print(f"{cfg.data.seq_len}-token rows, block_align {data.cfg.block_align}, batch {cfg.data.batch_size} rows; "
          f"{len(data.sources)} sources opened in {opened:.1f} s", file=out)
    print_report(rep, out, terminal)
    share, n, chunks, masked = ce_chunk_share(cfg, rep.loss_fraction, chips)
    print(f"loss tokens: {rep.loss_fraction:.1%} of the rows' tokens, masked: {masked:.1%} of the noisy stream's "
          f"CE positions; on {chips} chips each sweeps {n} positions per micro-batch in {chunks} chunks of "
          f"{min(cfg.loss.chunk_tokens, n)}: about {share:.3f} of them hold loss tokens "
          f"(launch.py compile --ce-share {share:.3f})" +
          ("; the clean stream's AR CE (loss.ar_loss_weight) is not in it" if cfg.loss.ar_loss_weight > 0 else ""),
          file=out)
    if show:
        text = render_samples(rep, data.tokenizer, data.names, markup=terminal)
        if terminal:
            Console(file=out, highlight=False).print(text)
        else:
            print(f"trained (loss-masked) spans are between {TRAIN_OPEN} and {TRAIN_CLOSE}", file=out)
            print(text, file=out)
    return 0
