"""The compute side's Prometheus metrics: jobs, merged steps, tokens, adapter paging, sampler batches.

Every metric lives in prometheus_client's default registry of the process. In embedded mode (and a gateway with
`--with-worker`) that is the gateway's own process, so `/metrics` shows them directly; a `twinkle-server worker`
or a Ray replica publishes its registry into Redis (jobqueue/metrics_feed.py) and the gateways' `/metrics` adds
it with a `worker` label. Labels are bounded: base model names (the operator's), job kinds (the payload's
`kind`), tiers, and tenant ids (never a name or any client text), of which only the first `MAX_TENANTS` get their
own label and the rest count as "other".
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from api_schemas.jobs import ForwardBackward, Job, JobResult, Sample, SampleResult
from jobqueue.metrics_feed import TenantLabels

disable_created_metrics()  # no `_created` series: half the lines, nothing an operator reads

MAX_TENANTS = 50  # tenants with a label of their own (per process); the others are "other"

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

JOB_SECONDS = Histogram("twinkle_job_duration_seconds", "Seconds from a worker taking a job to its result "
                        "(waiting for its seq order or a merged step included)", ["base_model", "kind"],
                        buckets=_SECONDS)
JOBS = Counter("twinkle_jobs_total", "Jobs a worker finished, by outcome (ok, user_error, server_error)",
               ["base_model", "kind", "outcome"])
STEP_JOBS = Histogram("twinkle_merged_step_jobs", "Jobs (of any tenants) in one merged forward/backward pass",
                      ["base_model"], buckets=_COUNTS)
STEP_TOKENS = Histogram("twinkle_merged_step_tokens", "Tokens of the datums in one merged forward/backward pass",
                        ["base_model"], buckets=(16, 64, 256, 1024, 4096, 16384, 65536))
TOKENS = Counter("twinkle_tokens_total", "Tokens processed: trained (forward_backward), forward (forward only), "
                 "sampled (generated) and prefilled (sample prompts)", ["base_model", "kind"])
TENANT_TOKENS = Counter("twinkle_tenant_tokens_total", "Tokens per tenant id (the first tenants seen; the rest "
                        "are 'other')", ["tenant", "kind"])
PAGES = Counter("twinkle_adapter_pages_total", "Adapter moves between tiers (device, host, disk)",
                ["base_model", "source", "target"])
PAGED_BYTES = Counter("twinkle_adapter_paged_bytes_total", "Bytes of adapter state moved between tiers",
                      ["base_model", "source", "target"])
SAMPLER_BATCH = Histogram("twinkle_sampler_batch_rows", "Sequences decoded together in one sampler step",
                          ["base_model"], buckets=_COUNTS)


tenants = TenantLabels(MAX_TENANTS)


def count_tokens(base_model: str, tenant_id: str, kind: str, n: int) -> None:
    if n > 0:
        TOKENS.labels(base_model, kind).inc(n)
        TENANT_TOKENS.labels(tenants(tenant_id), kind).inc(n)


def job_finished(job: Job, result: JobResult, seconds: float) -> None:
    """A job's result, as a worker publishes it: its latency and outcome, and the tokens it processed."""
    kind = job.payload.kind
    JOB_SECONDS.labels(job.base_model, kind).observe(seconds)
    outcome = "ok" if result.error is None else f"{result.error.category.value}_error"
    JOBS.labels(job.base_model, kind, outcome).inc()
    if result.error is not None:
        return
    p = job.payload
    if isinstance(p, ForwardBackward):
        count_tokens(job.base_model, job.tenant_id, "forward" if p.forward_only else "trained", p.tokens)
    elif isinstance(p, Sample) and isinstance(result.output, SampleResult):
        count_tokens(job.base_model, job.tenant_id, "prefilled", len(p.prompt_tokens))
        count_tokens(job.base_model, job.tenant_id, "sampled", sum(len(s.tokens) for s in result.output.sequences))


def merged_step(base_model: str, jobs: list[Job]) -> None:
    STEP_JOBS.labels(base_model).observe(len(jobs))
    STEP_TOKENS.labels(base_model).observe(sum(j.payload.tokens for j in jobs if isinstance(j.payload, ForwardBackward)))


def paged(base_model: str, source: str, target: str, nbytes: int) -> None:
    PAGES.labels(base_model, source, target).inc()
    PAGED_BYTES.labels(base_model, source, target).inc(nbytes)


class TierSource(Protocol):
    def occupancy(self) -> tuple[str, dict[str, int]]:
        """(base model, adapters per tier)."""
        ...


class _Occupancy(Collector):
    """`twinkle_adapters{base_model, tier}`: the adapters each live trainer holds per tier, read at scrape time."""

    def __init__(self) -> None:
        # by id: a runtime (a dataclass) is not hashable; one that goes stops being counted
        self._sources: weakref.WeakValueDictionary[int, TierSource] = weakref.WeakValueDictionary()

    def watch(self, source: TierSource) -> None:
        self._sources[id(source)] = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("twinkle_adapters", "Adapters held by a trainer, per tier (device, host, disk)",
                                   labels=["base_model", "tier"])
        for source in list(self._sources.values()):
            try:
                model, tiers = source.occupancy()
            except RuntimeError:  # the pool changed while being counted: the next scrape reports it
                continue
            for tier, n in tiers.items():
                family.add_metric([model, tier], n)
        yield family


occupancy = _Occupancy()
REGISTRY.register(occupancy)
