"""The build backend: maturin's, except that it never downloads a Rust toolchain.

pip builds bucketlimit from source (``pip install .``, or an sdist) by calling this
module (``[build-system]`` in pyproject.toml). maturin's own backend, finding no
``cargo`` on PATH, fetches a toolchain from the network into a temporary folder;
here a build without Rust stops at once with a message that says what to do.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

# Read by maturin's backend on every call: never fetch a toolchain.
os.environ["MATURIN_NO_INSTALL_RUST"] = "1"

import maturin  # type: ignore[import-untyped]  # after the variable: read at import too

NO_RUST = """
bucketlimit: cannot build from source, `cargo` (Rust) is not on PATH.

Its core is Rust: building it needs a Rust toolchain (stable, >= 1.85), e.g.
from your system's packages or https://rustup.rs, with `cargo` on PATH. This
build does not download one. Or install a prebuilt wheel: `make wheel`, run in a
checkout on a machine with Rust, builds one for CPython 3.10+ on glibc 2.17+.
"""

F = TypeVar("F", bound=Callable[..., Any])


def _needs_rust(hook: F) -> F:
    @wraps(hook)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if shutil.which("cargo") is None:
            sys.stderr.write(NO_RUST)
            sys.exit(1)
        return hook(*args, **kwargs)

    return checked  # type: ignore[return-value]


build_wheel = _needs_rust(maturin.build_wheel)
build_sdist = _needs_rust(maturin.build_sdist)
build_editable = _needs_rust(maturin.build_editable)
prepare_metadata_for_build_wheel = _needs_rust(maturin.prepare_metadata_for_build_wheel)


# No Rust needed to answer these; with the variable set they ask for nothing to fetch one.
get_requires_for_build_wheel = maturin.get_requires_for_build_wheel
get_requires_for_build_sdist = maturin.get_requires_for_build_sdist
get_requires_for_build_editable = maturin.get_requires_for_build_editable
