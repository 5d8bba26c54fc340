"""Makes sure the servers the tests start exist, installing Debian's packages when missing:
redis-server and redis-cli (``redis-server``), and Prometheus (``prometheus``, which
tests/recipes/test_dashboard.py runs the LLM gateway's dashboard queries through).

The tests start their own servers on free loopback ports, with their own
configuration; they only need the binaries. A package may start a system service
(Redis on 6379, Prometheus on 9090): the tests never use it. Installing needs root
(as in CI); elsewhere this prints what to run.
"""

import os
import shutil
import subprocess
import sys

#: Debian package -> the binaries the tests need from it.
PACKAGES = {"redis-server": ("redis-server", "redis-cli"), "prometheus": ("prometheus",)}


def main() -> int:
    missing = [
        package
        for package, binaries in PACKAGES.items()
        if not all(shutil.which(binary) for binary in binaries)
    ]
    if not missing:
        return 0
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print(
            f"missing: {', '.join(missing)}: install them (e.g. `sudo apt-get install -y "
            f"{' '.join(missing)}`); without them their tests are skipped, and fail under "
            "CI=true",
            file=sys.stderr,
        )
        return 0
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
