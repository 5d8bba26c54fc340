"""Every Python block of the README, ``docs/*.md`` and ``docs/recipes/*.md`` runs, as a
newcomer would paste it (from the repository root).

A block that defines ``test_*`` functions has them called too, with a fresh
``ManualClock`` for a ``manual_clock`` parameter. A block preceded by the line
``<!-- docs-test: redis -->`` gets a real server's address in ``REDIS_URL``
(the ``redis_url`` fixture of ``tests/redis_servers.py``, which the root
``tests/conftest.py`` loads as a plugin for every test under ``tests/``).

Each file must hold exactly the number of blocks listed in ``EXPECTED_BLOCKS``,
and every `````python`` fence in it must be one the pattern found, so a broken
pattern (or a file left out) cannot pass by running nothing.
"""

from __future__ import annotations

import inspect
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bucketlimit.testing import ManualClock

ROOT = Path(__file__).resolve().parents[2]

#: Python blocks per file, Redis ones included; a new doc or block changes this.
EXPECTED_BLOCKS: dict[str, int] = {
    "README.md": 9,
    "docs/benchmarks.md": 0,
    "docs/cli.md": 2,
    "docs/design.md": 1,
    "docs/metrics.md": 3,
    "docs/migrating.md": 5,
    "docs/recipes/llm-gateway.md": 1,
    "docs/redis.md": 9,
    "docs/upstream.md": 4,
    "docs/web.md": 18,
}
#: Of those, the blocks that need a Redis server.
EXPECTED_REDIS_BLOCKS: dict[str, int] = {
    "README.md": 1,
    "docs/recipes/llm-gateway.md": 1,
    "docs/redis.md": 6,
    "docs/upstream.md": 1,
    "docs/web.md": 1,
}

MARKER = "<!-- docs-test: redis -->"
BLOCK = re.compile(
    r"(?:^<!-- docs-test: (?P<needs>[a-z]+) -->\n)?^```python\n(?P<code>.*?)^```$",
    re.S | re.M,
)


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # of the block's first line of code
    needs: str  # "" or "redis"
    code: str


def doc_files() -> list[str]:
    found = [*(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "recipes").glob("*.md")]
    return ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in found)]


def blocks_of(path: str) -> list[Block]:
    text = (ROOT / path).read_text(encoding="utf-8")
    return [
        Block(
            path,
            text.count("\n", 0, match.start("code")) + 1,
            match.group("needs") or "",
            match.group("code"),
        )
        for match in BLOCK.finditer(text)
    ]


def all_blocks() -> list[Any]:
    return [
        pytest.param(
            block,
            id=f"{block.path}:{block.line}",
            marks=[pytest.mark.redis] if block.needs == "redis" else [],
        )
        for path in doc_files()
        for block in blocks_of(path)
    ]


def test_every_doc_has_its_expected_blocks() -> None:
    assert doc_files() == sorted(EXPECTED_BLOCKS, key=lambda p: (p != "README.md", p))
    for path in doc_files():
        text = (ROOT / path).read_text(encoding="utf-8")
        found = blocks_of(path)
        fences = re.findall(r"^```python$", text, re.M)
        assert len(found) == len(fences), f"{path}: a python fence the pattern missed"
        assert len(found) == EXPECTED_BLOCKS[path], path
        redis = [b for b in found if b.needs == "redis"]
        assert len(redis) == EXPECTED_REDIS_BLOCKS.get(path, 0), path
        assert text.count(MARKER) == len(redis), f"{path}: a marker not right above a block"
        assert "readme-test" not in text, f"{path}: the old marker name"
    assert sum(EXPECTED_BLOCKS.values()) >= 5


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    text = re.sub(r"^```.*?^```$", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    headings = re.findall(r"^#{1,6} (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_stay_inside_the_repository_and_resolve() -> None:
    for path in doc_files():
        text = (ROOT / path).read_text(encoding="utf-8")
        assert "../shared" not in text, path
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if "://" in target:
                continue
            resolved = ((ROOT / path).parent / target).resolve() if target else ROOT / path
            assert resolved.is_relative_to(ROOT), f"{path}: {target} leaves the repository"
            assert resolved.exists(), f"{path}: {target} does not exist"
            if anchor:
                assert anchor in anchors(resolved), f"{path}: no heading for {target}#{anchor}"


@pytest.mark.parametrize("block", all_blocks())
def test_doc_block_runs(block: Block, request: pytest.FixtureRequest) -> None:
    if block.needs == "redis":
        url: str = request.getfixturevalue("redis_url")
        monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setenv("REDIS_URL", url)
    # A real module, importable by name while it runs: frameworks that read a
    # handler's module to resolve its annotations (Litestar) find it.
    module = types.ModuleType("doc_block")
    monkeypatch_modules: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
    monkeypatch_modules.setitem(sys.modules, "doc_block", module)
    namespace: dict[str, Any] = vars(module)
    exec(compile(block.code, f"{ROOT / block.path}:{block.line}", "exec"), namespace)
    for name, value in namespace.items():
        if name.startswith("test_") and callable(value):
            params = inspect.signature(value).parameters
            value(**{p: ManualClock() for p in params if p == "manual_clock"})
