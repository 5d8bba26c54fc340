"""The built artifacts under test: ``dist/`` as ``make wheel`` leaves it.

Building takes a minute or two (a release build linked by zig), so the suite
does not build: it checks what ``make wheel`` built, and only if that was built
from this checkout (the wheel's Python files are the checkout's). When there is
none, or only a stale one, the tests are skipped, and fail under ``CI=true``,
where ``.ci/run`` builds it first. ``BUCKETLIMIT_DIST`` names another folder.
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "bucketlimit"
# What the artifacts are built from: a change to any of these makes dist/ stale.
BUILT_FROM = (
    "python/",
    "src/",
    "Cargo.toml",
    "Cargo.lock",
    "pyproject.toml",
    "LICENSE",
    "README.md",
)


def unavailable(reason: str) -> NoReturn:
    """Skips the test, or fails it under CI=true, where the check must run."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the packaging tests must run)", pytrace=False)
    pytest.skip(reason)


def without_rust() -> dict[str, str]:
    """This environment with no Rust toolchain reachable: PATH without cargo or rustc."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CARGO", "RUSTUP", "RUST"))}
    folders = os.environ.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join(
        folder
        for folder in folders
        if not any(shutil.which(tool, path=folder) for tool in ("cargo", "rustc"))
    )
    for tool in ("cargo", "rustc", "rustup"):
        assert shutil.which(tool, path=env["PATH"]) is None, tool
    return env


@dataclass(frozen=True)
class Dist:
    wheel: Path
    sdist: Path


def package_sources() -> dict[str, bytes]:
    """The package's files as a wheel holds them: path under bucketlimit/ -> bytes."""
    return {
        "bucketlimit/" + path.relative_to(PACKAGE).as_posix(): path.read_bytes()
        for path in sorted(PACKAGE.rglob("*"))
        if path.is_file() and path.suffix not in {".so", ".pyc"} and "__pycache__" not in path.parts
    }


@pytest.fixture(scope="session")
def dist() -> Dist:
    folder = Path(os.environ.get("BUCKETLIMIT_DIST", ROOT / "dist"))
    wheels = sorted(folder.glob("bucketlimit-*.whl"))
    sdists = sorted(folder.glob("bucketlimit-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        unavailable(
            f"{folder} holds {len(wheels)} wheels and {len(sdists)} sdists, not one of each:"
            " run `make wheel`"
        )
    wheel, sdist = wheels[0], sdists[0]
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = {
            name: archive.read(name)
            for name in archive.namelist()
            if name.startswith("bucketlimit/") and not name.endswith(".so")
        }
    with tarfile.open(sdist) as archive:
        in_sdist = {
            member.name.split("/", 1)[1]: archive.extractfile(member).read()  # type: ignore[union-attr]
            for member in archive.getmembers()
            if member.isfile() and member.name.split("/", 1)[1].startswith(BUILT_FROM)
        }
    checkout = {
        path.relative_to(ROOT).as_posix(): path.read_bytes()
        for name in BUILT_FROM
        for path in ([ROOT / name] if (ROOT / name).is_file() else (ROOT / name).rglob("*"))
        if path.is_file() and path.suffix not in {".so", ".pyc"} and "__pycache__" not in path.parts
    }
    # maturin's sdist holds the package alone: the workspace's members (the Redis
    # module, module/, which the wheel ships built) are dropped from its Cargo.toml.
    checkout["Cargo.toml"] = re.sub(
        rb"^(default-)?members = .*\n", b"", checkout["Cargo.toml"], flags=re.MULTILINE
    )
    if in_wheel != package_sources() or in_sdist != checkout:
        unavailable(f"{folder} was built from other sources than this checkout: run `make wheel`")
    return Dist(wheel, sdist)
