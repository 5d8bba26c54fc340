"""CI on the other Python versions: the ``interpreters`` tests against the built wheel.

    python scripts/ci_pythons.py [3.10 3.13] [-- pytest arguments]

The whole suite runs on 3.11 (``make check``). One abi3 wheel serves every
version, so another interpreter must prove only what 3.11 has not: that the
wheel imports, the extension's ABI (conversions, errors, garbage collection,
threads), and the version-specific asyncio and typing paths. Those tests carry
the ``interpreters`` marker (pyproject.toml); they run on the oldest and the
newest supported versions (docs/design.md §8 says why not 3.14).

For each version: a fresh virtual environment in a temporary folder, the wheel
from ``dist/`` (``make wheel``) and the ``test`` dependency group installed, then
``pytest -m interpreters tests/core tests/redis`` from the checkout, so the tests
run against the installed wheel. A version whose interpreter is missing fails, as
does a run that collects no test. Prints the seconds each version took; exits
non-zero if any version failed.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.packaging.pythons import find_python  # noqa: E402  (needs ROOT on sys.path)

DEFAULT_VERSIONS = ("3.10", "3.13")
SUITES = ("tests/core", "tests/redis")
MARKER = "interpreters"
WHERE = "import bucketlimit._core as c, sys; print(sys.version.split()[0], c.__file__)"


def run_version(version: str, wheel: Path, scratch: Path, pytest_args: list[str]) -> bool:
    python = find_python(version)
    if python is None:
        print(f"FAILED: no CPython {version} found (pyenv's ~/.pyenv/versions/{version}.*)")
        return False
    venv = scratch / f"venv-{version}"
    target = venv / "bin" / "python"
    subprocess.run([python, "-m", "venv", venv], check=True)
    # --group (PEP 735) needs pip >= 25.1; the interpreters bring older ones.
    subprocess.run([target, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run(
        [target, "-m", "pip", "install", "-q", "--group", "test", wheel], check=True, cwd=ROOT
    )
    # From outside the checkout: the package must be the wheel's, not the source tree.
    subprocess.run([target, "-c", WHERE], check=True, cwd=scratch)
    pytest: list[str | Path] = [target, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    tests = subprocess.run([*pytest, "-m", MARKER, *SUITES, *pytest_args], cwd=ROOT)
    # pytest's 5 is "no tests collected": a run that tested nothing has failed too.
    return tests.returncode == 0


def main(argv: list[str]) -> int:
    versions, pytest_args = argv, []
    if "--" in argv:
        cut = argv.index("--")
        versions, pytest_args = argv[:cut], argv[cut + 1 :]
    wheels = sorted((ROOT / "dist").glob("bucketlimit-*.whl"))
    if len(wheels) != 1:
        print(f"FAILED: dist/ holds {len(wheels)} wheels, not one: run `make wheel` first")
        return 1
    results: dict[str, tuple[bool, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bucketlimit-pythons-") as scratch:
        for version in versions or DEFAULT_VERSIONS:
            print(
                f"=== CPython {version}: -m {MARKER} {' '.join(SUITES)} on {wheels[0].name}",
                flush=True,
            )
            start = time.monotonic()
            ok = run_version(version, wheels[0], Path(scratch), pytest_args)
            results[version] = (ok, time.monotonic() - start)
    print("\nCPython   result   seconds (venv + install + tests)")
    for version, (ok, seconds) in results.items():
        print(f"{version:<10}{'passed' if ok else 'FAILED':<9}{seconds:>7.0f}")
    return 0 if all(ok for ok, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
