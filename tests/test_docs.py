"""The repository explains itself: every `docs/design.md <section>` citation in the code, configs and
docs names a section that docs/design.md has, and nothing points at a design file outside the
repository (plain text reads, no imports)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"docs/design\.md(?: section)? (\d+(?:\.\d+)?)(?: ([A-Z])\b)?")
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml")


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.splitlines() if p.endswith(SUFFIXES) and not p.startswith("data/")]


def design_sections(text: str) -> set[str]:
    """'2', '2.1', ... from the `##` / `###` headings, and '3.2 A'... from the bold letters of a section."""
    found, current = set(), None
    for line in text.splitlines():
        m = re.match(r"#{2,3} (\d+(?:\.\d+)?)\. ", line) or re.match(r"#{2,3} (\d+\.\d+) ", line)
        if m:
            current = m.group(1)
            found.add(current)
        elif current and (m := re.match(r"\*\*([A-Z])\. ", line)):
            found.add(f"{current} {m.group(1)}")
    return found


def test_section_parser_reads_numbers_and_letters():
    text = "## 1. What\n### 3.2 The four\n**B. GDN** text\n## 4. Sharding\n**C. not in 3.2**\n"
    assert design_sections(text) == {"1", "3.2", "3.2 B", "4", "4 C"}


def test_every_citation_names_an_existing_section():
    sections = design_sections((ROOT / "docs" / "design.md").read_text(encoding="utf-8"))
    assert {"2.1", "3.2 B", "3.4", "6"} <= sections, sorted(sections)
    bad, n = [], 0
    for path in tracked_text_files():
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in CITATION.finditer(line):
                n += 1
                cited = m.group(1) + (f" {m.group(2)}" if m.group(2) else "")
                if cited not in sections and m.group(1) not in sections:
                    bad.append(f"{path.relative_to(ROOT)}:{i}: {m.group(0)}")
                elif m.group(2) and cited not in sections:
                    bad.append(f"{path.relative_to(ROOT)}:{i}: {m.group(0)} (no part {m.group(2)})")
    assert n > 40, f"only {n} citations found: is the pattern still right?"
    assert not bad, "citations of missing docs/design.md sections:\n" + "\n".join(bad)


def test_nothing_points_outside_the_repository_for_the_design():
    bad = [str(p.relative_to(ROOT)) for p in tracked_text_files()
           if re.search("DESIGN" + r"\.md|shared" + "/research", p.read_text(encoding="utf-8"))]
    assert not bad, f"files citing a design file outside the repository: {bad}"
