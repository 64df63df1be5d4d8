"""`twinkle-server worker`: the worker of one base model, consuming the Redis queue (cluster wiring).

The same Trainer, Dispatcher, sampler and SamplerWorker as embedded mode, plus what a separate process needs: it
registers the served model for the gateways, holds each lane's lease while it runs, rebuilds the adapters of models
a dead predecessor held (workers/recovery.py), and gives its leases back on SIGTERM/SIGINT. If it ever loses a
lease (a stall longer than the lease), it exits with status 3 so its supervisor starts a fresh one.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from api_schemas.jobs import queue_name
from api_schemas.models import ServedModel
from deploy.cluster import redis_queue
from deploy.loop import run_loop
from jobqueue.base import LeaseLost
from jobqueue.redis_queue import RedisQueue
from server.config import Settings
from workers.checkpoints.store import CheckpointStore
from workers.dispatcher import Dispatcher
from workers.engine.trainer import Trainer
from workers.recovery import Recovery

log = logging.getLogger(__name__)

LANES = ("train", "sample")


def training_dispatcher(
    settings: Settings, queue: RedisQueue, served: ServedModel, trainer: Trainer, store: CheckpointStore
) -> Dispatcher:
    recovery = Recovery(trainer, store, snapshot_every=settings.snapshot_every_steps)
    return Dispatcher(
        queue, queue_name(served.name, "train"), trainer.execute,
        gap_timeout=settings.seq_gap_timeout_seconds, recovery=recovery, token_budget=settings.train_token_budget,
    )


def sampling_loop(
    settings: Settings, queue: RedisQueue, served: ServedModel, trainer: Trainer, store: CheckpointStore
) -> tuple[Callable[[], Awaitable[None]], Callable[[], None]]:
    from workers.sampling.factory import build_sampler
    from workers.sampling.worker import SamplerWorker

    backend = build_sampler(
        settings.sampler, served.name, trainer.base.folder, store, dtype=settings.dtype, device=settings.device,
        max_batch_rows=settings.sampler_max_batch_rows, max_loaded_adapters=settings.sampler_max_loaded_adapters,
        max_lora_rank=settings.max_lora_rank,
        shared_base=trainer.base,
    )
    sampler = SamplerWorker(queue, queue_name(served.name, "sample"), backend)
    return sampler.run, sampler.stop


async def serve_worker(
    settings: Settings, served: ServedModel, trainer: Trainer, store: CheckpointStore, lanes: tuple[str, ...] = LANES
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    queue = redis_queue(settings)
    runs: list[Callable[[], Awaitable[None]]] = []
    stops: list[Callable[[], None]] = []
    if "train" in lanes:
        dispatcher = training_dispatcher(settings, queue, served, trainer, store)
        runs.append(dispatcher.run)
        stops.append(dispatcher.stop)
    if "sample" in lanes:
        run, halt = sampling_loop(settings, queue, served, trainer, store)
        runs.append(run)
        stops.append(halt)
    tasks = [asyncio.create_task(fn()) for fn in runs]
    stopping = asyncio.create_task(stop.wait())
    code = 0
    try:
        await queue.register_served(served)
        await asyncio.wait({*tasks, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            if t.done():
                t.result()  # LeaseLost or a crash
    except LeaseLost as e:
        log.error("%s; exiting so that a fresh worker takes over", e)
        code = 3
    finally:
        for halt in stops:
            halt()
        for t in (*tasks, stopping):
            t.cancel()
        await asyncio.gather(*tasks, stopping, return_exceptions=True)
        await queue.close()  # gives the leases back: a successor starts at once
    log.info("worker for %s stopped", served.name)
    return code


def main(settings: Settings, lanes: tuple[str, ...] = LANES) -> int:
    from deploy.embedded import build_trainer

    served, trainer, store = build_trainer(settings)
    return run_loop(serve_worker(settings, served, trainer, store, lanes))
