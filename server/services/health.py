"""Readiness of the gateway's dependencies: the database, the queue and (cluster) the worker deployments.

In the Ray wiring every deployment replica heartbeats into Redis and the deployer declares which deployments must
exist (jobqueue/heartbeats.py); the queue's `health()` reports both, so the gateway is ready when the database and
the queue answer and each declared deployment has a live replica. In embedded mode the queue and the workers live
in this process.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy import text

from api_schemas.native.health import Check, DeploymentReport, Readiness
from server.services.context import Context

log = logging.getLogger(__name__)
_TIMEOUT = 2.0


async def readiness(ctx: Context) -> Readiness:
    checks = [await _database(ctx)]
    deployments: list[DeploymentReport] = []
    try:
        health = await asyncio.wait_for(ctx.queue.health(), 2 * _TIMEOUT)
    except TimeoutError:
        checks.append(Check(name="queue", ok=False, detail=f"no answer within {2 * _TIMEOUT:g} s"))
    else:
        checks.append(Check(name="queue", ok=health.ok, detail=health.detail))
        deployments = [
            DeploymentReport(name=d.name, kind=str(d.expected.get("kind", "")), base_model=d.expected.get("base_model"),
                             expected_replicas=int(d.expected.get("replicas", 1)), live_replicas=len(d.live),
                             ok=d.ready)
            for d in health.deployments
        ]
    checks.append(_models(ctx))
    ready = all(c.ok for c in checks) and all(d.ok for d in deployments)
    return Readiness(ready=ready, checks=checks, deployments=deployments)


def _models(ctx: Context) -> Check:
    """The served base models; those left out at start (`skip_failed_models`) are named with why. Ready while at
    least one is served (a cluster gateway's list fills as its workers register)."""
    served = ", ".join(sorted(ctx.models)) or "none yet"
    detail = f"served: {served}"
    if ctx.unavailable:
        detail += "; failed to load: " + "; ".join(f"{n} ({why})" for n, why in sorted(ctx.unavailable.items()))
    return Check(name="models", ok=bool(ctx.models) or not ctx.unavailable, detail=detail[:2000])


async def _database(ctx: Context) -> Check:
    async def ping() -> None:
        async with ctx.db.session() as s:
            await s.execute(text("SELECT 1"))

    try:
        await asyncio.wait_for(ping(), _TIMEOUT)
        return Check(name="database", ok=True)
    except Exception as e:  # noqa: BLE001 - any failure means not ready; the reason goes in the body
        return Check(name="database", ok=False, detail=f"{type(e).__name__}: {e}"[:300])
