"""Every Python block in the README runs, as a newcomer would paste it.

A block that defines ``test_*`` functions has them called too, with a fresh
``ManualClock`` for a ``manual_clock`` parameter. A block preceded by the line
``<!-- readme-test: redis -->`` gets a real server's address in ``REDIS_URL``.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from bucketlimit.testing import ManualClock

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(
    r"(?:<!-- readme-test: (?P<needs>[a-z]+) -->\n)?```python\n(?P<code>.*?)```", re.S
)


def blocks() -> list[Any]:
    text = README.read_text(encoding="utf-8")
    found = []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start("code")) + 1
        needs = match.group("needs") or ""
        marks = [pytest.mark.redis] if needs == "redis" else []
        found.append(pytest.param(match.group("code"), needs, id=f"line-{line}", marks=marks))
    return found


def test_readme_has_python_blocks() -> None:
    assert len(blocks()) >= 5


@pytest.mark.parametrize(("code", "needs"), blocks())
def test_readme_block_runs(code: str, needs: str, request: pytest.FixtureRequest) -> None:
    if needs == "redis":
        url = request.getfixturevalue("redis_url")
        request.getfixturevalue("monkeypatch").setenv("REDIS_URL", url)
    namespace: dict[str, Any] = {"__name__": "doc_block"}
    exec(compile(code, str(README), "exec"), namespace)
    for name, value in namespace.items():
        if name.startswith("test_") and callable(value):
            params = inspect.signature(value).parameters
            value(**{p: ManualClock() for p in params if p == "manual_clock"})
