"""The README's links work in a checkout, offline: a link into the repository is
relative and names a file (and a heading) that exists, as tests/docs checks the
other documents' links. (The project is installed from a checkout, not from a
package index, where relative links would need rewriting.)
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOME = "https://github.com/bucketlimit/bucketlimit"

LINK = re.compile(r"\]\(([^)\s]+)\)")


def readme_links() -> list[str]:
    return LINK.findall((ROOT / "README.md").read_text(encoding="utf-8"))


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    text = re.sub(r"^```.*?^```$", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    headings = re.findall(r"^#{1,6} (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_no_readme_link_leaves_the_checkout_for_the_projects_own_files() -> None:
    links = readme_links()
    assert len(links) >= 10, links  # the pattern finds the README's links
    home = [link for link in links if link.startswith(HOME)]
    assert home == [], f"links to the project's files that need a network: {home}"


def test_relative_links_name_files_and_headings_that_exist() -> None:
    checked = 0
    for link in readme_links():
        if link.startswith(("https://", "http://", "mailto:")):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        assert target.exists(), f"{link}: {path} is not in the repository"
        if anchor:
            assert anchor in anchors(target), f"{link}: no heading #{anchor} in {target.name}"
        checked += 1
    assert checked >= 10, f"only {checked} links into the repository"
