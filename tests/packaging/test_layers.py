"""The package's import graph has no circle (docs/design.md §8), type-only imports
included: a module that needs another's names imports it, never the reverse."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "bucketlimit"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, at any level of the file."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # ``from pkg import sub`` imports the module pkg.sub; ``from mod import name``
            # the module mod.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def test_no_module_of_the_package_imports_one_that_imports_it_back() -> None:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    paths["bucketlimit._core"] = PACKAGE / "_core.pyi"  # the extension: its stub
    graph = {name: imports(path, set(paths)) for name, path in paths.items()}
    # A package imports its submodules by nature; the edge back is what counts.
    circles = []
    for start in graph:
        stack, seen = [(start, [start])], {start}
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start and not start.startswith(f"{node}."):
                    circles.append(" -> ".join([*trail, nxt]))
                elif nxt not in seen and not nxt.startswith(f"{start}."):
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    assert circles == [], "import circles:\n" + "\n".join(sorted(set(circles)))
