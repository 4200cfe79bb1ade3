"""The documentation set holds together: README.md is the front door (under 300 lines, linking
every guide under docs/), and every link in README.md, docs/*.md, deploy/README.md and
benchmarks/README.md leads somewhere — a relative link to a file of the repository and an
``#anchor`` to a heading of that file (GitHub's rule), an external link well formed (nothing is
fetched)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
# The guides beside the code they describe are documents too.
DOCUMENTS = [
    ROOT / "README.md",
    *DOCS,
    ROOT / "deploy" / "README.md",
    ROOT / "benchmarks" / "README.md",
]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"\[([^\]]*)\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)(?:[ \t]+#+)?[ \t]*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text outside fenced code blocks, inline code kept as its plain text (a heading's or
    a link's code is part of its words; a code span holds no link)."""
    text = FENCE.sub("", text)
    return CODE_SPAN.sub(lambda m: m.group(2).replace("[", " ").replace("]", " ").strip(), text)


def links(text: str) -> list[str]:
    """Every markdown link target, images included, outside code."""
    return [target for _, target in LINK.findall(prose(text))]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: its text (a link's words, no markup) lowercased,
    punctuation dropped, each space a hyphen."""
    words = LINK.sub(lambda m: m.group(1), heading)
    return re.sub(r"[^\w\- ]", "", words.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a document's headings; a repeated one gets ``-1``, ``-2``, ... as on
    GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(prose(text)):
        slug = anchor(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE))


def broken(document: Path, root: Path = ROOT) -> list[str]:
    """Why each relative link of ``document`` leads nowhere: a missing or outside file, or an
    anchor that is no heading of its (markdown) file."""
    problems = []
    for target in links(document.read_text()):
        if external(target):
            continue
        path, _, fragment = target.partition("#")
        file = (document.parent / unquote(path)).resolve() if path else document
        where = f"{document.relative_to(root)}: ({target})"
        if not file.is_relative_to(root) or not file.is_file():
            problems.append(f"{where} names no file of the repository")
        elif fragment and (file.suffix != ".md" or fragment not in anchors(file.read_text())):
            problems.append(f"{where}: no heading of {file.relative_to(root)} has that anchor")
    return problems


def malformed(document: Path) -> list[str]:
    """External links that are not a well-formed http(s) or mailto address."""
    problems = []
    for target in filter(external, links(document.read_text())):
        parts = urlsplit(target)
        web = parts.scheme in ("http", "https") and bool(parts.hostname)
        mail = parts.scheme == "mailto" and "@" in parts.path
        if not (web or mail):
            problems.append(f"{document.name}: ({target}) is not a well-formed web address")
    return problems


def test_the_readme_is_a_front_door_under_300_lines() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) < 300


def test_the_readme_links_every_guide() -> None:
    readme = ROOT / "README.md"
    linked = {
        (readme.parent / unquote(target.partition("#")[0])).resolve()
        for target in links(readme.read_text())
        if not external(target)
    }
    assert [doc.name for doc in DOCS if doc not in linked] == []


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(document: Path) -> None:
    problems = broken(document)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_external_link_is_well_formed(document: Path) -> None:
    problems = malformed(document)
    assert not problems, "\n".join(problems)


def test_anchors_follow_github() -> None:
    text = (
        "# Whole runs: `check-invariance --run`\n"
        "## Lost workers, nodes and drivers: restarts\n"
        "```\n# not a heading\n```\n"
        "## Notes\n## Notes\n### [LoRA](lora.md): `actor.lora`\n"
    )
    assert anchors(text) == {
        "whole-runs-check-invariance---run",
        "lost-workers-nodes-and-drivers-restarts",
        "notes",
        "notes-1",
        "lora-actorlora",
    }


def test_the_check_finds_what_leads_nowhere(tmp_path: Path) -> None:
    # The negative control: each kind of broken link is caught, and code is not read as links.
    (tmp_path / "guide.md").write_text("# A guide\n\n## Its part\n")
    (tmp_path / "picture.png").write_bytes(b"")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Front\n[ok](guide.md#its-part) [ok](#front) ![ok](picture.png) `[code](nowhere.md)`\n"
        "```\n[code](nowhere.md)\n```\n"
        "[gone](missing.md) [bad anchor](guide.md#its_part) [not markdown](picture.png#x)\n"
        "[outside](../elsewhere.md) [here](#nothing) [web](https://example.org/a#b)\n"
        "[bad web](http:///a) [bad web](htps://example.org) [bad web](https//example.org)\n"
    )
    problems = broken(readme, root=tmp_path)
    assert [p.split("(")[1].split(")")[0] for p in problems] == [
        "missing.md",
        "guide.md#its_part",
        "picture.png#x",
        "../elsewhere.md",
        "#nothing",
        "https//example.org",
    ]
    assert [p.split("(")[1].split(")")[0] for p in malformed(readme)] == [
        "http:///a",
        "htps://example.org",
    ]
