"""Importing a script of tools/ (run as `python tools/<name>.py`; tools/ is no package) as a module in a test."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def tool_module(name: str) -> ModuleType:
    """tools/<name>.py, loaded fresh."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
