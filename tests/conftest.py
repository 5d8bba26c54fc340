"""Shared test configuration: hypothesis profiles.

``BUCKETLIMIT_HYPOTHESIS=thorough pytest`` runs the property tests with many
more examples; the default profile keeps the suite fast.
"""

import os

from hypothesis import settings

settings.register_profile("default", max_examples=60, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("BUCKETLIMIT_HYPOTHESIS", "default"))

pytest_plugins = ["redis_servers"]  # real redis-server fixtures (tests/redis_servers.py)
