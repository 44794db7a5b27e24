"""Every local link in the README and docs/ leads somewhere: a file that moves (a result into
docs/results/, a section into a document of its own) breaks the pages that name it without any
other test noticing, so this one reads each link in README.md and docs/*.md, outside code blocks,
and checks that its file exists and that its #anchor is a heading of the page it points to, as
GitHub makes anchors from headings."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.processes import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def prose(text: str) -> str:
    """The page without its code: a link written inside a code block or span is not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation but - and _ dropped,
    spaces as hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def local_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: lead elsewhere


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_local_link_resolves(page):
    broken = []
    for target in local_links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_links_are_read():
    """The test above would pass on pages it reads no link from: it does read them."""
    readme = local_links(ROOT / "README.md")
    assert "docs/serving.md" in {target.partition("#")[0] for target in readme}
    assert any(target.startswith("results/") for page in PAGES[1:] for target in local_links(page))
    assert "the-api" in anchors(ROOT / "docs" / "serving.md")


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page (draft)\n\n[gone](missing.png), [here](#a-page-draft), `[code](nowhere)`\n")
    assert local_links(page) == ["missing.png", "#a-page-draft"]
    assert anchors(page) == {"a-page-draft"}
