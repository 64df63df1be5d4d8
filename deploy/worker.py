"""`twinkle-server worker`: the training worker of one base model, consuming the Redis queue (cluster wiring).

The same Trainer and Dispatcher as embedded mode, plus what a separate process needs: it registers the served
model for the gateways, holds the queue's lease while it runs, rebuilds the adapters of models a dead
predecessor held (workers/recovery.py), and gives the lease back on SIGTERM/SIGINT. If it ever loses the lease
(a long stall), it drops every adapter and starts over as a fresh worker would.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from api_schemas.jobs import queue_name
from api_schemas.models import ServedModel
from jobqueue.base import LeaseLost
from deploy.cluster import redis_queue
from jobqueue.redis_queue import RedisQueue
from server.config import Settings
from workers.checkpoints.store import CheckpointStore
from workers.dispatcher import Dispatcher
from workers.engine.trainer import Trainer
from workers.recovery import Recovery

log = logging.getLogger(__name__)


def training_dispatcher(
    settings: Settings, queue: RedisQueue, served: ServedModel, trainer: Trainer, store: CheckpointStore
) -> Dispatcher:
    recovery = Recovery(trainer, store, snapshot_every=settings.snapshot_every_steps)
    return Dispatcher(
        queue, queue_name(served.name, "train"), trainer.execute,
        gap_timeout=settings.seq_gap_timeout_seconds, recovery=recovery,
    )


async def serve_worker(settings: Settings, served: ServedModel, trainer: Trainer, store: CheckpointStore) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        queue = redis_queue(settings)
        dispatcher = training_dispatcher(settings, queue, served, trainer, store)
        run: asyncio.Task[None] | None = None
        try:
            await queue.register_served(served)
            run = asyncio.create_task(dispatcher.run())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({run, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if run.done():
                run.result()  # LeaseLost or a crash
        except LeaseLost as e:
            log.error("%s; dropping every adapter and starting over", e)
            for model_id in list(trainer.pool.adapters):
                trainer.pool.drop(model_id)
        finally:
            dispatcher.stop()
            if run is not None and not run.done():
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
            await queue.close()  # gives the lease back: a successor starts at once
    log.info("worker for %s stopped", served.name)


def main(settings: Settings) -> int:
    from deploy.embedded import build_trainer

    served, trainer, store = build_trainer(settings)
    asyncio.run(serve_worker(settings, served, trainer, store))
    return 0
