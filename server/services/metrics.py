"""The gateway's Prometheus metrics and the text `/metrics` answers.

The gateway counts HTTP requests by route template, method and status, and requests per tenant id (bounded:
jobqueue/metrics_feed.TenantLabels); at each scrape it reads each served model's queue depth per lane and the jobs
Admission holds. The compute side's metrics (workers/metrics.py: jobs, merged steps, tokens, adapters, paging,
sampler batches) are in this process's registry in embedded mode, and published through Redis by separate
workers, which `render` merges in with a `worker` label. No label holds a key, a tenant's name or client text.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest

from api_schemas.jobs import queue_name
from jobqueue.metrics_feed import Merged, TenantLabels
from server.services.context import Context

CONTENT_TYPE = CONTENT_TYPE_LATEST
METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})

HTTP_REQUESTS = Counter("twinkle_http_requests_total", "HTTP requests by route template, method and status",
                        ["route", "method", "status"])
TENANT_REQUESTS = Counter("twinkle_tenant_requests_total", "Authenticated HTTP requests per tenant id (the first "
                          "tenants seen; the rest are 'other')", ["tenant"])
QUEUE_DEPTH = Gauge("twinkle_queue_depth", "Jobs queued that no worker has taken yet", ["base_model", "lane"])
HELD_JOBS = Gauge("twinkle_held_jobs", "Jobs the gateway holds for a tenant over its quota (not yet queued)")

tenants = TenantLabels()


def count_request(route: str, method: str, status: int, tenant_id: str | None) -> None:
    HTTP_REQUESTS.labels(route, method if method in METHODS else "OTHER", str(status)).inc()
    if tenant_id is not None:
        TENANT_REQUESTS.labels(tenants(tenant_id)).inc()


async def render(ctx: Context) -> bytes:
    """This process's registry, with the scrape-time gauges refreshed and the published workers' metrics."""
    names = {queue_name(model, lane): (model, lane) for model in ctx.models for lane in ("train", "sample")}
    for name, depth in (await ctx.queue.depth(list(names))).items():
        QUEUE_DEPTH.labels(*names[name]).set(depth)
    HELD_JOBS.set(ctx.admission.held_count)
    workers = await ctx.queue.worker_metrics()
    return generate_latest(Merged(REGISTRY, workers) if workers else REGISTRY)
