"""The gateway's Prometheus metrics and the text `/metrics` answers.

The gateway counts HTTP requests by route template, method and status, and requests per tenant id (bounded:
jobqueue/metrics_feed.TenantLabels); at each scrape it reads each served model's queue depth per lane and the jobs
Admission holds. The compute side's metrics (workers/metrics.py: jobs, merged steps, tokens, adapters, paging,
sampler batches) are in this process's registry in embedded mode, and published through Redis by separate
workers, which `render` merges in with a `worker` label. No label holds a key, a tenant's name or client text.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from prometheus_client import REGISTRY, CONTENT_TYPE_LATEST, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from api_schemas.jobs import queue_name
from jobqueue.metrics_feed import Merged, TenantLabels
from server.services.context import Context

CONTENT_TYPE = CONTENT_TYPE_LATEST
METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})

QUEUE_DEPTH = Gauge("twinkle_queue_depth", "Jobs queued that no worker has taken yet", ["base_model", "lane"])
HELD_JOBS = Gauge("twinkle_held_jobs", "Jobs the gateway holds for a tenant over its quota (not yet queued)")

tenants = TenantLabels()


class _RequestCounts(Collector):
    """`twinkle_http_requests_total{route,method,status}` and `twinkle_tenant_requests_total{tenant}`: plain dict
    increments per request (a prometheus Counter's inc takes a lock and checks its labels, several times the cost
    on the per-step routes), turned into counter families when scraped."""

    def __init__(self) -> None:
        self.requests: defaultdict[tuple[str, str, int], int] = defaultdict(int)
        self.per_tenant: defaultdict[str, int] = defaultdict(int)

    def collect(self) -> Iterator[CounterMetricFamily]:
        http = CounterMetricFamily("twinkle_http_requests", "HTTP requests by route template, method and status",
                                   labels=["route", "method", "status"])
        for (route, method, status), n in list(self.requests.items()):
            http.add_metric([route, method, str(status)], n)
        per_tenant = CounterMetricFamily("twinkle_tenant_requests", "Authenticated HTTP requests per tenant id (the "
                                         "first tenants seen; the rest are 'other')", labels=["tenant"])
        by_label: defaultdict[str, int] = defaultdict(int)
        for tenant_id, n in list(self.per_tenant.items()):
            by_label[tenants(tenant_id)] += n
        for label, n in by_label.items():
            per_tenant.add_metric([label], n)
        yield http
        yield per_tenant


_counts = _RequestCounts()
REGISTRY.register(_counts)


def count_request(route: str, method: str, status: int, tenant_id: str | None) -> None:
    _counts.requests[(route, method if method in METHODS else "OTHER", status)] += 1
    if tenant_id is not None:
        _counts.per_tenant[tenant_id] += 1


async def render(ctx: Context) -> bytes:
    """This process's registry, with the scrape-time gauges refreshed and the published workers' metrics."""
    names = {queue_name(model, lane): (model, lane) for model in ctx.models for lane in ("train", "sample")}
    for name, depth in (await ctx.queue.depth(list(names))).items():
        QUEUE_DEPTH.labels(*names[name]).set(depth)
    HELD_JOBS.set(ctx.admission.held_count)
    workers = await ctx.queue.worker_metrics()
    return generate_latest(Merged(REGISTRY, workers) if workers else REGISTRY)
