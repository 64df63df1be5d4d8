"""Table-driven tests of the pure scheduler: seq_id order, held-back early arrivals, gaps, duplicates."""

from __future__ import annotations

import pytest

from api_schemas.jobs import Job, Skip
from workers.scheduler import Scheduler


def job(model: str, seq: int) -> Job:
    return Job(
        job_id=f"{model}-{seq}", tenant_id="t", base_model="b", model_id=model, seq_id=seq,
        payload=Skip(reason="test"), result_type="Skip",
    )


@pytest.mark.parametrize(
    "arrivals, expected",
    [
        ([("m", 0), ("m", 1), ("m", 2)], [("m", 0), ("m", 1), ("m", 2)]),
        # chunks sent in parallel, first chunk last: nothing runs until seq 1 arrives
        ([("m", 0), ("m", 3), ("m", 2), ("m", 1), ("m", 4)], [("m", 0), ("m", 1), ("m", 2), ("m", 3), ("m", 4)]),
        ([("m", 2), ("m", 1)], []),  # seq 0 (create) never came: everything waits
        ([("a", 0), ("b", 0), ("b", 1), ("a", 2)], [("a", 0), ("b", 0), ("b", 1)]),
    ],
)
def test_order(arrivals: list[tuple[str, int]], expected: list[tuple[str, int]]) -> None:
    s = Scheduler(gap_timeout=100)
    ran = []
    for model, seq in arrivals:
        assert s.add(job(model, seq), now=0) is None
        ran += [(j.model_id, j.seq_id) for j in s.pop_ready(now=0)]
    assert ran == expected


def test_gap_is_skipped_after_timeout() -> None:
    s = Scheduler(gap_timeout=10)
    s.add(job("m", 0), now=0)
    assert [j.seq_id for j in s.pop_ready(now=0)] == [0]
    s.add(job("m", 2), now=1)
    s.add(job("m", 3), now=2)
    assert s.pop_ready(now=5) == []
    assert s.next_deadline() == 11
    assert [j.seq_id for j in s.pop_ready(now=11)] == [2, 3]
    assert s.waiting() == 0


@pytest.mark.parametrize("seq, reason", [(0, "already executed"), (1, "already queued")])
def test_rejects_stale_and_duplicate(seq: int, reason: str) -> None:
    s = Scheduler(gap_timeout=10)
    s.add(job("m", 0), now=0)
    s.pop_ready(now=0)
    s.add(job("m", 2), now=0)
    s.add(job("m", 1), now=0) if seq == 1 else None
    rejection = s.add(job("m", seq), now=0)
    assert rejection is not None and reason in rejection.reason
