"""`twinkle-server worker`: the worker of one or more base models (`--base-model`, repeatable), consuming the
Redis queue (cluster wiring).

The compute side is built by workers/runtime.py from the same spec as embedded mode (deploy/specs.py), plus what
a separate process needs: it registers the served model for the gateways, holds each lane's lease while it runs,
rebuilds the adapters of models a dead predecessor held (workers/recovery.py), reads the tenants'
adapters-in-memory quotas that the gateways publish into Redis (jobqueue/resident_limits.py), and gives its leases
back on SIGTERM/SIGINT. If it ever loses a lease (a stall longer than the lease), it exits with status 3 so its
supervisor starts a fresh one.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from deploy.cluster import redis_queue
from deploy.loop import run_loop
from deploy.specs import specs_from_settings
from jobqueue import tracing
from jobqueue.base import LeaseLost
from jobqueue.metrics_feed import MetricsPublisher, worker_id
from jobqueue.redis_queue import RedisQueue
from jobqueue.resident_limits import ResidentLimitFeed
from server.config import Settings
from workers.runtime import LANES, Runtime, WorkerSpec

log = logging.getLogger(__name__)

__all__ = ["LANES", "build_cluster_runtime", "main", "serve_worker"]


def build_cluster_runtime(spec: WorkerSpec, queue: RedisQueue,
                          lanes: tuple[str, ...] = LANES) -> tuple[Runtime, ResidentLimitFeed]:
    """The runtime on a Redis queue (durable: recovery on), with the published per-tenant quotas (blocking)."""
    runtimes, _, feed = build_cluster_runtimes([spec], queue, lanes)
    return runtimes[0], feed


def build_cluster_runtimes(specs: list[WorkerSpec], queue: RedisQueue, lanes: tuple[str, ...] = LANES,
                           skip_failed: bool = False) -> tuple[list[Runtime], dict[str, str], ResidentLimitFeed]:
    """The runtimes of several base models on one Redis queue, sharing one feed of the published quotas."""
    first = specs[0]
    feed = ResidentLimitFeed(queue.client, queue.keys, first.default_resident_adapters, first.quota_refresh_seconds)
    runtimes, failed = Runtime.build_all(specs, queue, lanes=lanes, resident_limit=feed, durable=True,
                                         skip_failed=skip_failed)
    return runtimes, failed, feed


async def serve_worker(settings: Settings, lanes: tuple[str, ...] = LANES) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tracing.setup_from(settings.otel_endpoint, settings.otel_service_name, "worker")  # jobqueue/tracing.py
    queue = redis_queue(settings)
    runtimes, _failed, feed = await asyncio.to_thread(build_cluster_runtimes, specs_from_settings(settings), queue,
                                                      lanes, settings.skip_failed_models)
    # this process's metrics reach the gateways' /metrics through Redis (jobqueue/metrics_feed.py)
    publisher = MetricsPublisher(queue.client, queue.keys, worker_id("worker"), settings.metrics_publish_seconds)
    loops: list[tuple[Callable[[], Awaitable[None]], Callable[[], None]]] = [
        *(loop for rt in runtimes for loop in rt.loops()), (feed.run, feed.stop), (publisher.run, publisher.stop)]
    tasks = [asyncio.create_task(run()) for run, _ in loops]
    stopping = asyncio.create_task(stop.wait())
    code = 0
    try:
        for rt in runtimes:
            await queue.register_served(rt.served)
        await asyncio.wait({*tasks, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            if t.done():
                t.result()  # LeaseLost or a crash
    except LeaseLost as e:
        log.error("%s; exiting so that a fresh worker takes over", e)
        code = 3
    finally:
        for _, halt in loops:
            halt()
        for t in (*tasks, stopping):
            t.cancel()
        await asyncio.gather(*tasks, stopping, return_exceptions=True)
        await queue.close()  # gives the leases back: a successor starts at once
    log.info("worker for %s stopped", ", ".join(rt.served.name for rt in runtimes))
    return code


def main(settings: Settings, lanes: tuple[str, ...] = LANES) -> int:
    return run_loop(serve_worker(settings, lanes))
