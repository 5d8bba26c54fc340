"""``--service`` and ``--service-dist``: how long each request of the concurrency mode
runs, in integer microseconds, drawn from a seeded generator of its own."""

from __future__ import annotations

import math
import random

from bucketlimit._core import clock_to_micros
from bucketlimit._simulate.model import SimulationError

#: fixed: every request runs ``--service`` seconds; exponential: random, memoryless, with
#: that mean (an M/M/c queue's); lognormal: that mean with a long tail (sigma 1: the
#: median is 0.61 of the mean, one request in 20 runs over 3.1 times it), the shape of
#: LLM generations and report jobs.
DISTRIBUTIONS = ("fixed", "exponential", "lognormal")
LOGNORMAL_SIGMA = 1.0


def checked_service(seconds: float, distribution: str) -> float:
    """``--service`` in seconds (a finite number > 0, at least 1 µs), or a usage error."""
    if distribution not in DISTRIBUTIONS:
        raise SimulationError(
            f"unknown service distribution {distribution!r}: choose from {DISTRIBUTIONS}"
        )
    try:
        micros = clock_to_micros(seconds)
    except (TypeError, ValueError):
        micros = 0
    if micros <= 0:
        raise SimulationError(
            f"service must be a finite number of seconds >= 1e-06, got {seconds!r}"
        )
    return float(seconds)


def service_times(distribution: str, mean: float, count: int, seed: int) -> list[int]:
    """``count`` service times in microseconds (each at least 1), from a generator
    seeded apart from the arrivals' (so ``--seed`` moves both, and changing the
    distribution leaves a poisson pattern's arrivals as they were)."""
    if distribution == "fixed":
        return [max(1, clock_to_micros(mean))] * count
    rng = random.Random(f"service:{seed}")
    if distribution == "exponential":
        draws = (rng.expovariate(1 / mean) for _ in range(count))
    else:  # lognormal with this mean: exp(mu + sigma^2 / 2) = mean
        mu = math.log(mean) - LOGNORMAL_SIGMA**2 / 2
        draws = (rng.lognormvariate(mu, LOGNORMAL_SIGMA) for _ in range(count))
    return [max(1, round(draw * 1e6)) for draw in draws]
