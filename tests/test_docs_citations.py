"""Every citation of a documentation page in the repository points at a page and a heading that exist.

Code and prose cite `docs/<page>.md#<anchor>`; the pages link each other as `(<page>.md#<anchor>)` and
`(#<anchor>)`. Anchors follow GitHub's heading slugs, so the links also work on GitHub.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCANNED_SUFFIXES = {".py", ".md", ".sh", ".toml"}
SKIPPED_FOLDERS = {"logs", "checkpoints", "__pycache__", "node_modules"}
CITATION = re.compile(r"\bdocs/([\w.-]+\.md)(?:#([\w-]+))?")
DOCS_LINK = re.compile(r"\]\(([\w.-]+\.md)?(?:#([\w-]+))?\)")  # markdown links between the pages


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, '_', '-' and spaces
    stay), each space a hyphen."""
    text = heading.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "_- ")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (fenced code skipped); a repeated heading gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6} (.+)", line)
        if fenced or not heading:
            continue
        slug = github_slug(heading.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def scanned_files() -> list[Path]:
    return sorted(
        path
        for path in ROOT.rglob("*")
        if path.suffix in SCANNED_SUFFIXES
        and path.is_file()
        and path != Path(__file__).resolve()  # its examples of broken citations are meant to be broken
        and not any(part.startswith(".") or part in SKIPPED_FOLDERS for part in path.relative_to(ROOT).parts)
    )


def citations() -> list[tuple[str, str, str | None]]:
    """(where, page, anchor or None) for every citation and every link between the doc pages."""
    found = []
    for path in scanned_files():
        relative = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for match in CITATION.finditer(line):
                found.append((f"{relative}:{number}", match.group(1), match.group(2)))
            if path.parent == DOCS:
                for match in DOCS_LINK.finditer(line):
                    found.append((f"{relative}:{number}", match.group(1) or path.name, match.group(2)))
    return found


def test_github_slugs():
    assert github_slug("Track 1 recipe: `train_gpt.py`") == "track-1-recipe-train_gptpy"
    assert github_slug("Shampoo parameter-group checks") == "shampoo-parameter-group-checks"
    assert github_slug("Records: rules, statistics and folders") == "records-rules-statistics-and-folders"


def test_every_cited_page_and_anchor_exists():
    found = citations()
    assert len(found) > 20, "the scan finds the repository's citations (it found almost none: is the pattern broken?)"
    pages = {page.name: anchors(page) for page in DOCS.glob("*.md")}
    broken = []
    for where, page, anchor in found:
        if page not in pages:
            broken.append(f"{where}: docs/{page} does not exist")
        elif anchor is not None and anchor not in pages[page]:
            broken.append(f"{where}: docs/{page} has no heading with anchor #{anchor}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("citation, ok", [("docs/track1_recipe.md#schedules", True), ("docs/track1_recipe.md#no-such-heading", False)])
def test_a_broken_anchor_is_caught(citation, ok):
    (match,) = CITATION.finditer(citation)
    assert (match.group(2) in anchors(DOCS / match.group(1))) is ok
