"""Cluster wiring of `twinkle-server serve` (TWINKLE_REDIS_URL set): the gateway on the Redis queue.

The gateway runs no model unless `gateway_runs_worker` is set: it serves the base models that workers registered
in Redis (`twinkle-server worker`), following the registry as workers come and go, and keeps serving a model
while its worker restarts (the jobs wait in the stream). It also publishes the tenants' adapters-in-memory quotas
into Redis for the workers (`publish_resident_limits`; the Ray gateway does the same).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI

from api_schemas.models import ServedModel
from deploy.specs import (
    MIN_QUOTA_REFRESH_SECONDS,
    specs_from_settings,
    storage_from_settings,
)
from jobqueue.redis_queue import RedisQueue
from jobqueue.resident_limits import publish_resident_limits as publish
from server.app import Background, create_app
from server.auth.keys import SharedAuth, redis_generation
from server.auth.rate_limits import RequestLimiter
from server.config import Settings
from server.db.database import Database
from server.services.tenant_limits import TenantLimits, resident_adapter_limits
from workers.runtime import hub_pusher

log = logging.getLogger(__name__)


def redis_queue(settings: Settings) -> RedisQueue:
    if not settings.redis_url:
        raise ValueError("TWINKLE_REDIS_URL (or --redis-url) is required for the cluster wiring")
    return RedisQueue(
        settings.redis_url,
        prefix=settings.redis_prefix,
        result_ttl=settings.result_ttl_seconds,
        job_ttl=settings.job_ttl_seconds,
        lease_ttl=settings.worker_lease_seconds,
        reclaim_idle=settings.reclaim_idle_seconds,
    )


def shared_auth(queue: RedisQueue, check_seconds: float) -> SharedAuth:
    """The key generation and request buckets in the queue's Redis, so that every gateway sees a key change at once
    and a tenant's request rate is counted once across them (server/auth/keys.py, server/auth/rate_limits.py)."""
    return SharedAuth(redis_generation(queue.client, queue.keys.auth_generation, check_seconds),
                      RequestLimiter(queue.client, queue.keys.request_bucket))


def build_gateway_app(settings: Settings) -> FastAPI:
    queue = redis_queue(settings)
    served: dict[str, ServedModel] = {}
    limits = TenantLimits(settings)
    failed: dict[str, str] = {}
    background: list[Background] = [lambda: follow_registry(queue, served),
                                    lambda: publish_resident_limits(settings, queue)]
    if settings.gateway_runs_worker:  # the compute side is imported only here
        from workers.runtime import Runtime

        runtimes, failed = Runtime.build_all(specs_from_settings(settings), queue,
                                             resident_limit=limits.resident_adapters, durable=True,
                                             skip_failed=settings.skip_failed_models)
        for runtime in runtimes:
            served[runtime.served.name] = runtime.served
            (run_dispatcher, _), (run_sampler, _) = runtime.loops()
            background += [_registered(queue, runtime.served, run_dispatcher), run_sampler]
    # hub uploads run on the gateway's own threads; they read the checkpoints from the shared storage
    pusher = hub_pusher(storage_from_settings(settings), settings.hub_push_concurrency)
    return create_app(settings, queue, served, background=background, pusher=pusher, limits=limits,
                      unavailable=failed if settings.gateway_runs_worker else None,
                      shared=shared_auth(queue, settings.auth_check_seconds))


def _registered(queue: RedisQueue, model: ServedModel, run: Callable[[], Awaitable[None]]) -> Background:
    """The dispatcher of an in-gateway worker, once its model is registered for the other gateways."""
    async def run_trainer() -> None:
        await queue.register_served(model)
        await run()

    return run_trainer


async def publish_resident_limits(settings: Settings, queue: RedisQueue) -> None:
    """Every few seconds, write the tenants' adapters-in-memory quotas (SQL) into Redis for the workers, which
    read no SQL (jobqueue/resident_limits.py). Every gateway of a cluster does it; they write the same."""
    interval = max(settings.quota_cache_seconds, MIN_QUOTA_REFRESH_SECONDS)
    db = Database(settings.sqlalchemy_url)
    try:
        while True:
            try:
                limits = await resident_adapter_limits(db)
                await publish(queue.client, queue.keys, settings.quota_max_resident_adapters, limits)
            except Exception:  # the database or Redis away for a moment: the workers keep the last limits
                log.warning("publishing the tenants' resident-adapter limits failed; retrying", exc_info=True)
            await asyncio.sleep(interval)
    finally:
        await db.close()


async def follow_registry(queue: RedisQueue, served: dict[str, ServedModel]) -> None:
    """Keep `served` equal to what workers registered: reload on each registration push."""
    while True:
        try:
            await queue.follow_served(served)
        except Exception:  # Redis away: the known models stay served; try again shortly
            log.warning("following the served-model registry failed; retrying", exc_info=True)
            await asyncio.sleep(1.0)
