"""The one-way import rule of docs/architecture.md, read from the source with `ast` (no jax import,
well under a second): every import of every module in clover_jax/, pallas_kernels/, train/, sft/
and launch.py, deferred function-level imports included, goes to its own room or to a lower floor;
no modules import each other in a circle (inside a room too); and no module imports another
module's `_private` name (`from x import _y`, or `x._y` on a module imported as `x`).

Tests are not checked: a test may read the private names of the module it tests (that is what a
unit test of a helper does), and nothing imports a test but another test."""

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
    {"pallas_kernels.common", "clover_jax.parallel", "clover_jax.yaml_config", "clover_jax.input_file"},
    {"pallas_kernels.gdn", "pallas_kernels.attention"},  # the op families: each on its own
    {"pallas_kernels.context"},  # context parallelism, over both op families
    {"pallas_kernels"},  # the package's front door (its __init__ re-exports the public ops)
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

#: Import circles that exist today (each as its sorted modules), with the way out; only shrinks.
KNOWN_CIRCLES: dict[tuple[str, ...], str] = {}

#: Private names imported from another module today, (importer, "module._name"), with the way out.
KNOWN_PRIVATE: dict[tuple[str, str], str] = {}


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


def from_module(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` in module `name` reads from (relative levels resolved)."""
    base = node.module or ""
    if node.level:
        pkg = name.split(".") if is_package else name.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    return base


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """Every module `source` (the module `name`) imports; `from a import b` counts as `a.b` when
    that is a module of `known`, else as `a`."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = from_module(name, is_package, node)
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


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: the project modules it imports} (deferred imports included; `from a import b` names
    the module `a.b` when that is one, else `a`)."""
    known = set(sources)
    return {name: {i for i in imports_of(name, src, pkg, known) if i in known and i != name}
            for name, (src, pkg) in sources.items()}


def circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The import circles of `graph`: its strongly connected components of more than one module
    (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def private_imports(sources: dict[str, tuple[str, bool]]) -> list[tuple[str, str]]:
    """[(importer, "module._name")] for every `from m import _name` and every `alias._name` on a
    project module imported as `alias`, where m is another project module (dunders excepted)."""
    known = set(sources)
    private = lambda n: n.startswith("_") and not n.startswith("__")  # noqa: E731
    out = set()
    for name, (source, is_package) in sources.items():
        tree = ast.parse(source)
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = from_module(name, is_package, node)
                for a in node.names:
                    if f"{base}.{a.name}" in known:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in known and base != name and private(a.name):
                        out.add((name, f"{base}.{a.name}"))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in known and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and private(node.attr) and aliases[node.value.id] != name):
                out.add((name, f"{aliases[node.value.id]}.{node.attr}"))
    return sorted(out)


@pytest.fixture(scope="module")
def sources():
    return {n: (p.read_text(encoding="utf-8"), pkg) for n, (p, pkg) in project_modules().items()}


@pytest.fixture(scope="module")
def found(sources):
    assert "clover_jax.model.layers" in sources and "launch" in sources, sorted(sources)[:10]
    return violations(sources)


def test_every_module_has_a_room(found):
    _, homeless = found
    assert not homeless, f"modules on no floor of FLOORS (give each a room): {homeless}"


def assert_only_known(found: list, known: dict, name: str, what: str, show) -> None:
    """Fails on a finding not in `known` (`what`, each line by `show`) and on an entry of `known`
    (named `name`) no longer found: the known lists only shrink."""
    new = [f for f in found if f not in known]
    assert not new, what + ":\n" + "\n".join("  " + show(f) for f in new)
    gone = [k for k in known if k not in found]
    assert not gone, f"{name} no longer needed, delete them: {gone}"


def test_no_upward_import(found):
    assert_only_known(found[0], KNOWN_EXCEPTIONS, "KNOWN_EXCEPTIONS",
                      "imports against the one-way rule (docs/architecture.md)",
                      lambda f: f"{f[0]} -> {f[1]}  ({room_of(f[0])} may not import {room_of(f[1])})")


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


def test_no_import_circle(sources):
    assert_only_known(circles(import_graph(sources)), KNOWN_CIRCLES, "KNOWN_CIRCLES",
                      "modules that import each other (move what both need into a third module)", " <-> ".join)


def test_no_private_name_of_another_module(sources):
    assert_only_known(private_imports(sources), KNOWN_PRIVATE, "KNOWN_PRIVATE",
                      "private names imported from another module (make them public where they live)",
                      lambda f: f"{f[0]} takes {f[1]}")


def test_checker_sees_circles_and_private_names():
    """The two new checks on made-up modules: a direct and a three-module circle (one leg a deferred
    relative import) are reported, a one-way chain is not; `from x import _y` and `x._y` on another
    module are reported, a module's own private names and a dunder are not."""
    src = {
        "pallas_kernels.gdn.a": ("from .b import f\n", False),
        "pallas_kernels.gdn.b": ("def g():\n    from pallas_kernels.gdn import a\n", False),
        "clover_jax.model.x": ("from clover_jax.model import y\n", False),
        "clover_jax.model.y": ("import clover_jax.model.z\n", False),
        "clover_jax.model.z": ("def h():\n    from . import x\n", False),
        "clover_jax.model.w": ("from clover_jax.model import x, y\n", False),
        "train.p": ("from clover_jax.model.x import _helper, __version__\nfrom train import q as qq\n"
                    "qq._secret()\n_own = 1\n", False),
        "train.q": ("", False),
    }
    assert circles(import_graph(src)) == [("clover_jax.model.x", "clover_jax.model.y", "clover_jax.model.z"),
                                          ("pallas_kernels.gdn.a", "pallas_kernels.gdn.b")]
    assert private_imports(src) == [("train.p", "clover_jax.model.x._helper"), ("train.p", "train.q._secret")]
