"""The SFT input pipeline: sources -> Grain mix/shuffle -> render -> block-aligned packing -> batches.

``SFTData(cfg, tokenizer)`` opens every source (converted, validated, split; see
``sft.data.sources``) and builds, with Grain ``MapDataset``s:

- train: per source ``source(records).shuffle(seed_s).repeat()`` (a new permutation every epoch,
  ``seed_s`` derived from ``(cfg.seed, source name)``, so adding a source does not reorder the
  others), then ``MapDataset.mix(..., weights)`` (Grain's deterministic weighted interleave: the
  proportions hold exactly over every window of ``sum(weights)`` records, up to Grain's integer
  rounding of the weights), then ``map(render)``: an infinite, randomly indexable stream of
  rendered documents;
- eval: the held-out records of all sources, in source then file order, rendered; finite.

``train_iterator()`` / ``eval_iterator()`` return a ``PackedBatchIterator``: it walks that
stream by index (``shard_index + k * shard_count`` for host ``shard_index``), splits overlong
documents, packs pieces into block-aligned rows (``sft.data.packing``) and yields dicts of numpy
arrays ``input_ids`` int32, ``segment_ids`` int32, ``positions`` int32, ``loss_mask`` bool, each
[batch_size // shard_count, seq_len]. The final eval batch is completed with empty rows
(all padding, ``segment_ids`` 0) so shapes stay static.

No silent spinning: documents that fail to render are counted per source over a sliding window
of ``data.bad_window`` documents and stop the iterator (``DataError`` naming the source, its first
failing record and the cause) once more than ``max_bad_fraction`` of a window failed; a source
whose last ``bad_window`` documents gave no trainable piece stops it too (``_SourceHealth``). The
first ``MAX_BAD_SHOWN`` render failures of each source are logged (warning, ``file:line: reason``);
later ones are only counted.

Iterator state (``get_state()`` / ``set_state()``, JSON-serialisable, also usable through Grain's
Orbax checkpoint handler) = the next document counter, the open and ready rows as piece
references, and the counters; restoring re-renders the referenced documents, so the next batches
are identical to an uninterrupted run.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import logging
from typing import Any

import grain
import numpy as np

from clover_jax.bridge.tokenizer import ENDOFTEXT
from clover_jax.yaml_config import ConfigError
from sft.data.config import DataConfig
from sft.data.packing import BlockPacker, Piece, assemble_row, empty_row, split_doc
from sft.data.records import DataError
from sft.data.render import ChatRenderer, Doc
from sft.data.sources import MAX_BAD_SHOWN, LoadedSource, load_source

__all__ = ["PackedBatchIterator", "SFTData", "source_seed"]

log = logging.getLogger(__name__)

_COUNTERS = ("docs", "render_bad", "overlong_split", "overlong_dropped", "hard_cuts",
             "dropped_no_loss", "pieces", "tokens", "loss_tokens", "response_pads")


def source_seed(seed: int, name: str) -> int:
    """A 32-bit shuffle seed for one source (Grain's index_shuffle takes 32 bits)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "big")


class _Render:
    """MapDataset fn: (record, loc, source) -> Doc, or the DataError the renderer raised (so the
    iterator can count and skip it instead of Grain seeing an exception)."""

    def __init__(self, renderer: ChatRenderer):
        self.renderer = renderer

    def __call__(self, item: tuple[dict, str, int]) -> Doc | DataError:
        record, loc, source = item
        try:
            return self.renderer(record, source=source, loc=loc)
        except DataError as e:
            e.source = source  # so the iterator charges the right source
            return e


class _SourceHealth:
    """Per-source guard against an iterator that pulls documents forever without forming a batch.

    ``window``: the last ``bad_window`` render outcomes (True = failed) and their failure count;
    more than ``max_bad_fraction * bad_window`` failures in it raise. ``dry``: documents since the
    source last gave a trainable piece (failed, overlong-dropped or loss-free ones all count);
    ``bad_window`` of them in a row raise. Not part of the iterator state: after a restore the
    window starts empty (it only decides when to give up, never what a batch holds)."""

    def __init__(self, name: str, cfg: DataConfig):
        self.name, self.cfg = name, cfg
        self.window: collections.deque[bool] = collections.deque(maxlen=cfg.bad_window)
        self.window_bad = 0
        self.dry = 0
        self.dry_first = ""  # location of the first document of the current dry run
        self.first_bad: DataError | None = None

    def record(self, failed: DataError | None, pieces: int, loc: str) -> None:
        w = self.window
        if len(w) == w.maxlen:
            self.window_bad -= w[0]
        w.append(failed is not None)
        self.window_bad += failed is not None
        if failed is not None:
            self.first_bad = self.first_bad or failed
            allowed = self.cfg.max_bad_fraction * self.cfg.bad_window
            if self.window_bad > allowed:
                raise DataError(None, f"source {self.name!r}: {self.window_bad} of its last {len(w)} documents "
                                      f"failed to render (more than max_bad_fraction "
                                      f"{self.cfg.max_bad_fraction:.2%} of a {self.cfg.bad_window}-document "
                                      f"window); first failing record: {self.first_bad}")
        if pieces:
            self.dry = 0
            return
        self.dry_first = self.dry_first if self.dry else loc
        self.dry += 1
        if self.dry >= self.cfg.bad_window:
            why = f"; first failing record: {self.first_bad}" if self.first_bad is not None else ""
            raise DataError(None, f"source {self.name!r}: its last {self.dry} documents (from {self.dry_first}) "
                                  f"gave no trainable piece: each failed to render, was longer than seq_len "
                                  f"{self.cfg.seq_len} with overlong={self.cfg.overlong!r}, or had no loss "
                                  f"token{why}")


class PackedBatchIterator(grain.DatasetIterator):
    """Packs the documents of ``docs`` (a MapDataset of ``Doc | DataError``) into batches; see the
    module docstring. ``finite``: stop (after flushing) at ``len(docs)``."""

    def __init__(self, docs: grain.MapDataset, cfg: DataConfig, *, pad_id: int,
                 source_names: list[str], finite: bool, shard_index: int = 0,
                 shard_count: int = 1, load_stats: dict | None = None):
        super().__init__()
        if shard_count < 1 or not 0 <= shard_index < shard_count:
            raise ValueError(f"bad shard {shard_index} of {shard_count}")
        if cfg.batch_size % shard_count:
            raise ConfigError(f"batch_size: {cfg.batch_size} is not divisible by the "
                              f"{shard_count} data shards (hosts)")
        self._docs, self._cfg, self._pad = docs, cfg, pad_id
        self._names, self._finite = list(source_names), finite
        self._shard, self._nshard = shard_index, shard_count
        self._rows = cfg.batch_size // shard_count
        self._load_stats = load_stats or {}
        self._reset()

    def _reset(self) -> None:
        self._next = 0  # local document counter
        self._exhausted = False
        self._packer = BlockPacker(self._cfg.seq_len, self._cfg.block_align,
                                   self._cfg.pack_open_rows, self._cfg.pack)
        self._ready: list[list[Piece]] = []
        self._counts = {n: dict.fromkeys(_COUNTERS, 0) for n in self._names}
        self._health = [_SourceHealth(n, self._cfg) for n in self._names]
        self.last_rows: list[list[Piece]] = []  # the pieces of the rows of the last batch
        self._totals = {"batches": 0, "rows": 0, "pad_tokens": 0, "empty_rows": 0}

    # ------------------------------------------------------------------ documents
    def _global_index(self, k: int) -> int:
        return self._shard + k * self._nshard

    def _split(self, index: int) -> tuple[Doc | DataError, Any]:
        doc = self._docs[index]
        if isinstance(doc, DataError):
            return doc, None
        align = self._cfg.block_align if self._cfg.align_responses == "block" else 0
        return doc, split_doc(doc, self._cfg.seq_len, self._cfg.overlong, doc_index=index, align=align,
                              pad_id=self._pad)

    def _pull(self) -> bool:
        """Read, split and pack the next document; False when a finite stream is exhausted."""
        index = self._global_index(self._next)
        if self._finite and index >= len(self._docs):
            return False
        self._next += 1
        doc, res = self._split(index)
        if isinstance(doc, DataError):
            if self._cfg.on_bad == "fail":
                raise doc
            source = getattr(doc, "source", 0)
            c = self._counts[self._names[source]]
            c["render_bad"] += 1
            self._health[source].record(doc, 0, str(doc.loc))  # raises past the source's allowance
            if c["render_bad"] <= MAX_BAD_SHOWN:  # the count survives a resume: bounded over the run
                last = "; later render failures of this source are counted, not logged" \
                    if c["render_bad"] == MAX_BAD_SHOWN else ""
                log.warning("source %r: skipped a document that failed to render: %s%s", self._names[source], doc, last)
            return True
        self._health[doc.source].record(None, len(res.pieces), doc.loc)
        c = self._counts[self._names[doc.source]]
        c["docs"] += 1
        if res.overlong:
            c["overlong_split" if self._cfg.overlong == "split_turns" else "overlong_dropped"] += 1
        c["hard_cuts"] += res.hard_cuts
        c["response_pads"] += res.response_pads
        c["dropped_no_loss"] += res.dropped_no_loss
        for p in res.pieces:
            c["pieces"] += 1
            c["tokens"] += len(p)
            c["loss_tokens"] += int(p.mask.sum())
            self._ready += self._packer.add(p)
        return True

    # ------------------------------------------------------------------ iteration
    def __next__(self) -> dict[str, np.ndarray]:
        while len(self._ready) < self._rows and not self._exhausted:
            if not self._pull():
                self._exhausted = True
                self._ready += self._packer.flush()
        if not self._ready:
            raise StopIteration
        rows, self._ready = self._ready[:self._rows], self._ready[self._rows:]
        self.last_rows = rows
        cfg = self._cfg
        arrays = [assemble_row(r, cfg.seq_len, cfg.block_align, self._pad) for r in rows]
        n_empty = self._rows - len(arrays)
        arrays += [empty_row(cfg.seq_len, self._pad) for _ in range(n_empty)]
        batch = {k: np.stack([a[k] for a in arrays]) for k in arrays[0]}
        t = self._totals
        t["batches"] += 1
        t["rows"] += len(rows)
        t["empty_rows"] += n_empty
        t["pad_tokens"] += int((batch["segment_ids"][:len(rows)] == 0).sum())
        return batch

    # ------------------------------------------------------------------ state
    def get_state(self) -> dict[str, Any]:
        return {"next_doc": self._next, "exhausted": self._exhausted,
                "open_rows": self._packer.state(),
                "ready_rows": [[list(p.ref) for p in row] for row in self._ready],
                "counters": copy.deepcopy(self._counts), "totals": dict(self._totals),
                "shard": [self._shard, self._nshard]}

    def set_state(self, state: dict[str, Any]) -> None:
        if list(state.get("shard", [])) != [self._shard, self._nshard]:
            raise ValueError(f"iterator state is for shard {state.get('shard')}, this iterator "
                             f"is shard {[self._shard, self._nshard]}")
        self._reset()
        cache: dict[int, dict[int, Piece]] = {}

        def resolve(d: int, k: int) -> Piece:
            if d not in cache:
                _, res = self._split(d)
                cache[d] = {p.ref[1]: p for p in res.pieces} if res is not None else {}
            if k not in cache[d]:
                raise ValueError(f"iterator state names piece {k} of document {d}, which the "
                                 "data no longer produces (changed data or config?)")
            return cache[d][k]

        self._packer.restore(state["open_rows"], resolve)
        self._ready = [[resolve(int(d), int(k)) for d, k in row] for row in state["ready_rows"]]
        self._next, self._exhausted = int(state["next_doc"]), bool(state["exhausted"])
        for name, c in state["counters"].items():
            if name in self._counts:
                self._counts[name].update({k: int(v) for k, v in c.items()})
        self._totals.update({k: int(v) for k, v in state["totals"].items()})

    # ------------------------------------------------------------------ logging
    def stats(self) -> dict[str, Any]:
        """Per-source counters (load time + packing so far) and totals, for logging."""
        sources = {n: {**self._load_stats.get(n, {}), **self._counts[n],
                       "first_render_bad": str(h.first_bad) if h.first_bad is not None else None}
                   for n, h in zip(self._names, self._health)}
        t = dict(self._totals)
        cells = max(1, (t["rows"]) * self._cfg.seq_len)
        t["pad_fraction"] = t["pad_tokens"] / cells
        return {"sources": sources, "totals": t}


class SFTData:
    """Opened sources + tokenizer; builds the train and eval iterators (module docstring)."""

    def __init__(self, cfg: DataConfig, tokenizer: Any = None):
        if not cfg.sources:
            raise ConfigError("sources: no data sources configured")
        if tokenizer is None:
            from clover_jax.bridge.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(cfg.tokenizer)
        self.cfg, self.tokenizer = cfg, tokenizer
        self.renderer = ChatRenderer(tokenizer, cfg.think)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.convert_tokens_to_ids(ENDOFTEXT))
        self.sources: list[LoadedSource] = [load_source(s, cfg) for s in cfg.sources]
        self.names = [s.config.name for s in self.sources]
        render = _Render(self.renderer)
        per_source = []
        for i, s in enumerate(self.sources):
            ds = grain.MapDataset.source([(r, loc, i) for r, loc in s.train])
            if cfg.shuffle:
                ds = ds.shuffle(seed=source_seed(cfg.seed, s.config.name))
            per_source.append(ds.repeat())
        mixed = per_source[0] if len(per_source) == 1 else grain.MapDataset.mix(
            per_source, weights=[s.config.weight for s in self.sources])
        self.train_docs = mixed.map(render)
        eval_items = [(r, loc, i) for i, s in enumerate(self.sources) for r, loc in s.eval]
        self.eval_docs = grain.MapDataset.source(eval_items).map(render) if eval_items else None

    def check_renders(self) -> None:
        """Fail fast, before any compile: render each source's train records in file order until
        one renders; a source whose failures reach the ``bad_window`` allowance first, or whose
        records all fail, raises the iterator's ``DataError`` (source, first failing record, cause).
        Costs one render per healthy source."""
        for i, s in enumerate(self.sources):
            health = _SourceHealth(s.config.name, self.cfg)
            for record, loc in s.train:
                try:
                    self.renderer(record, source=i, loc=loc)
                    break
                except DataError as e:
                    health.record(e, 1, loc)  # 1: count the failure, not a dry run
            else:
                raise DataError(None, f"source {s.config.name!r}: all {len(s.train)} train records failed to "
                                      f"render; first failing record: {health.first_bad}")

    def load_stats(self) -> dict[str, dict]:
        return {s.config.name: s.stats.as_dict() for s in self.sources}

    def train_iterator(self, shard_index: int = 0, shard_count: int = 1) -> PackedBatchIterator:
        """Infinite iterator of training batches for data shard (host) ``shard_index``."""
        return PackedBatchIterator(self.train_docs, self.cfg, pad_id=self.pad_id,
                                   source_names=self.names, finite=False,
                                   shard_index=shard_index, shard_count=shard_count,
                                   load_stats=self.load_stats())

    def eval_iterator(self, shard_index: int = 0, shard_count: int = 1) -> PackedBatchIterator:
        """One pass over the held-out records (``eval_fraction`` > 0 needed)."""
        if self.eval_docs is None:
            raise ConfigError("eval_fraction: no eval records (eval_fraction is "
                              f"{self.cfg.eval_fraction})")
        return PackedBatchIterator(self.eval_docs, self.cfg, pad_id=self.pad_id,
                                   source_names=self.names, finite=True,
                                   shard_index=shard_index, shard_count=shard_count,
                                   load_stats=self.load_stats())
