"""The in-process request bucket (embedded mode) with a fake clock, and the embedded mode's revocation bound: a
cached key is trusted until the gateway's next look at the newest key change (every `auth_check_seconds`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.auth.keys import KeyCache, PolledGeneration, sql_generation
from server.auth.rate_limits import RequestLimiter
from server.db.database import Database
from server.services import tenants


def test_request_bucket_burst_then_rate() -> None:
    now = [100.0]
    limiter = RequestLimiter(clock=lambda: now[0])

    def wait(tenant: str = "a") -> float:
        return asyncio.run(limiter.wait(tenant, 60, 3))  # one a second, three at once

    assert [wait() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert wait() == pytest.approx(1.0)  # empty: one token a second
    assert wait("b") == 0.0  # another tenant's bucket is full
    now[0] += 1.0
    assert wait() == 0.0 and wait() == pytest.approx(1.0)
    now[0] += 3600
    assert [wait() for _ in range(4)][-1] > 0  # refilled to the burst, never beyond
    # a changed quota applies to the same bucket: the tokens used stay used, the new rate refills it faster
    assert asyncio.run(limiter.wait("a", 6000, None)) == pytest.approx(0.01)


@pytest.mark.parametrize("every, after_revoke", [(0.0, None), (3600.0, "tenant")])
def test_embedded_revocation_bound_is_the_check_interval(tmp_path: Path, every: float, after_revoke: str | None
                                                          ) -> None:
    async def run() -> str | None:
        db = Database(f"sqlite+aiosqlite:///{tmp_path / 'k.db'}")
        await db.create_schema()
        try:
            key, key_id = await tenants.create_key(db, "acme")
            cache = KeyCache(3600, sql_generation(every))
            found = await cache.tenant(db.session, key)
            assert found is not None
            await tenants.revoke(db, key_id)
            again = await cache.tenant(db.session, key)
            return "tenant" if again == found else again
        finally:
            await db.close()

    assert asyncio.run(run()) == after_revoke


def test_generation_is_read_once_per_interval_and_a_failed_read_matches_nothing() -> None:
    reads: list[int] = []
    answers: list[object] = [1, ConnectionError("redis is down"), 2]

    async def read(_: object) -> object:
        reads.append(1)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def run() -> list[object]:
        gen = PolledGeneration(3600, read)
        seen = [await gen.current(None), await gen.current(None)]  # type: ignore[arg-type]
        gen._read_at -= 3600  # the interval passes
        failed = await gen.current(None)  # type: ignore[arg-type]
        seen.append(failed == 1)  # what entries cached under generation 1 are compared with
        seen.append(await gen.current(None))  # type: ignore[arg-type]  # read again at once after a failure
        return seen

    assert asyncio.run(run()) == [1, 1, False, 2] and len(reads) == 3


def test_request_limits_fail_open_without_redis() -> None:
    class Away:  # a Redis client whose every script call fails, as when Redis is down
        def register_script(self, _: str):  # type: ignore[no-untyped-def]
            async def call(**_: object) -> int:
                raise ConnectionError("redis is down")
            return call

    limiter = RequestLimiter(Away(), lambda t: f"bucket:{t}")
    assert asyncio.run(limiter.wait("a", 1, 1)) == 0.0  # the request goes; the limit is not applied meanwhile
