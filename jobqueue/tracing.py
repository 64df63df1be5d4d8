"""OpenTelemetry tracing of a request from the gateway into the worker that runs its jobs (the `otel` extra).

Off unless a process calls `setup` (the gateway's `create_app` and the worker wirings do, when
`TWINKLE_OTEL_ENDPOINT` is set; a test hands its own exporter). Off, every helper here returns at its first line and
nothing of OpenTelemetry is imported, so the per-step path pays one module-global read (`_tracer is None`).

One trace per HTTP request:

    <METHOD> <route template>   SERVER    the gateway's request (server/api/observe.py), the trace's root
      twinkle.job.wait          INTERNAL  a job it queued: from the job's making (server/services/jobs.new_job)
                                          until a worker starts running it (admission hold, queue, scheduler);
                                          event `fetched` when the worker read it from the queue
      twinkle.job.run           CONSUMER  from the start of the job's step until its result is acknowledged

A job carries its request span's W3C `traceparent` and the wall-clock time it was made (`Job.traceparent`,
`Job.queued_at_ns`) across the in-process queue and the Redis queue alike (a Job travels there as its JSON), so the
worker's spans join the request's trace in any process. A merged step runs jobs of several requests (tenants)
at once: its `twinkle.step` span is a trace of its own, linked to each job's request span, and each job's run span
links back to it. Attributes name tenants only by their generated id (`twinkle.tenant_id`), never in span names,
and hold no key, body or raw path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context as OtelContext
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, SpanContext, Tracer

    from api_schemas.jobs import Job, JobResult

DEFAULT_SERVICE_NAME = "twinkle-server"
TRACES_PATH = "/v1/traces"

_tracer: Tracer | None = None  # None: tracing is off in this process
_provider: TracerProvider | None = None
_otel: Any = None  # the OpenTelemetry API pieces the helpers use, imported once by `setup`
_NO_FIELDS: dict[str, Any] = {}


def enabled() -> bool:
    return _tracer is not None


def available() -> bool:
    """Whether the `otel` extra (the SDK and its OTLP/HTTP exporter) is installed."""
    import importlib.util

    try:
        return importlib.util.find_spec("opentelemetry.sdk") is not None and \
            importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None
    except (ImportError, ValueError):  # a parent package is missing (or hidden)
        return False


MISSING = "OpenTelemetry is not installed -> pip install 'twinkle-server[otel]' (or unset TWINKLE_OTEL_ENDPOINT)"


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's base URL (`http://collector:4318` -> `.../v1/traces`), as
    OTEL_EXPORTER_OTLP_ENDPOINT is read; a URL already ending in /v1/traces is used as it is."""
    url = endpoint.rstrip("/")
    return url if url.endswith(TRACES_PATH) else url + TRACES_PATH


def setup(*, endpoint: str | None = None, service_name: str | None = None, exporter: SpanExporter | None = None,
          process: str = "gateway", batch: bool = True) -> None:
    """Turn tracing on for this process: spans go to `exporter`, or over OTLP/HTTP (protobuf) to `endpoint` (None:
    the OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT the SDK reads). `service_name` (None: OTEL_SERVICE_NAME, else
    twinkle-server) and `process` (gateway, worker, ray replica) describe the resource. `batch`: export from a
    background thread (BatchSpanProcessor, OTEL_BSP_* apply); False exports each span as it ends (tests). The SDK
    reads the other standard variables (OTEL_EXPORTER_OTLP_HEADERS, OTEL_TRACES_SAMPLER, OTEL_RESOURCE_ATTRIBUTES,
    ...). The provider also becomes the global one when none is set yet, so libraries' instrumentation (FastAPI's
    own, TWINKLE_OTEL_TELEMETRY) reports into the same exporter. Called again, it replaces this module's provider."""
    global _tracer, _provider, _otel
    import types

    from opentelemetry import context, trace
    from opentelemetry.context import Context
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint) if endpoint else None)
    name = service_name or os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
    provider = TracerProvider(resource=Resource.create({"service.name": name, "twinkle.process": process}))
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    old = _provider
    _otel = types.SimpleNamespace(attach=context.attach, detach=context.detach, current=trace.get_current_span,
                                  in_context=trace.set_span_in_context, NonRecordingSpan=trace.NonRecordingSpan,
                                  Context=Context, Link=trace.Link, SERVER=trace.SpanKind.SERVER,
                                  CONSUMER=trace.SpanKind.CONSUMER, ERROR=trace.StatusCode.ERROR)
    _provider, _tracer = provider, provider.get_tracer("twinkle")
    if type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider":  # nobody set one: ours
        trace.set_tracer_provider(provider)
    if old is not None and old is not trace.get_tracer_provider():
        old.shutdown()


