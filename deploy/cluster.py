"""Cluster wiring of `twinkle-server serve` (TWINKLE_REDIS_URL set): the gateway on the Redis queue.

The gateway runs no model unless `gateway_runs_worker` is set: it serves the base models that workers registered
in Redis (`twinkle-server worker`), following the registry as workers come and go, and keeps serving a model
while its worker restarts (the jobs wait in the stream).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI

from api_schemas.models import ServedModel
from jobqueue.redis_queue import RedisQueue
from server.app import Background, create_app
from server.config import Settings
from workers.checkpoints.hub import HubPusherPool
from workers.checkpoints.store import CheckpointStore

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


def build_gateway_app(settings: Settings) -> FastAPI:
    queue = redis_queue(settings)
    served: dict[str, ServedModel] = {}
    background: list[Background] = [lambda: follow_registry(queue, served)]
    if settings.gateway_runs_worker:  # the compute side is imported only here
        from deploy.embedded import build_trainer
        from deploy.worker import sampling_loop, training_dispatcher

        model, trainer, store = build_trainer(settings)
        served[model.name] = model
        dispatcher = training_dispatcher(settings, queue, model, trainer, store)
        run_sampler, _ = sampling_loop(settings, queue, model, trainer, store)

        async def run_trainer() -> None:
            await queue.register_served(model)
            await dispatcher.run()

        background += [run_trainer, run_sampler]
    # hub uploads run on the gateway's own threads; they read the checkpoints from the shared storage
    pusher = HubPusherPool(CheckpointStore(settings.storage_location, settings.storage_cache_dir),
                           settings.hub_push_concurrency)
    return create_app(settings, queue, served, background=background, pusher=pusher)


async def follow_registry(queue: RedisQueue, served: dict[str, ServedModel]) -> None:
    """Keep `served` equal to what workers registered: reload on each registration push."""
    while True:
        try:
            await queue.follow_served(served)
        except Exception:  # Redis away: the known models stay served; try again shortly
            log.warning("following the served-model registry failed; retrying", exc_info=True)
            await asyncio.sleep(1.0)
