"""The gateway's maintenance loop, started in the app lifespan: expire checkpoints past their TTL (files and rows),
settle saves whose future nobody collected, start the auto-pushes of finished runs, reclaim ephemeral sampler
weights nobody can use any more, release the models of ended sessions (server/services/release.py), drop
their custom losses, native server-held objects and sampler adapters, and write the usage meter's counts and the
loss points of the dashboard's curves.

Every step is idempotent, so several gateways of a cluster may run the loop side by side.
"""

from __future__ import annotations

import asyncio
import logging

from server.services.native import processor_store as native_processors
from server.services.native import sampler_adapters as native_sampler_adapters
from server.services import checkpoints as ckpt
from server.services import custom_losses, hub_push, release, sampling, sessions
from server.services.context import Context

log = logging.getLogger(__name__)


async def run_maintenance(ctx: Context) -> None:
    await hub_push.fail_interrupted(ctx)
    while True:
        await maintain_once(ctx)
        await asyncio.sleep(ctx.settings.maintenance_interval_seconds)


async def flush_usage(ctx: Context) -> None:
    await ctx.usage.flush(ctx.db)  # the tokens counted since the last round (server/services/usage.py)


async def flush_losses(ctx: Context) -> None:
    await ctx.losses.flush(ctx.db)  # the loss points delivered since the last round (server/services/loss_history.py)


async def maintain_once(ctx: Context) -> None:
    steps = (ckpt.sweep_expired, ckpt.settle_pending, hub_push.trigger_auto_pushes, sampling.reclaim_ephemeral,
             release.release_ended_models, sessions.expire_stale, custom_losses.drop_ended,
             native_processors.drop_ended, native_sampler_adapters.drop_ended, flush_usage, flush_losses)
    for step in steps:
        try:
            await step(ctx)
        except Exception:  # one failing step must not stop the others, nor the next round
            log.exception("maintenance step %s failed", step.__name__)
