"""Makes sure redis-server and redis-cli exist, installing Debian's package when missing.

The Redis tests start their own servers on free loopback ports; they only need the
binaries. Installing needs root (as in CI); elsewhere this prints what to run.
"""

import os
import shutil
import subprocess
import sys


def main() -> int:
    if shutil.which("redis-server") and shutil.which("redis-cli"):
        return 0
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print(
            "redis-server is missing: install it (e.g. `sudo apt-get install -y redis-server`);"
            " without it the Redis tests are skipped, and fail under CI=true",
            file=sys.stderr,
        )
        return 0
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], check=True, env=env)
    # The package starts a system service on port 6379; the tests never use it.
    return 0


if __name__ == "__main__":
    sys.exit(main())
