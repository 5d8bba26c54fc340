"""The README is also the package index's project page: its links must work there.

On an index a relative link resolves against the index's own address and breaks, so
every link in README.md is absolute; those into the project's home must name a file
(and a heading) that exists in this repository, as tests/docs checks relative links.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOME = "https://github.com/bucketlimit/bucketlimit"
# A file of the repository as the project's home shows it: blob/ for pages, raw/ for images.
IN_HOME = re.compile(re.escape(HOME) + r"/(?:blob|raw)/main/([^)#\s]+)(?:#([^)\s]*))?$")

LINK = re.compile(r"\]\(([^)\s]+)\)")


def readme_links() -> list[str]:
    return LINK.findall((ROOT / "README.md").read_text(encoding="utf-8"))


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    text = re.sub(r"^```.*?^```$", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    headings = re.findall(r"^#{1,6} (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_readme_link_is_absolute() -> None:
    links = readme_links()
    assert len(links) >= 10, links  # the pattern finds the README's links
    relative = [link for link in links if not link.startswith("https://")]
    assert relative == [], f"relative links break on a package index: {relative}"


def test_links_into_the_project_home_name_files_and_headings_that_exist() -> None:
    checked = 0
    for link in readme_links():
        if link.startswith(HOME + "#"):
            anchor = link.removeprefix(HOME + "#")
            assert anchor in anchors(ROOT / "README.md"), f"no README heading for {link}"
            checked += 1
        elif link.startswith(HOME):
            match = IN_HOME.match(link)
            assert match, f"{link}: not a blob/ or raw/ address on main"
            path, anchor = match.groups()
            assert (ROOT / path).is_file(), f"{link}: {path} is not in the repository"
            if anchor:
                assert anchor in anchors(ROOT / path), f"{link}: no heading #{anchor} in {path}"
            checked += 1
    assert checked >= 10
