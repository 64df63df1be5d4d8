"""Releasing the models of ended client sessions (a maintenance step).

A model's adapter lives in a worker's memory (or paged to its disk), and in cluster mode its recovery state
(replay log, snapshots) in Redis and the checkpoint store. Once the client session that created it has finished,
or sent no heartbeat for `session_timeout_seconds`, nobody can use the model any more: the SDK ties a training
client to its session. This step marks such models released (their requests then answer 410) and queues a
ReleaseModel job on each one's training queue; the worker frees the adapter and the recovery state once every job
queued before has run. A full-parameter run is also released when its lease's time is up (full_param.py).
Checkpoints the tenant saved are untouched: `create_training_client_from_state` brings a
run back as a new model.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from api_schemas.jobs import RELEASE_SEQ, ReleaseModel
from server.db import repositories as repo
from server.db.models import utcnow
from server.services import checkpoints as ckpt
from server.services import full_param, jobs
from server.services.context import Context

log = logging.getLogger(__name__)

RELEASE_BATCH = 500  # models released per maintenance round at most
REASON = "its client session ended"
LEASE_ENDED = "its full-parameter lease reached its time limit"


async def release_ended_models(ctx: Context) -> int:
    """Queue the release of every model whose session ended; returns how many were released."""
    stale_before = utcnow() - timedelta(seconds=ctx.settings.session_timeout_seconds)
    lease_before = full_param.lease_started_before(ctx.settings)
    async with ctx.db.session() as s:
        rows = await repo.models_to_release(s, stale_before, RELEASE_BATCH, lease_before)
    released = 0
    for row in rows:
        started = ckpt.aware(row.created_at)
        reason = LEASE_ENDED if row.full_param and started is not None and started < lease_before else REASON
        try:
            # Queued first (idempotent: the same dedup key and payload every round), marked second: a gateway that
            # dies in between queues it again next round and gets the same job back.
            await jobs.queue_train(ctx, tenant_id=row.tenant_id, base_model=row.base_model, model_id=row.id,
                                   seq_id=RELEASE_SEQ, payload=ReleaseModel(reason=reason))
            async with ctx.db.session() as s:
                await repo.mark_released(s, row.id, utcnow())
        except Exception:  # one model's failure must not stop the others
            log.exception("could not release model %s", row.id)
            continue
        ctx.model_rows.pop(row.id, None)
        released += 1
        log.info("released model %s of tenant %s: %s", row.id, row.tenant_id, reason)
    return released
