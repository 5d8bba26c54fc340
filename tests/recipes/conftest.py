"""The recipes' fixtures: the real redis-server (tests/support/redis_servers.py), and
the LLM gateway of docs/recipes/llm-gateway.md with one run of its callers, shared
by tests/recipes/test_llm_gateway.py and test_dashboard.py (starting the provider
and two gateway workers takes a while on a busy machine)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from tests.recipes.gateway import Run, Shape, Stack, gateway_stack, run_callers
from tests.support.redis_servers import *  # noqa: F403
from tests.support.redis_servers import RedisServer

#: A few seconds of traffic, the limits per 10 s: the batch user's four threads
#: outrun its tokens at once and wait; the interactive users stay within theirs.
SCALE = Shape(
    window=10,
    rpm=20,
    tpm=1_500,
    org_tpm=4_000,
    generations=2,
    provider_tokens=6_000,
    provider_requests=1_000,
    provider_slots=6,
    provider_speed=2_000,
    interactive=2,
    batch=1,
    batch_threads=4,
    duration=4,
    think=0.3,
    interactive_tokens=(50, 150),
    interactive_chars=(100, 300),
    batch_tokens=(100, 300),
    batch_chars=(100, 400),
    max_wait=30,
    org_wait=5,
    max_retries=2,
    workers=2,
    prefix="test-llm-gateway:",
    # A busy machine must not make Redis look down: the limits would then answer from
    # each worker's share (degraded), which the exactness checks do not allow for.
    store_timeout=10,
)


@pytest.fixture(scope="package")
def stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prefix = f"{SCALE.prefix}{time.monotonic_ns()}:"  # fresh buckets on the shared server
    shape = replace(SCALE, prefix=prefix)
    with gateway_stack(shape, redis_server.url, tmp_path_factory.mktemp("gateway")) as running:
        yield running


@pytest.fixture(scope="package")
def run(stack: Stack) -> Run:
    """The callers' run, once for the package's tests."""
    return run_callers(stack, seed=35)
