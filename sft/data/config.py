"""Frozen configs of the SFT data pipeline (YAML section ``data``, built with
``clover_jax.yaml_config.from_tree``).

Example::

    data:
      seq_len: 4096
      block_align: 32            # lcm of the model's block sizes (the recipe passes it)
      batch_size: 16
      eval_fraction: 0.02
      sources:
        - {name: tau, format: tau_bench, path: /data/tau/*.jsonl, weight: 2.0}
        - {name: bfcl, format: bfcl, path: /data/bfcl/BFCL_v4_simple_python.json}
        - {name: synth, format: synthetic, options: {n_records: 5000, seed: 1}}
        - {name: task, format: tool_task, path: /data/bfcl/BFCL_v4_simple_python.json,
           options: {n_records: 4000, seed: 0, split: train}}   # sft.data.tool_task
        - {name: mine, format: chat, hf: {path: json, data_files: /data/mine.jsonl}}

Invariants checked here (``ConfigError`` naming the source and key): unique source names, exactly
one of ``path`` / ``hf`` (none for ``synthetic``), ``weight > 0``, known converter options,
``seq_len`` a positive multiple of ``block_align``, fractions in range. File existence and
emptiness are checked when the sources are opened (``sft.data.sources.load_source``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from clover_jax.yaml_config import ConfigError

__all__ = ["FORMATS", "DataConfig", "FilterConfig", "SourceConfig", "block_align_for"]

FORMATS = ("chat", "bfcl", "tau_bench", "when2call", "toolbench", "swe_agent", "hermes", "synthetic",
           "tool_task")
Format = Literal["chat", "bfcl", "tau_bench", "when2call", "toolbench", "swe_agent", "hermes",
                 "synthetic", "tool_task"]


def block_align_for(block_size: int | tuple[int, ...]) -> int:
    """The packing alignment for a model's ``block_size`` (an int or the list drawn from in
    multi-block-size training): their lcm, so every document starts on every block grid."""
    sizes = (block_size,) if isinstance(block_size, int) else tuple(block_size)
    if not sizes or any(b < 1 for b in sizes):
        raise ConfigError(f"block_size: expected positive sizes, got {block_size!r}")
    return math.lcm(*sizes)


@dataclass(frozen=True)
class FilterConfig:
    """Declarative record filter, applied after conversion. A "turn" is one assistant message.

    - ``min_turns`` / ``max_turns``: bounds on the number of assistant messages.
    - ``require_tool_calls``: keep only records with at least one assistant tool call.
    - ``content_regex``: keep only records where some message content (or tool-call arguments,
      as JSON) matches this Python regex (``re.search``).
    """

    min_turns: int = 0
    max_turns: int | None = None
    require_tool_calls: bool = False
    content_regex: str | None = None

    def check(self, where: str) -> None:
        if self.min_turns < 0:
            raise ConfigError(f"{where}.min_turns: must be >= 0, got {self.min_turns}")
        if self.max_turns is not None and self.max_turns < max(self.min_turns, 1):
            raise ConfigError(f"{where}.max_turns: must be >= max(min_turns, 1), got "
                              f"{self.max_turns}")
        if self.content_regex is not None:
            try:
                re.compile(self.content_regex)
            except re.error as e:
                raise ConfigError(f"{where}.content_regex: invalid regex "
                                  f"{self.content_regex!r}: {e}") from None


@dataclass(frozen=True)
class SourceConfig:
    """One data source of the mix.

    ``path`` is a local file or glob (``**`` recurses): ``.jsonl``, ``.json`` (a JSON array, one
    object, or JSON Lines as BFCL ships them), ``.traj`` (one object) or ``.parquet``. ``hf`` is a
    ``datasets.load_dataset`` keyword dict that must resolve offline, e.g. ``{"path": "json",
    "data_files": "x.jsonl"}`` (``split`` defaults to ``train``). ``options`` are converter
    specific (see ``sft.data.converters.OPTIONS``), e.g. ``{n_records, seed}`` for ``synthetic``.
    ``max_records`` caps the records kept (in file order, after conversion and filtering).
    """

    name: str
    format: Format = "chat"
    path: str | None = None
    hf: dict[str, Any] | None = None
    weight: float = 1.0
    filter: FilterConfig = field(default_factory=FilterConfig)
    max_records: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"source {self.name!r}"
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"source name must be a non-empty string, got {self.name!r}")
        if self.format not in FORMATS:
            raise ConfigError(f"{where}: format: expected one of {', '.join(FORMATS)}, got "
                              f"{self.format!r}")
        if not self.weight > 0:
            raise ConfigError(f"{where}: weight: must be > 0, got {self.weight}")
        if self.format == "synthetic":
            if self.path is not None or self.hf is not None:
                raise ConfigError(f"{where}: path/hf: a synthetic source generates its records; "
                                  "set options.n_records / options.seed instead")
        elif self.format == "tool_task" and (self.path is None or self.hf is not None):
            raise ConfigError(f"{where}: path: a tool_task source generates its records from the BFCL "
                              "schema file at 'path' (e.g. bfcl/BFCL_v4_simple_python.json); set path, not hf")
        elif (self.path is None) == (self.hf is None):
            raise ConfigError(f"{where}: path/hf: give exactly one of 'path' (file or glob) or "
                              "'hf' (a datasets.load_dataset spec)")
        if self.hf is not None and "path" not in self.hf:
            raise ConfigError(f"{where}: hf.path: missing (the datasets builder or directory, "
                              "e.g. 'json')")
        if self.max_records is not None and self.max_records < 1:
            raise ConfigError(f"{where}: max_records: must be >= 1, got {self.max_records}")
        self.filter.check(f"{where}: filter")
        from sft.data.converters import check_options  # lazy: converters never import config
        check_options(self.format, self.options, where)


@dataclass(frozen=True)
class DataConfig:
    """The SFT data pipeline: mix, render, pack, batch.

    - ``seq_len``: row length; a positive multiple of ``block_align``.
    - ``block_align``: every packed document starts at a multiple of it (docs/design.md 3.1; the lcm
      of the model's block sizes).
    - ``overlong``: a document longer than ``seq_len`` is split at message boundaries
      (``split_turns``) or dropped (``drop``); both counted.
    - ``max_bad_fraction`` / ``on_bad``: bad records are skipped and counted (``skip``; the load
      fails when a source's bad fraction exceeds ``max_bad_fraction``, naming the first bad line)
      or fail at once (``fail``). Render-time failures (a record the chat template refuses, a
      missing template dependency) count too, over a sliding window of each source's last
      ``bad_window`` documents: more than ``max_bad_fraction * bad_window`` failures in it stops
      the iterator with a ``DataError`` naming the source, its first failing record and the cause.
    - ``bad_window``: that window; also, a source whose last ``bad_window`` documents gave no
      trainable piece (all failed, overlong-dropped or without loss tokens) stops the iterator, so
      it can never spin forever without forming a batch.
    - ``eval_fraction``: share of each source held out for eval, chosen by a hash of the record
      content (deterministic, independent of order and seed).
    - ``align_responses``: ``block`` pads (no loss) before every assistant response so that it
      starts on the block grid (a multiple of ``block_align``); the trained model records it and the
      decoder pads prompts the same way. ``none`` (default): responses start where the prompt ends.
    - ``think``: keep or drop assistant ``reasoning_content``.
    - ``pack``: first-fit packing of several documents per row (``false``: one per row).
    - ``pack_open_rows``: rows the first-fit packer keeps open (more = less padding).
    - ``tokenizer``: a checkpoint dir with ``tokenizer.json``; None = the built-in Qwen3.6 one.
    """

    sources: tuple[SourceConfig, ...] = ()
    seq_len: int = 2048
    block_align: int = 32
    overlong: Literal["split_turns", "drop"] = "split_turns"
    max_bad_fraction: float = 0.01
    on_bad: Literal["skip", "fail"] = "skip"
    bad_window: int = 1000
    eval_fraction: float = 0.0
    seed: int = 0
    shuffle: bool = True
    batch_size: int = 8
    think: Literal["keep", "drop"] = "keep"
    align_responses: Literal["none", "block"] = "none"
    pack: bool = True
    pack_open_rows: int = 8
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(self.sources))
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"sources: duplicate source name(s) {dup}")
        if self.block_align < 1:
            raise ConfigError(f"block_align: must be >= 1, got {self.block_align}")
        if self.seq_len < 1 or self.seq_len % self.block_align:
            raise ConfigError(f"seq_len: must be a positive multiple of block_align "
                              f"({self.block_align}), got {self.seq_len}")
        if self.align_responses not in ("none", "block"):
            raise ConfigError(f"align_responses: expected 'none' or 'block', got {self.align_responses!r}")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ConfigError(f"max_bad_fraction: must be in [0, 1], got {self.max_bad_fraction}")
        if self.bad_window < 1:
            raise ConfigError(f"bad_window: must be >= 1, got {self.bad_window}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"eval_fraction: must be in [0, 1), got {self.eval_fraction}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size: must be >= 1, got {self.batch_size}")
        if self.pack_open_rows < 1:
            raise ConfigError(f"pack_open_rows: must be >= 1, got {self.pack_open_rows}")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed: must be in [0, 2**32), got {self.seed}")