def setup_from(endpoint: str | None, service_name: str | None, process: str) -> bool:
    """`setup` when an endpoint is configured and tracing is not on yet (a test's own exporter stays); whether on.
    Raises RuntimeError (MISSING) when an endpoint is configured without the `otel` extra."""
    if endpoint and _tracer is None:
        if not available():
            raise RuntimeError(MISSING)
        setup(endpoint=endpoint, service_name=service_name, process=process)
    return _tracer is not None


def flush(timeout_ms: int = 5000) -> None:
    if _provider is not None:
        _provider.force_flush(timeout_ms)


def shutdown() -> None:
    """Tracing off again (spans still buffered are exported first)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


# --- the gateway: one span per HTTP request -----------------------------------------------------------------
def start_request(method: str) -> tuple[Span, object, str] | None:
    """A SERVER span for a request, made current (the jobs it queues carry it); None when tracing is off. Its name
    becomes `<METHOD> <route template>` at `end_request`, when the route is known."""
    tracer = _tracer
    if tracer is None:
        return None
    span = tracer.start_span(method, kind=_otel.SERVER)
    return span, _otel.attach(_otel.in_context(span)), method


def end_request(handle: tuple[Span, object, str], route: str, status: int, tenant_id: str | None,
                request_id: str, error: BaseException | None = None) -> None:
    """End the request's span: named by its route template (only the method for a path no route serves)."""
    span, token, method = handle
    _otel.detach(token)
    attributes: dict[str, Any] = {"http.request.method": method, "http.response.status_code": status,
                                  "twinkle.request_id": request_id}
    if route != "unmatched":
        span.update_name(f"{method} {route}")
        attributes["http.route"] = route
    if tenant_id is not None:
        attributes["twinkle.tenant_id"] = tenant_id
    span.set_attributes(attributes)  # at once: each call takes the span's lock
    if error is not None:
        span.record_exception(error)
    if status >= 500:
        span.set_status(_otel.ERROR)
    span.end()


def job_fields() -> dict[str, Any]:
    """What a job made now carries of the current (sampled) span: its `traceparent` and `queued_at_ns`; an empty
    dict when tracing is off or no sampled span is current."""
    if _tracer is None:
        return _NO_FIELDS
    sc = _otel.current().get_span_context()
    if not sc.is_valid or not sc.trace_flags.sampled:
        return _NO_FIELDS
    return {"traceparent": f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}",
            "queued_at_ns": time.time_ns()}


def parse_traceparent(value: str) -> SpanContext | None:
    """The remote span context of a W3C traceparent (version 00), or None when it is not one."""
    from opentelemetry.trace import SpanContext, TraceFlags

    parts = value.split("-")
    if len(parts) != 4 or parts[0] != "00" or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))


# --- the workers: a job's wait and run ------------------------------------------------------------------------
class _Open:
    __slots__ = ("parent", "wait", "run")

    def __init__(self, parent: OtelContext, wait: Span) -> None:
        self.parent = parent  # the request span's (remote) context
        self.wait = wait
        self.run: Span | None = None


