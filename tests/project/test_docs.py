"""The documentation cites tests, modules and pages that exist.

``docs/design.md`` is the map: every test it names ("Tested in: `tests/memory/test_layout_planner.py`,
`test_allocator.py`, ...": a bare name is in the folder of the path before it), every
``mfsdp2/...`` or ``tools/...`` path and every page it links must exist, so a move or a rename
that forgets the map fails here. The other pages are held to their full paths and links.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]


def cited_paths(text: str, relative_names: bool) -> list[str]:
    """Repository paths a page cites in backticks (``tests/...``, ``mfsdp2/...``, ``tools/...``,
    ``benchmarks/...``); with ``relative_names``, bare ``test_x.py`` names too, resolved against
    the folder of the last cited test path."""
    out: list[str] = []
    folder = None
    for m in re.finditer(r"`([^`\s]+)`", text):
        tok = m.group(1).split("::")[0].rstrip(",.;:")
        if re.match(r"(tests|mfsdp2|tools|benchmarks|csrc)/", tok):
            if any(c in tok for c in "*{<") or "..." in tok:
                continue  # a pattern, not a path
            out.append(tok)
            if tok.startswith("tests/"):
                folder = tok if tok.endswith("/") else tok.rsplit("/", 1)[0]
        elif relative_names and re.fullmatch(r"test_\w+\.py", tok):
            out.append(f"{folder or 'tests'}/{tok}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_cited_paths_exist(page):
    text = page.read_text()
    missing = [p for p in cited_paths(text, relative_names=page.name == "design.md")
               if not (ROOT / p.rstrip("/")).exists()]
    assert missing == [], f"{page.name} cites paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_between_pages_exist(page):
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", page.read_text()):
        if not (page.parent / target).exists():
            missing.append(target)
    assert missing == [], f"{page.name} links to pages that do not exist: {missing}"


def test_the_checker_sees_a_missing_test():
    text = ("Tested in: `tests/memory/test_layout_planner.py`, `test_nothing_here.py`; "
            "`tests/groups/test_reduce_plan.py`.")
    paths = cited_paths(text, relative_names=True)
    assert paths == ["tests/memory/test_layout_planner.py", "tests/memory/test_nothing_here.py",
                     "tests/groups/test_reduce_plan.py"]
    assert [p for p in paths if not (ROOT / p).exists()] == ["tests/memory/test_nothing_here.py"]
