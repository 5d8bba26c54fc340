"""The CPython interpreters the packaging tests and CI install the wheel into.

pyenv's builds (``~/.pyenv/versions/3.X.Y/bin/python3.X``) first, then the
system's. A free-threaded build (``3.13t``) is not one of them: the abi3 wheel
does not install there (docs/design.md §8).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

#: Every version the package supports (``requires-python`` and the classifiers).
VERSIONS = ("3.10", "3.11", "3.12", "3.13")


def find_python(version: str) -> Path | None:
    """A GIL-enabled CPython ``version`` ("3.12") on this machine, or None."""
    pyenv = sorted(
        Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"),
        key=lambda path: [int(part) for part in path.parts[-3].split(".") if part.isdigit()],
        reverse=True,
    )
    system = [Path(f"/usr/bin/python{version}"), Path(f"/usr/local/bin/python{version}")]
    for candidate in [*pyenv, *system]:
        if candidate.is_file() and _reports(candidate, version):
            return candidate
    return None


def _reports(python: Path, version: str) -> bool:
    probe = (
        "import sys, sysconfig; print('%d.%d' % sys.version_info[:2],"
        " bool(sysconfig.get_config_var('Py_GIL_DISABLED')))"
    )
    try:
        answer = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return answer.stdout.split() == [version, "False"]