class JobSpans:
    """The spans of the jobs one worker loop holds (workers/dispatcher.py, workers/sampling/worker.py). Only jobs
    that carry a traceparent get any, so `fetched` is the only call a loop makes per job while tracing is off (and
    it returns at once); the others look at `self.open` first."""

    def __init__(self, base_model: str) -> None:
        self.base_model = base_model
        self.open: dict[str, _Open] = {}

    def fetched(self, job: Job) -> None:
        """A worker read `job` from its queue: its wait span starts when the job was made."""
        tracer = _tracer
        if tracer is None or job.traceparent is None:
            return
        remote = parse_traceparent(job.traceparent)
        if remote is None:
            return
        parent = _otel.in_context(_otel.NonRecordingSpan(remote))
        start = job.queued_at_ns if job.queued_at_ns is not None else time.time_ns()
        wait = tracer.start_span("twinkle.job.wait", context=parent, start_time=start, attributes=_job_attributes(
            job, self.base_model))
        wait.add_event("fetched")
        self.open[job.job_id] = _Open(parent, wait)

    def step(self, jobs: Iterable[Job], merged: bool) -> Span | None:
        """The span of a step of several jobs (a merged pass, or barrier jobs of several models run in one
        hand-over), a trace of its own linked to each traced job's request; None when none of them is traced."""
        tracer = _tracer
        jobs = list(jobs)
        traced = [self.open[j.job_id] for j in jobs if j.job_id in self.open]
        if tracer is None or not traced:
            return None
        tokens = sum(getattr(j.payload, "tokens", 0) for j in jobs)
        return tracer.start_span("twinkle.step", context=_otel.Context(), links=[
            _otel.Link(_otel.current(o.parent).get_span_context()) for o in traced], attributes={
            "twinkle.base_model": self.base_model, "twinkle.step.jobs": len(jobs), "twinkle.step.tokens": tokens,
            "twinkle.step.merged": merged})

    def started(self, jobs: Iterable[Job], step: Span | None = None) -> None:
        """`jobs` start running: their wait spans end, their run spans start (linked to the step's span)."""
        tracer = _tracer
        if tracer is None:
            return
        now = time.time_ns()
        links = [_otel.Link(step.get_span_context())] if step is not None else None
        for job in jobs:
            o = self.open.get(job.job_id)
            if o is None or o.run is not None:
                continue
            o.wait.end(end_time=now)
            o.run = tracer.start_span("twinkle.job.run", context=o.parent, kind=_otel.CONSUMER, start_time=now,
                                      links=links, attributes=_job_attributes(job, self.base_model))

    def finished(self, result: JobResult) -> None:
        """The job's result was acknowledged: its spans end, with the outcome."""
        o = self.open.pop(result.job_id, None)
        if o is None:
            return
        span = o.run or o.wait  # the wait: answered without running (refused by the scheduler)
        error = result.error
        span.set_attribute("twinkle.outcome", "ok" if error is None else f"{error.category.value}_error")
        if error is not None and error.category.value != "user":
            span.set_status(_otel.ERROR, error.message[:200])
        span.end()

    def close(self) -> None:
        """The loop stops: end what is open (the jobs go back to the queue)."""
        for o in self.open.values():
            (o.run or o.wait).end()
        self.open.clear()


def end_step(span: Span | None) -> None:
    if span is not None:
        span.end()


def _job_attributes(job: Job, base_model: str) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "twinkle.job.id": job.job_id, "twinkle.job.kind": job.payload.kind, "twinkle.lane": job.lane,
        "twinkle.base_model": base_model, "twinkle.tenant_id": job.tenant_id, "twinkle.model_id": job.model_id,
        "twinkle.seq_id": job.seq_id}
    if job.request_id is not None:
        attributes["twinkle.request_id"] = job.request_id
    tokens = getattr(job.payload, "tokens", None)
    if isinstance(tokens, int):
        attributes["twinkle.job.tokens"] = tokens
    return attributes
