"""What a package index and a dependency scanner read: the built wheel and sdist.

Everything here is read from the artifacts ``make wheel`` built (conftest.py),
not from pyproject.toml: tags, the extension's glibc needs and stripping, the
metadata (PEP 639 license, URLs, classifiers, no dev tools in the extras), and
the LICENSE file in both.
"""

from __future__ import annotations

import email.parser
import platform
import re
import shutil
import subprocess
import tarfile
import zipfile
from email.message import Message
from pathlib import Path

import pytest

from tests.packaging.conftest import ROOT, Dist
from tests.packaging.pythons import VERSIONS

HOME = "https://github.com/bucketlimit/bucketlimit"


def wheel_metadata(dist: Dist) -> Message:
    with zipfile.ZipFile(dist.wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.BytesParser().parsebytes(archive.read(name))


def sdist_metadata(dist: Dist) -> Message:
    with tarfile.open(dist.sdist) as archive:
        member = archive.extractfile(f"{sdist_root(dist)}/PKG-INFO")
        assert member is not None
        return email.parser.BytesParser().parsebytes(member.read())


def sdist_root(dist: Dist) -> str:
    return dist.sdist.name.removesuffix(".tar.gz")


@pytest.fixture(params=["wheel", "sdist"])
def metadata(request: pytest.FixtureRequest, dist: Dist) -> Message:
    return wheel_metadata(dist) if request.param == "wheel" else sdist_metadata(dist)


def test_the_wheel_is_abi3_and_manylinux2014(dist: Dist) -> None:
    name, version, python, abi, platforms = dist.wheel.name.removesuffix(".whl").split("-")
    assert (name, python, abi) == ("bucketlimit", "cp310", "abi3")
    machine = platform.machine()
    assert platforms.split(".") == [f"manylinux2014_{machine}", f"manylinux_2_17_{machine}"]
    with zipfile.ZipFile(dist.wheel) as archive:
        extensions = sorted(n for n in archive.namelist() if n.endswith(".so"))
        wheel_file = archive.read(f"bucketlimit-{version}.dist-info/WHEEL").decode()
    assert extensions == sorted(SHARED_OBJECTS), "the extension and the Redis module"
    assert f"Tag: cp310-abi3-manylinux_2_17_{machine}" in wheel_file


#: The shared objects the wheel ships: the Python extension and the Redis/Valkey module
#: (bucketlimit.redis.module_path()), both for the wheel's glibc baseline.
SHARED_OBJECTS = ("bucketlimit/_core.abi3.so", "bucketlimit/bucketlimit-redis.so")


@pytest.fixture(scope="module", params=SHARED_OBJECTS)
def extension(
    dist: Dist, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Path:
    if shutil.which("objdump") is None:  # binutils: wherever the extension can be built
        pytest.fail("objdump (binutils) is needed to read the extension's symbols")
    folder = tmp_path_factory.mktemp("extension")
    with zipfile.ZipFile(dist.wheel) as archive:
        return Path(archive.extract(request.param, folder))


def test_the_extension_needs_nothing_newer_than_glibc_2_17(extension: Path) -> None:
    dynamic = subprocess.run(
        ["objdump", "-T", extension], capture_output=True, text=True, check=True
    ).stdout
    versions = {tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_([0-9.]+)\b", dynamic)}
    assert versions, "the extension references no versioned glibc symbol at all?"
    assert max(versions) <= (2, 17), sorted(versions)
    needed = subprocess.run(
        ["objdump", "-p", extension], capture_output=True, text=True, check=True
    ).stdout
    libraries = set(re.findall(r"NEEDED\s+(\S+)", needed))
    # glibc's own libraries only (manylinux2014's list): no libpython, nothing to vendor.
    glibc = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1"}
    assert {lib for lib in libraries if not lib.startswith("ld-linux")} <= glibc | {"libgcc_s.so.1"}
    assert "libc.so.6" in libraries


def test_the_extension_is_stripped(extension: Path) -> None:
    sections = subprocess.run(
        ["objdump", "-h", extension], capture_output=True, text=True, check=True
    ).stdout
    assert ".text" in sections  # the listing is real ...
    assert ".symtab" not in sections
    assert ".debug_info" not in sections


def test_metadata_names_the_license_the_project_and_its_home(metadata: Message) -> None:
    assert metadata["Name"] == "bucketlimit"
    assert metadata["License-Expression"] == "MIT"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert metadata["Requires-Python"] == ">=3.10"
    assert metadata["Author"] == "The bucketlimit authors"
    assert metadata["Maintainer"] == "The bucketlimit authors"
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL", []))
    assert set(urls) >= {"Homepage", "Source", "Documentation", "Issues"}, urls
    assert all(url.startswith(HOME) for url in urls.values()), urls
    assert metadata["Description-Content-Type"].startswith("text/markdown")
    assert "# bucketlimit" in metadata.get_payload()  # the README is the long description


def test_classifiers_say_versions_frameworks_typing_and_status(metadata: Message) -> None:
    classifiers = set(metadata.get_all("Classifier", []))
    versions = {c.rsplit(" :: ", 1)[1] for c in classifiers if re.fullmatch(r".*:: 3\.\d+", c)}
    assert versions == set(VERSIONS)
    assert {
        "Framework :: Flask",
        "Framework :: FastAPI",
        "Framework :: Django",
        "Typing :: Typed",
        "Programming Language :: Rust",
    } <= classifiers
    assert len([c for c in classifiers if c.startswith("Development Status :: ")]) == 1
    # PEP 639: with a License-Expression, no license classifier.
    assert not [c for c in classifiers if c.startswith("License :: ")]


def test_no_dev_tools_in_the_published_dependencies(metadata: Message) -> None:
    extras = set(metadata.get_all("Provides-Extra", []))
    assert "dev" not in extras
    assert {"redis", "flask", "fastapi"} <= extras
    requirements = metadata.get_all("Requires-Dist", [])
    tools = ("pytest", "hypothesis", "ruff", "mypy", "maturin", "ziglang", "uvicorn", "httpx")
    # httpx is the client the `httpx` extra wraps (bucketlimit.httpx), a test tool anywhere else.
    named = [
        re.match(r"[A-Za-z0-9_.-]+", r).group()  # type: ignore[union-attr]
        for r in requirements
        if not re.search(r"""extra == ["']httpx["']""", r)
    ]
    assert not set(named) & set(tools), requirements
    assert any(r.startswith("httpx") and "extra == 'httpx'" in r for r in requirements)
    # Every requirement belongs to an extra: the core installs nothing.
    assert all("extra ==" in r for r in requirements), requirements


def test_license_file_is_in_the_wheel_and_the_sdist(dist: Dist) -> None:
    license_text = (ROOT / "LICENSE").read_bytes()
    assert license_text.startswith(b"MIT License")
    with zipfile.ZipFile(dist.wheel) as archive:
        licenses = [n for n in archive.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert [archive.read(n) for n in licenses] == [license_text]
    with tarfile.open(dist.sdist) as archive:
        member = archive.extractfile(f"{sdist_root(dist)}/LICENSE")
        assert member is not None
        assert member.read() == license_text


def test_the_sdist_builds_with_the_backend_that_refuses_to_download_rust(dist: Dist) -> None:
    with tarfile.open(dist.sdist) as archive:
        names = set(archive.getnames())
    root = sdist_root(dist)
    assert {f"{root}/pyproject.toml", f"{root}/scripts/build_backend.py"} <= names
    assert f"{root}/src/lib.rs" in names
    assert f"{root}/Cargo.lock" in names
