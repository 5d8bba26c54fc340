"""The README's Development section and the Makefile it runs, as a newcomer meets them.

``make -n`` prints what a target would run without running it, so the
Makefile's output is checked without building anything.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def dry_run(*args: str) -> list[str]:
    if shutil.which("make") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("make is not installed (CI=true: the Makefile must be checked)")
        pytest.skip("make is not installed")
    result = subprocess.run(
        ["make", "--no-print-directory", "-n", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.splitlines()


@pytest.mark.parametrize("target", ["install", "build"])
def test_no_stray_rm_without_stale_extensions(target: str) -> None:
    """The README's first command prints no bare ``rm -f`` when nothing is stale."""
    lines = dry_run(target, "STALE_EXTENSIONS=")
    assert not [line for line in lines if line.startswith("rm")], lines
    stale = "python/bucketlimit/_core.cpython-311-x86_64-linux-gnu.so"
    assert f"rm -f {stale}" in dry_run(target, f"STALE_EXTENSIONS={stale}")


def test_install_says_the_silent_build_takes_a_while() -> None:
    lines = dry_run("install", "STALE_EXTENSIONS=")
    notes = [line for line in lines if line.startswith("echo ")]
    assert len(notes) == 1, lines
    assert "Rust extension" in notes[0]
    assert "half a minute or more" in notes[0]
    # Said before the step that builds.
    build = next(i for i, line in enumerate(lines) if "pip install -q -e ." in line)
    assert lines.index(notes[0]) == build - 1


@pytest.mark.timeout(120)  # a hang guard: a pytest run of its own, 2 s idle, 30 s at load 14
def test_readme_counts_the_tests_that_wait_for_make_wheel(tmp_path: Path) -> None:
    """The README's number is what a checkout without ``dist/`` skips."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    said = re.search(r"the (\d+) tests of `tests/packaging` that check the release wheel", readme)
    assert said, "README.md's Development section says how many tests wait for make wheel"
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["BUCKETLIMIT_DIST"] = str(tmp_path)  # an empty dist/
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/packaging",
            "--deselect",
            "tests/packaging/test_dev_commands.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    summary = result.stdout.strip().splitlines()[-1]
    skipped = re.search(r"(\d+) skipped", summary)
    assert result.returncode == 0, result.stdout
    assert skipped, summary
    assert int(skipped[1]) == int(said[1]), summary
    assert "failed" not in summary


def test_classifiers_name_the_versions_the_suite_runs_on() -> None:
    """The classifiers list exactly the versions the suite runs on
    (tests/packaging/pythons.py), checked without make wheel."""
    tomllib = pytest.importorskip("tomllib")  # 3.11+; tests/packaging runs on the venv's
    from scripts.ci_pythons import DEFAULT_VERSIONS
    from tests.packaging.pythons import VERSIONS

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    versions = [
        c.rsplit(" :: ", 1)[1]
        for c in project["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    assert versions == list(VERSIONS)
    assert set(DEFAULT_VERSIONS) <= set(VERSIONS)  # CI's other Pythons are among them
    assert project["requires-python"] == f">={VERSIONS[0]}"
