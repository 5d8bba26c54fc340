"""Building from source without Rust stops with a clear message and downloads nothing.

maturin's own backend, finding no ``cargo``, fetches a toolchain from the network;
scripts/build_backend.py (pyproject's ``[build-system]``) refuses instead. pip runs
the real PEP 517 build here, offline (``--no-index``, ``--no-build-isolation``:
the backend comes from this environment), with no Rust on PATH.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.packaging.conftest import ROOT, unavailable, without_rust

# The backend and its maturin from this environment; nothing from an index.
OFFLINE = ("--no-index", "--no-deps", "--no-build-isolation")


@pytest.mark.timeout(60)
def test_pip_without_rust_fails_with_a_message_and_fetches_no_toolchain(tmp_path: Path) -> None:
    if importlib.util.find_spec("maturin") is None:
        unavailable("maturin is not installed here (the dev group has it): `make install`")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", *OFFLINE, "--wheel-dir", tmp_path / "out", ROOT],
        capture_output=True,
        text=True,
        env=without_rust(),
        cwd=tmp_path,
    )
    output = build.stdout + build.stderr
    assert build.returncode != 0, output
    assert "bucketlimit: cannot build from source, `cargo` (Rust) is not on PATH." in output
    assert "https://rustup.rs" in output  # says where to get it ...
    assert "installing into a temporary directory" not in output  # ... and does not fetch it
    assert "puccinialin" not in output
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_the_backend_asks_for_nothing_that_would_fetch_rust() -> None:
    probe = (
        "import sys; sys.path.insert(0, 'scripts'); import build_backend as b;"
        " print(b.get_requires_for_build_wheel(), b.get_requires_for_build_sdist(),"
        " b.get_requires_for_build_editable())"
    )
    if importlib.util.find_spec("maturin") is None:
        unavailable("maturin is not installed here (the dev group has it): `make install`")
    answer = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=without_rust(),
        cwd=ROOT,
        check=True,
    )
    assert answer.stdout.split() == ["[]", "[]", "[]"]
