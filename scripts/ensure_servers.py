"""Makes sure what the build and the tests need exists, installing Debian's packages
when missing: redis-server and redis-cli (``redis-server``), and Prometheus
(``prometheus``, which tests/recipes/test_dashboard.py runs the LLM gateway's
dashboard queries through); with ``--libclang``, the libclang that building the
Redis module's bindings needs (``libclang-dev``: bindgen loads it).

The tests start their own servers on free loopback ports, with their own
configuration; they only need the binaries. A package may start a system service
(Redis on 6379, Prometheus on 9090): the tests never use it. Installing needs root
(as in CI); elsewhere this prints what to run.
"""

import os
import re
import shutil
import subprocess
import sys

#: Debian package -> the binaries the tests need from it.
PACKAGES = {"redis-server": ("redis-server", "redis-cli"), "prometheus": ("prometheus",)}


def has_libclang() -> bool:
    # libclang-14.so.1 and the like (not libclang-cpp), which find_library misses.
    listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return re.search(r"\blibclang(-[0-9.]+)?\.so", listed) is not None


def main(argv: list[str]) -> int:
    if argv == ["--libclang"]:
        missing = [] if has_libclang() else ["libclang-dev"]
        why = "building the Redis module (make module) needs it"
    else:
        missing = [
            package
            for package, binaries in PACKAGES.items()
            if not all(shutil.which(binary) for binary in binaries)
        ]
        why = "without them their tests are skipped, and fail under CI=true"
    if not missing:
        return 0
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print(
            f"missing: {', '.join(missing)}: install them (e.g. `sudo apt-get install -y "
            f"{' '.join(missing)}`); {why}",
            file=sys.stderr,
        )
        return 1 if argv == ["--libclang"] else 0
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
