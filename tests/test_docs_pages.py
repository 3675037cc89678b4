"""The user docs stay true: the generated pages (docs/results.md, docs/reference/*.md, the README's
tables of numbers) equal what `python tools/gen_docs.py` writes now, every relative link in
README.md, CHANGELOG.md and docs/ points at a file that exists, every repository path they name
exists, and the README stays short and free of development history (plain text reads; the
generators import the config dataclasses and launch.py's parser, nothing compiles)."""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path

import pytest

from tests.tool_import import tool_module

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "python tools/gen_docs.py"


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"] + sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.exists()]


def user_pages() -> list[Path]:
    """What a user reads as a guide: the README and docs/ except the design reference and the changelog."""
    return [f for f in doc_files() if f.name not in ("CHANGELOG.md", "design.md", "architecture.md")]


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TOP = ("configs", "bench", "docs", "clover_jax", "sft", "train", "pallas_kernels", "tests", "tools", "models", ".ci")
PATH = re.compile(r"(?<![\w/.$~-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./*+-]*)")


def test_generated_pages_are_current():
    stale = tool_module("gen_docs").stale_pages()
    assert not stale, f"generated pages are stale: {', '.join(stale)}; regenerate them with `{REGENERATE}`"


def test_every_relative_link_exists():
    bad = []
    for f in doc_files():
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue
                path = (f.parent / target.split("#")[0]).resolve()
                if not path.exists():
                    bad.append(f"{f.relative_to(ROOT)}:{i}: {target}")
    assert not bad, "links to missing files:\n" + "\n".join(bad)


def test_every_named_repository_path_exists():
    bad, n = [], 0
    for f in doc_files():
        if f.name == "design.md":  # its references section names files of other projects
            continue
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if "github.com" in line or "://" in line:  # upstream paths of the public data sets
                continue
            for m in PATH.finditer(line):
                p = m.group(1).rstrip(".,:;)")
                if line[m.end():m.end() + 1] == "{":  # X.{txt,json}: the files named X.*
                    p += "*"
                if p.startswith(("docs/design.md", "tests/")) and "::" in line[m.end():m.end() + 2]:
                    continue
                n += 1
                hit = glob.glob(str(ROOT / p)) if any(c in p for c in "*?[") else (ROOT / p).exists()
                if not hit:
                    bad.append(f"{f.relative_to(ROOT)}:{i}: {p}")
    assert n > 50, f"only {n} paths found: is the pattern still right?"
    assert not bad, "paths named in the docs that do not exist:\n" + "\n".join(bad)


def test_pages_the_readme_promises_exist():
    for rel in ("docs/install.md", "docs/quickstart.md", "docs/results.md", "docs/development.md",
                "docs/reference/config.md", "docs/reference/cli.md", "docs/concepts/block_diffusion.md",
                *(f"docs/guides/{g}.md" for g in ("sft", "data", "tpu_pod", "gpu_cluster", "long_context",
                                                 "checkpoints", "decoding", "calibration", "aot_plans"))):
        assert (ROOT / rel).is_file(), rel
        assert rel.removeprefix("docs/") in (ROOT / "README.md").read_text(encoding="utf-8") or \
            rel.startswith("docs/reference/") or rel.startswith("docs/guides/"), f"README does not link {rel}"


def test_readme_is_short_and_reads_as_a_guide():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 220, f"README.md has {len(text.splitlines())} lines (<= 220)"
    # the test command CI runs stays exactly the README's second command
    assert ('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && '
            "python -m pytest -q -n 2 --dist loadfile tests") in text
    assert 'section "Getting the data"' not in text and "## Getting the data" in text  # sft.config.DATA_README
    bad = []
    for f in user_pages():
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\bissues? \d+|#\d{2}\b|\bwas [\d.]+\b|\bthe recipe now\b|\bsee the issues\b", line):
                bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not bad, "development history in pages a user reads (it belongs in CHANGELOG.md):\n" + "\n".join(bad)


def test_the_readme_tables_are_read_from_the_results():
    """The README's numbers come from bench/results and the stored study models: a number edited by
    hand is stale (the render puts the file's value back, computed here from the plan JSON by hand),
    and a README without a table's markers is refused, naming the file and the table."""
    import json

    tables = tool_module("readme_tables")
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    plan = json.loads((ROOT / "bench" / "results" / tables.SLICES[0][2]).read_text())[0]
    gib = f"{plan['total_bytes'] / 2**30:.1f}"
    row = f"| `{tables.SLICES[0][1]}` | {plan['topology']} | fsdp {plan['mesh']['fsdp']} | {gib} | "
    assert row in text
    edited = text.replace(row, row.replace(f"| {gib} |", "| 12.3 |"))
    assert edited != text and tables.render_readme(edited) == text
    assert tables.render_readme(text) == text
    with pytest.raises(ValueError, match=r"NOTES.md: the markers of the generated summary table are missing"):
        tables.render_readme(text.replace(tables.end("summary"), ""), where="NOTES.md")
