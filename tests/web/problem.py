"""What every refusal body is: an RFC 9457 problem with draft-11's members."""

from __future__ import annotations

from typing import Any

QUOTA_EXCEEDED = "https://iana.org/assignments/http-problem-types#quota-exceeded"
QUOTA_SPENT = "tag:bucketlimit,2026:quota-spent"
COST_ABOVE_CAPACITY = "tag:bucketlimit,2026:cost-above-capacity"
TYPES = {429: QUOTA_EXCEEDED, 403: QUOTA_SPENT, 413: COST_ABOVE_CAPACITY}
MEMBERS = {"type", "title", "status", "detail", "violated-policies", "retry_after"}


def assert_problem(body: Any, status: int, policy: str, retry_after: int | None) -> None:
    """``body`` is the problem a refusal by ``policy`` with ``status`` must be."""
    assert isinstance(body, dict), body
    assert set(body) == MEMBERS, body
    assert body["type"] == TYPES[status]
    assert body["status"] == status
    assert body["violated-policies"] == [policy]
    assert body["retry_after"] == retry_after
    assert isinstance(body["title"], str)
    assert body["title"]
    assert isinstance(body["detail"], str)
    assert policy in body["detail"]
