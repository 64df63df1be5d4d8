"""Readiness of the gateway's dependencies: the database, the queue and (cluster) the worker deployments.

In the Ray wiring every deployment replica heartbeats into Redis and the deployer declares which deployments must
exist (jobqueue/heartbeats.py); the gateway is ready when the database and Redis answer and each declared deployment
has a live replica. In embedded mode the queue and the workers live in this process.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy import text

from api_schemas.native.health import Check, DeploymentReport, Readiness
from jobqueue.base import JobQueue
from server.services.context import Context

log = logging.getLogger(__name__)
_TIMEOUT = 2.0


async def readiness(ctx: Context) -> Readiness:
    checks = [await _database(ctx)]
    deployments: list[DeploymentReport] = []
    try:
        from jobqueue.redis_queue import RedisQueue
    except ImportError:  # no redis package: the in-process queue
        RedisQueue = None  # type: ignore[assignment,misc]
    queue = _backing(ctx.queue)
    if RedisQueue is not None and isinstance(queue, RedisQueue):
        check, deployments = await _redis(queue)
        checks.append(check)
    else:
        checks.append(Check(name="queue", ok=True, detail="in-process"))
    ready = all(c.ok for c in checks) and all(d.ok for d in deployments)
    return Readiness(ready=ready, checks=checks, deployments=deployments)


def _backing(queue: JobQueue) -> JobQueue:
    """The queue under the gateway's wrappers (e.g. the quota gate), which keep it as `inner`."""
    for _ in range(8):
        inner = getattr(queue, "inner", None)
        if not isinstance(inner, JobQueue):
            break
        queue = inner
    return queue


async def _database(ctx: Context) -> Check:
    async def ping() -> None:
        async with ctx.db.session() as s:
            await s.execute(text("SELECT 1"))

    try:
        await asyncio.wait_for(ping(), _TIMEOUT)
        return Check(name="database", ok=True)
    except Exception as e:  # noqa: BLE001 - any failure means not ready; the reason goes in the body
        return Check(name="database", ok=False, detail=f"{type(e).__name__}: {e}"[:300])


async def _redis(queue) -> tuple[Check, list[DeploymentReport]]:  # type: ignore[no-untyped-def]
    from jobqueue.heartbeats import Heartbeats

    try:
        await asyncio.wait_for(queue.client.ping(), _TIMEOUT)
        status = await asyncio.wait_for(Heartbeats(queue.client, queue.keys).status(), _TIMEOUT)
    except Exception as e:  # noqa: BLE001
        return Check(name="queue", ok=False, detail=f"redis: {type(e).__name__}: {e}"[:300]), []
    reports = [
        DeploymentReport(name=d.name, kind=str(d.expected.get("kind", "")), base_model=d.expected.get("base_model"),
                         expected_replicas=int(d.expected.get("replicas", 1)), live_replicas=len(d.live), ok=d.ready)
        for d in status
    ]
    return Check(name="queue", ok=True, detail="redis"), reports
