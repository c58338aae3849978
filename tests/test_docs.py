"""The README is the front door and docs/ the manual: the README stays short and links every page,
every relative link (and its #anchor) in either resolves, the extras table names every extra
pyproject declares, and nothing cites a file or tracker a reader of this repository cannot see."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from runs import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """The text without fenced blocks, so a `#` comment or a `[x](y)` in code is not read."""
    return FENCE.sub("", text)


def _links(path: Path) -> list[str]:
    return LINK.findall(CODE.sub("", _prose(path.read_text())))


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()).splitlines():
        if m := re.match(r"#{1,6} +(.+?) *#*$", line):
            slug = re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 300, "README.md is the front door: move detail to docs/"
    for command in (
        "pip install -e . && launch submit configs/smoke.yaml --wait",
        "pip install -e '.[dev]' && python -m pytest -q",
    ):
        assert f"\n{command}\n" in text, command


def test_the_readme_links_every_docs_page() -> None:
    linked = {(README.parent / t.split("#")[0]).resolve() for t in _links(README)}
    missing = [p.name for p in PAGES if p.resolve() not in linked]
    assert PAGES and not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    bad = []
    for target in _links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, bad


def test_the_extras_table_names_every_extra() -> None:
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    lines = README.read_text().splitlines()
    start = lines.index("| extra | adds | needed by | size |")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip())
    assert {r.strip("`") for r in rows if r.startswith("`")} == extras, rows


def test_no_citations_a_reader_cannot_follow() -> None:
    private = re.compile(r"\b(?:DESIGN|FACTS)\.md\b|\bissues? \d+", re.I)
    hits = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path in (README, *PAGES)
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not hits, hits
