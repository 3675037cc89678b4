"""Raw record readers: local files / globs and offline ``datasets`` specs -> ``(Loc, raw)``.

File kinds (by suffix): ``.jsonl`` (JSON Lines), ``.json`` (a JSON array, a single object, or JSON
Lines: BFCL ships its ``.json`` files that way), ``.traj`` (one object), ``.parquet`` (rows). A line
that does not parse is yielded as a ``DataError`` in place of the record, so the caller can count
it as bad; a file that cannot be read at all raises.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

from clover_jax.yaml_config import ConfigError
from sft.data.records import DataError, Loc

__all__ = ["expand_path", "iter_file", "iter_hf", "iter_path"]

_SUFFIXES = (".jsonl", ".json", ".traj", ".parquet")


def expand_path(pattern: str, where: str) -> list[Path]:
    """Sorted files matching ``pattern`` (a file or a glob; ``**`` recurses). ConfigError if none."""
    pattern = os.path.expanduser(pattern)
    if glob.has_magic(pattern):
        files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
        if not files:
            raise ConfigError(f"{where}: path: no file matches {pattern!r}")
    else:
        p = Path(pattern)
        if not p.exists():
            raise ConfigError(f"{where}: path: file not found: {pattern}")
        if not p.is_file():
            raise ConfigError(f"{where}: path: {pattern} is not a file (use a glob for folders)")
        files = [p]
    bad = [str(f) for f in files if f.suffix.lower() not in _SUFFIXES]
    if bad:
        raise ConfigError(f"{where}: path: unsupported file type(s) {bad[:3]} (expected "
                          f"{', '.join(_SUFFIXES)})")
    return files


def _iter_json_lines(path: Path, text: str) -> Iterator[tuple[Loc, Any]]:
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        loc = Loc(str(path), line=n)
        try:
            yield loc, json.loads(line)
        except json.JSONDecodeError as e:
            yield loc, DataError(loc, f"malformed JSON line ({e.msg} at column {e.colno})")


def iter_file(path: Path) -> Iterator[tuple[Loc, Any]]:
    """Yield ``(Loc, raw record or DataError)`` for every record of one file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # datasets' dependency; only needed for parquet

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield Loc(str(path), index=i), row
        return
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(Loc(str(path)), f"cannot read file: {e}") from None
    if suffix == ".jsonl":
        yield from _iter_json_lines(path, text)
        return
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            yield Loc(str(path)), DataError(Loc(str(path)), f"malformed JSON array ({e.msg} at "
                                                            f"line {e.lineno})")
            return
        for i, item in enumerate(items):
            yield Loc(str(path), index=i), item
        return
    try:
        yield Loc(str(path)), json.loads(text)  # one object per file (.traj, ToolBench answers)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # more than one top-level value: JSON Lines in a .json file
            yield from _iter_json_lines(path, text)
        else:
            yield Loc(str(path)), DataError(Loc(str(path)), f"malformed JSON ({e.msg} at line "
                                                            f"{e.lineno})")


def iter_path(pattern: str, where: str) -> Iterator[tuple[Loc, Any]]:
    for f in expand_path(pattern, where):
        yield from iter_file(f)


def iter_hf(spec: Mapping[str, Any], where: str) -> Iterator[tuple[Loc, Any]]:
    """Rows of ``datasets.load_dataset(**spec)`` (``split`` defaults to ``train``)."""
    import datasets  # heavy; only for hf sources

    kwargs = dict(spec)
    kwargs.setdefault("split", "train")
    try:
        ds = datasets.load_dataset(**kwargs)
    except FileNotFoundError as e:
        raise ConfigError(f"{where}: hf: {e}") from None
    except Exception as e:  # datasets raises many types; all mean "this spec does not resolve"
        raise ConfigError(f"{where}: hf: load_dataset({kwargs}) failed: "
                          f"{type(e).__name__}: {e}") from None
    label = f"hf:{spec.get('path')}"
    for i, row in enumerate(ds):
        yield Loc(label, index=i), row
