"""Importing a bench script (`bench/<name>.py`, run as a program) as a module in a test."""

from __future__ import annotations

import importlib
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str):
    """bench/<name>.py as a module (bench/ on sys.path only while importing: the scripts import `common`)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
