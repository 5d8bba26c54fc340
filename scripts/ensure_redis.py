"""Makes sure redis-server and redis-cli exist (or, with ``--libclang``, the libclang
that building the Redis module's bindings needs), installing Debian's package when
missing.

The Redis tests start their own servers on free loopback ports; they only need the
binaries. The module's build (``make module``) runs bindgen, which loads libclang.
Installing needs root (as in CI); elsewhere this prints what to run.
"""

import os
import re
import shutil
import subprocess
import sys


def main(argv: list[str]) -> int:
    if argv == ["--libclang"]:
        # libclang-14.so.1 and the like (not libclang-cpp), which find_library misses.
        listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
        found = re.search(r"\blibclang(-[0-9.]+)?\.so", listed) is not None
        package, why = "libclang-dev", "building the Redis module (make module) needs it"
    else:
        found = bool(shutil.which("redis-server") and shutil.which("redis-cli"))
        package = "redis-server"
        why = "without it the Redis tests are skipped, and fail under CI=true"
    if found:
        return 0
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print(
            f"{package} is missing: install it (e.g. `sudo apt-get install -y {package}`); {why}",
            file=sys.stderr,
        )
        return 1 if package == "libclang-dev" else 0
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", package], check=True, env=env)
    # redis-server's package starts a system service on port 6379; the tests never use it.
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
