"""What the web dashboard shows one key (server/api/dashboard.py), built from the services that own each fact.

Runs come from the run listing's query (lifecycle_repo.runs, as runs.list_runs pages it), checkpoints from
checkpoints.list_tenant, usage from usage.report, keys from tenants.list_keys, each run's loss points from
LossHistory.curves (SQL, merged with the gateway's points not written yet), and the service's state (queue depth,
held jobs, adapters per tier) from the same text `/metrics` answers (metrics.render), so the dashboard and a
Prometheus scrape never disagree, whichever wiring publishes the workers' metrics. A tenant's key sees its own tenant
only; an operator's key (`keys create --admin`) every tenant, their keys and the service.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from api_schemas.dashboard import (
    AdapterTierView,
    CheckpointView,
    KeyView,
    LossPointView,
    Overview,
    QueueView,
    RunView,
    ServiceView,
    TenantView,
)
from api_schemas.native.usage import TenantUsage
from server.db import lifecycle_repo as lrepo
from server.errors import NotFound
from server.services import checkpoints, metrics, tenants, usage
from server.services.context import Context

RUNS_SHOWN = 50  # per tenant, most recent first
CHECKPOINTS_SHOWN = 50


async def overview(ctx: Context, tenant_id: str, operator: bool) -> Overview:
    """The view of a key of `tenant_id`; every tenant's (and the service's) when `operator`."""
    reports = await usage.report(ctx.db) if operator else await usage.report(ctx.db, tenant_id=tenant_id)
    viewer = next((u.tenant for u in reports if u.tenant_id == tenant_id), None)
    if viewer is None:
        raise NotFound("tenant not found")
    keys: dict[str, list[KeyView]] = {}
    if operator:
        for k in await tenants.list_keys(ctx.db):
            keys.setdefault(k.tenant, []).append(KeyView(key_id=k.key_id, prefix=k.prefix, created_at=k.created_at,
                                                         revoked=k.revoked_at is not None, admin=k.admin))
    views = [await _tenant(ctx, u, keys.get(u.tenant, []) if operator else None) for u in reports]
    return Overview(role="operator" if operator else "tenant", viewer=viewer, tenants=views,
                    service=await service(ctx) if operator else None)


async def _tenant(ctx: Context, u: TenantUsage, keys: list[KeyView] | None) -> TenantView:
    """A constant number of queries per tenant, however many runs it has: the run listing's own query
    (lifecycle_repo.runs, as runs.list_runs pages it) and the tenant's checkpoint listing; a run's last checkpoint is
    the newest of those listed that belongs to it."""
    async with ctx.db.session() as s:
        rows, runs_total = await lrepo.runs(s, u.tenant_id, RUNS_SHOWN, 0, False, None)
    saved = await checkpoints.list_tenant(ctx, u.tenant_id, CHECKPOINTS_SHOWN, 0)
    newest: dict[str, str] = {}
    for c in saved.checkpoints:  # newest first
        newest.setdefault(c.tinker_path.removeprefix("tinker://").split("/", 1)[0], c.tinker_path)
    # the runs' loss curves: SQL's points (one query for the runs not read yet) and this gateway's newer ones;
    # behind several gateways a live run's are read again each maintenance round
    refresh = ctx.settings.maintenance_interval_seconds if ctx.settings.redis_url else None
    curves = await ctx.losses.curves(ctx.db, u.tenant_id, [(r.id, r.released_at is None) for r in rows], refresh)
    run_views = []
    for r in rows:
        last_request = checkpoints.aware(r.last_request_at) or checkpoints.aware(r.created_at)
        assert last_request is not None
        run_views.append(RunView(
            run_id=r.id, base_model=r.base_model, lora_rank=None if r.full_param else r.lora_rank,
            last_request_time=last_request, live=r.released_at is None, last_checkpoint=newest.get(r.id),
            losses=[LossPointView(seq_id=p.seq_id, loss=p.loss, tokens=p.tokens, at=p.at)
                    for p in curves.get(r.id, ())],
        ))
    ckpt_views = [CheckpointView(tinker_path=c.tinker_path, kind=c.checkpoint_type, time=c.time,
                                 size_bytes=c.size_bytes, public=c.public) for c in saved.checkpoints]
    return TenantView(name=u.tenant, tenant_id=u.tenant_id, keys=keys, runs=run_views, runs_total=runs_total,
                      checkpoints=ckpt_views,
                      checkpoints_total=saved.cursor.total_count if saved.cursor is not None else len(ckpt_views),
                      usage=u)


async def service(ctx: Context) -> ServiceView:
    """Queue depth per (model, lane), held jobs and adapters per tier, read from the /metrics text."""
    text = (await metrics.render(ctx)).decode()
    queues: list[QueueView] = []
    adapters: list[AdapterTierView] = []
    held = 0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "twinkle_queue_depth":
                queues.append(QueueView(base_model=s.labels["base_model"], lane=s.labels["lane"], depth=int(s.value)))
            elif s.name == "twinkle_held_jobs":
                held = int(s.value)
            elif s.name == "twinkle_adapters":
                adapters.append(AdapterTierView(base_model=s.labels["base_model"], tier=s.labels["tier"],
                                                adapters=int(s.value), worker=s.labels.get("worker")))
    return ServiceView(queues=queues, held_jobs=held, adapters=adapters)
