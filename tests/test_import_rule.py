"""The one-way import rule of docs/architecture.md, read from the source with `ast` (no jax import,
well under a second): every import of every module in clover_jax/, pallas_kernels/, train/, sft/
and launch.py, deferred function-level imports included, goes to its own room or to a lower floor."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("clover_jax", "pallas_kernels", "train", "sft", "launch.py")

#: Rooms, bottom floor first. A module may import its own room and any room on a LOWER floor;
#: rooms on the same floor never import each other. The package `clover_jax` itself (its
#: __init__: load_hf, save_hf, CloverModel) counts as the `clover_jax.api` room.
FLOORS: list[set[str]] = [
    {"pallas_kernels", "clover_jax.parallel", "clover_jax.yaml_config", "clover_jax.input_file"},
    {"clover_jax.config"},
    {"clover_jax.model", "clover_jax.run_config"},
    {"clover_jax.bridge"},
    {"clover_jax.api"},
    {"clover_jax.decoding"},
    {"clover_jax.demo"},
    {"train"},
    {"sft"},
    {"launch"},
    {"tests", "bench"},  # nothing above imports these
]
PROJECT_ROOTS = {r.split(".")[0] for floor in FLOORS for r in floor}

#: Upward imports that exist today, each with the way out. The test fails when one disappears, so the
#: list only shrinks.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def room_of(module: str) -> str | None:
    """The room of a project module (longest matching room name), None outside the project."""
    if module == "clover_jax":
        return "clover_jax.api"
    rooms = [r for floor in FLOORS for r in floor if module == r or module.startswith(r + ".")]
    if rooms:
        return max(rooms, key=len)
    return "?" if module.split(".")[0] in PROJECT_ROOTS else None


def floor_of(room: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if room in floor)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, tuple[Path, bool]]:
    """{dotted name: (path, is_package)} of every module the rule covers."""
    out = {}
    for src in SOURCES:
        paths = [ROOT / src] if src.endswith(".py") else sorted((ROOT / src).rglob("*.py"))
        for p in paths:
            out[module_name(p)] = (p, p.name == "__init__.py")
    return out


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """Every module `source` (the module `name`) imports; `from a import b` counts as `a.b` when
    that is a module of `known`, else as `a`."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return out


def violations(sources: dict[str, tuple[str, bool]]) -> tuple[list[tuple[str, str]], list[str]]:
    """(upward imports [(importer, imported)], modules with no room) of {name: (source, is_package)}."""
    known = set(sources)
    bad, homeless = [], []
    for name, (source, is_package) in sorted(sources.items()):
        mine = room_of(name)
        if mine == "?":
            homeless.append(name)
            continue
        for imp in sorted(imports_of(name, source, is_package, known)):
            theirs = room_of(imp)
            if theirs is None or theirs == mine:
                continue
            if theirs == "?":
                homeless.append(imp)
            elif floor_of(theirs) >= floor_of(mine):
                bad.append((name, imp))
    return bad, sorted(set(homeless))


@pytest.fixture(scope="module")
def found():
    sources = {n: (p.read_text(encoding="utf-8"), pkg) for n, (p, pkg) in project_modules().items()}
    assert "clover_jax.model.layers" in sources and "launch" in sources, sorted(sources)[:10]
    return violations(sources)


def test_every_module_has_a_room(found):
    _, homeless = found
    assert not homeless, f"modules on no floor of FLOORS (give each a room): {homeless}"


def test_no_upward_import(found):
    bad, _ = found
    new = [b for b in bad if b not in KNOWN_EXCEPTIONS]
    assert not new, "imports against the one-way rule (docs/architecture.md):\n" + "\n".join(
        f"  {a} -> {b}  ({room_of(a)} may not import {room_of(b)})" for a, b in new)
    gone = [k for k in KNOWN_EXCEPTIONS if k not in bad]
    assert not gone, f"KNOWN_EXCEPTIONS no longer needed, delete them: {gone}"


def test_checker_sees_upward_deferred_relative_and_from_package_imports():
    """The checker itself, on made-up modules: each kind of upward import is reported, the allowed
    ones are not."""
    src = {
        "clover_jax.model.a": ("def f():\n    from clover_jax.decoding import generator\n", False),
        "clover_jax.model.b": ("from . import a\nfrom clover_jax.parallel import sharding\nimport numpy\n", False),
        "clover_jax.parallel.sharding": ("from ..bridge import convert\n", False),
        "clover_jax.decoding.generator": ("import clover_jax\nfrom clover_jax.model import b\n", False),
        "clover_jax.bridge.convert": ("import sft.recipe\n", False),
        "pallas_kernels.k": ("from clover_jax import config\n", False),
        "clover_jax.config": ("", False),
        "clover_jax.newroom.x": ("", False),
    }
    bad, homeless = violations(src)
    assert bad == [("clover_jax.bridge.convert", "sft.recipe"),
                   ("clover_jax.model.a", "clover_jax.decoding.generator"),
                   ("clover_jax.parallel.sharding", "clover_jax.bridge.convert"),
                   ("pallas_kernels.k", "clover_jax.config")]
    assert homeless == ["clover_jax.newroom.x"]
