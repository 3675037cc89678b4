"""Open one configured source: read -> convert -> validate -> filter -> cap -> train/eval split.

Records are converted eagerly at open time (cheap next to tokenisation, which the pipeline does
lazily per record): bad-fraction checks and counts are then exact before training starts, and
the split and mixing work on plain lists.

Bad records (malformed lines, converter/validation ``DataError``s) are skipped and counted
(``on_bad: skip``) or raised at once (``on_bad: fail``). After reading, a source whose bad fraction
exceeds ``max_bad_fraction`` raises ``DataError`` naming the first bad record's location; else the
first ``MAX_BAD_SHOWN`` skipped records are logged (warning, ``file:line: reason``) and kept in
``SourceStats.bad_examples``. A source whose files hold no record at all raises ``DataError``
naming the file (a user's input, like a bad record: launch.py exits 2).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from clover_jax.yaml_config import ConfigError
from sft.data.config import DataConfig, FilterConfig, SourceConfig
from sft.data.converters import make_converter, resolve_options
from sft.data.readers import expand_path, iter_file, iter_hf
from sft.data.records import DataError, Loc

__all__ = ["MAX_BAD_SHOWN", "LoadedSource", "SourceStats", "eval_score", "keep_record", "load_source", "shown_bad"]

log = logging.getLogger(__name__)

#: bad records named one by one in the log (per source); the rest are counted
MAX_BAD_SHOWN = 3


@dataclass
class SourceStats:
    """Load-time counts of one source. ``read`` = raw records seen (bad ones included)."""

    read: int = 0
    bad: int = 0
    filtered: int = 0
    kept: int = 0
    train: int = 0
    eval: int = 0
    first_bad: str | None = None
    bad_examples: list[str] = field(default_factory=list)  # the first MAX_BAD_SHOWN, "loc: reason"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadedSource:
    """``train`` / ``eval``: lists of ``(record, loc)`` with ``loc`` the record's "file:line"."""

    config: SourceConfig
    train: list[tuple[dict, str]] = field(default_factory=list)
    eval: list[tuple[dict, str]] = field(default_factory=list)
    stats: SourceStats = field(default_factory=SourceStats)


def eval_score(record: dict) -> float:
    """A uniform [0, 1) score from the record's canonical JSON: identical records (also across
    sources) always land in the same split, whatever the file order or seed."""
    blob = json.dumps(record, sort_keys=True, ensure_ascii=False).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big") / 2.0**64


def keep_record(record: dict, flt: FilterConfig) -> bool:
    msgs = record["messages"]
    turns = sum(m["role"] == "assistant" for m in msgs)
    if turns < flt.min_turns or (flt.max_turns is not None and turns > flt.max_turns):
        return False
    if flt.require_tool_calls and not any(m.get("tool_calls") for m in msgs):
        return False
    if flt.content_regex is not None:
        rx = re.compile(flt.content_regex)
        texts = [m["content"] for m in msgs] + [m.get("reasoning_content", "") for m in msgs] + \
            [json.dumps(c["function"]["arguments"], ensure_ascii=False)
             for m in msgs for c in m.get("tool_calls", ())]
        if not any(rx.search(t) for t in texts):
            return False
    return True


def _raw_items(src: SourceConfig, where: str) -> tuple[list, Iterator[tuple[Loc, Any]]]:
    if src.format == "synthetic":
        from sft.data.synthetic import generate_records

        opts = resolve_options("synthetic", src.options, where)
        label = f"synthetic:{src.name}"
        recs = generate_records(opts["n_records"], opts["seed"])
        return [], ((Loc(label, index=i), r) for i, r in enumerate(recs))
    if src.format == "tool_task":
        from sft.data import tool_task

        opts = resolve_options("tool_task", src.options, where)
        files = expand_path(src.path, where)
        if len(files) != 1:
            raise ConfigError(f"{where}: path: a tool_task source needs exactly one BFCL schema file, "
                              f"{src.path} matches {len(files)}")
        schemas = tool_task.schemas_from_options(str(files[0]), opts)
        recs = tool_task.generate_records(opts["n_records"], opts["seed"], opts["split"], schemas,
                                          **{k: float(opts[k]) for k in tool_task.CURRICULA})
        label = f"tool_task:{src.name}:{opts['split']}"
        return [], ((Loc(label, index=i), r) for i, r in enumerate(recs))
    if src.path is not None:
        files = expand_path(src.path, where)
        return files, (item for f in files for item in iter_file(f))
    return [], iter_hf(src.hf or {}, where)


def load_source(src: SourceConfig, cfg: DataConfig) -> LoadedSource:
    """Read, convert and split one source (see the module docstring for the error policy)."""
    where = f"source {src.name!r}"
    files, items = _raw_items(src, where)
    convert = make_converter(src.format, src.options, files, where)
    out = LoadedSource(config=src)
    st = out.stats
    kept: list[tuple[dict, str]] = []
    for loc, raw in items:
        st.read += 1
        try:
            if isinstance(raw, DataError):
                raise raw
            record = convert(raw, loc)
        except DataError as e:
            if cfg.on_bad == "fail":
                raise
            st.bad += 1
            st.first_bad = st.first_bad or str(e)
            if len(st.bad_examples) < MAX_BAD_SHOWN:
                st.bad_examples.append(str(e))
            continue
        if record is None or not keep_record(record, src.filter):
            st.filtered += 1
            continue
        kept.append((record, str(loc)))
        if src.max_records is not None and len(kept) >= src.max_records:
            break
    if st.read == 0:
        if files:  # the user's file(s) hold nothing: bad input, named like a bad record
            what = str(files[0]) if len(files) == 1 else f"{src.path} ({len(files)} files)"
            raise DataError(what, f"no records ({where}: empty, or only blank lines)")
        raise ConfigError(f"{where}: empty dataset (no records in {src.path or src.hf})")
    if st.bad and st.bad / st.read > cfg.max_bad_fraction:
        raise DataError(None, f"{where}: {st.bad} of {st.read} records are bad "
                              f"({st.bad / st.read:.2%} > max_bad_fraction "
                              f"{cfg.max_bad_fraction:.2%}); first bad record: {st.first_bad}")
    if not kept:
        raise ConfigError(f"{where}: no usable records (read {st.read}, bad {st.bad}, filtered "
                          f"{st.filtered})")
    st.kept = len(kept)
    for item in kept:
        (out.eval if eval_score(item[0]) < cfg.eval_fraction else out.train).append(item)
    st.train, st.eval = len(out.train), len(out.eval)
    if not out.train:
        raise ConfigError(f"{where}: all {st.kept} records fell into the eval split "
                          f"(eval_fraction {cfg.eval_fraction})")
    if st.bad:
        log.warning("%s", shown_bad(f"{where}: skipped {st.bad} bad record(s) of {st.read}", st.bad_examples, st.bad))
    return out


def shown_bad(head: str, examples: list[str], total: int) -> str:
    """`head`, then one indented line per example (``loc: reason``) and "and K more" for the rest
    of `total`: how skipped records are named in the log, bounded by the examples kept."""
    lines = [head + ":", *(f"  {e}" for e in examples)]
    if total > len(examples):
        lines.append(f"  and {total - len(examples)} more")
    return "\n".join(lines)
