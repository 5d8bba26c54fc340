"""Workers in two processes against a mock provider whose true limits are 10 % below
what they are configured with, while a consumer outside bucketlimit spends 20 % of
its tokens (tests/upstream/scenario.py): with raw httpx, and after a 429 with the
real openai SDK through ``http_client=`` too (its own retries go through the
transport).

The provider's window is scaled down to half a second, so that a run of a few
windows shows in two seconds the pacing the bench (benches/upstream.py, which
measures the share of the provider's tokens the workers get) shows in twenty. Checked here:
once the first reports have come, no request of any worker gets 429 (nothing is
sent beyond what the provider allows); after a burst elsewhere drains the provider,
no worker's request arrives before a 429's Retry-After ends.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.upstream import scenario
from tests.upstream.scenario import Scale

# The bench's true rates (18,000 tokens and 900 requests a second, far more than 4
# threads would send unpaced) in half-second windows: the same pacing shows in a
# quarter of the time, from 2 processes of 2 threads.
SCALE = Scale(window=0.5, tokens=9_000, requests=450, processes=2, threads=2, windows=4)
# A request let through before a 429 was seen may still arrive after it: on a loaded
# 2-core machine a thread can wait this long between its turn and its send.
ON_ITS_WAY = 0.25

pytestmark = pytest.mark.timeout(90)


def test_workers_follow_a_provider_below_their_configuration(
    redis_url: str, tmp_path: Path
) -> None:
    with scenario.provider(SCALE, tmp_path / "provider.log") as url:
        run = scenario.run(SCALE, url, redis_url, "httpx")
    # From the end of the first window: by then every worker has had reports.
    ours = run.ours(since=SCALE.window)
    asked = sum(r[3] for r in ours)
    assert asked > SCALE.tokens, (
        f"the workers used {asked} tokens after the first window, less than one window "
        f"of the provider's ({SCALE.tokens}): they never had to follow it, nothing was tested"
    )
    refused = [r for r in ours if r[2] == 429]
    assert not refused, (
        f"{len(refused)} of {len(ours)} requests got 429: the workers sent more than the "
        "provider allowed"
    )


@pytest.mark.parametrize("client", ["httpx", "openai"])
def test_after_a_429_no_worker_sends_before_its_retry_after(
    client: str, redis_url: str, tmp_path: Path
) -> None:
    scale = dataclasses.replace(SCALE, windows=6)
    with scenario.provider(scale, tmp_path / "provider.log") as url:
        # A burst elsewhere drains the provider 1 s into the run.
        run = scenario.run(
            scale, url, redis_url, client, lambda start: scenario.drain(url, scale, start + 1)
        )
    ours = run.ours()
    holds = [(r[0], r[4]) for r in ours if r[2] == 429]
    assert holds, "the burst caused no 429: nothing was tested"
    for arrival, retry in holds:
        during = [r for r in ours if arrival + ON_ITS_WAY <= r[0] < arrival + retry]
        assert not during, f"{len(during)} requests during the {retry} s hold from {arrival}"
