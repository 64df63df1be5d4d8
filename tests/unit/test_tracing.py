"""OpenTelemetry tracing (jobqueue/tracing.py): one trace per request, from the gateway's request span to its jobs'
wait in the queue and run in the worker, through the embedded app (gateway, in-process queue, the real trainer on
the tiny model) and through the dispatcher's merged steps; and nothing at all when tracing is off."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api_schemas.jobs import Job
from deploy.embedded import build_embedded_app
from jobqueue import tracing
from server.config import Settings
from server.services import jobs as job_builder
from tests.support.embedded import fb_request, tenant_model
from tests.support.spans import by_name, recorded_spans
from tests.unit.engine_jobs import create, fb, random_rows
from tests.unit.test_dispatcher import RecordingTrainer, _drive
from workers.checkpoints.store import CheckpointStore
from workers.engine.base_model import BaseModel


@pytest.fixture
def spans() -> Iterator[Any]:
    with recorded_spans() as exporter:
        yield exporter


def _wait_for(exporter: Any, predicate: Any, timeout: float = 10.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        got = list(exporter.get_finished_spans())
        if predicate(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def _job_spans(spans: list[Any], kind: str) -> tuple[Any, Any]:
    wait = [s for s in by_name(spans, "twinkle.job.wait") if s.attributes["twinkle.job.kind"] == kind]
    run = [s for s in by_name(spans, "twinkle.job.run") if s.attributes["twinkle.job.kind"] == kind]
    assert len(wait) == 1 and len(run) == 1, [(s.name, dict(s.attributes)) for s in spans]
    return wait[0], run[0]


def test_a_training_request_is_one_trace_from_gateway_to_worker(spans: Any, tiny_model_dir: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TWINKLE_DATABASE_URL", raising=False)
    monkeypatch.delenv("TWINKLE_REDIS_URL", raising=False)
    settings = Settings(data_dir=tmp_path, base_model=str(tiny_model_dir), long_poll_seconds=20)
    with TestClient(build_embedded_app(settings)) as http:
        headers, model_id = tenant_model(http, str(tiny_model_dir))
        fut = http.post("/api/v1/forward_backward", content=fb_request(model_id, 1, [5, 6, 7, 8, 9]),
                        headers={**headers, "Content-Type": "application/x-protobuf",
                                 "X-Request-Id": "req-traced-1"})
        assert fut.status_code == 200, fut.text
        answer = http.post("/api/v1/retrieve_future", json={"request_id": fut.json()["request_id"]}, headers=headers)
        assert answer.status_code == 200
        db = http.app.state.ctx.db  # type: ignore[attr-defined]
        tenant_id = http.portal.call(_tenant_id, db, "tenant")  # type: ignore[union-attr]

    got = _wait_for(spans, lambda s: len(by_name(s, "twinkle.job.run")) >= 2)
    gateway = by_name(got, "POST /api/v1/forward_backward")
    assert len(gateway) == 1, sorted(s.name for s in got)
    g = gateway[0]
    assert g.kind.name == "SERVER" and g.parent is None  # the trace's root
    assert g.attributes["http.route"] == "/api/v1/forward_backward"
    assert g.attributes["http.response.status_code"] == 200
    assert g.attributes["twinkle.request_id"] == "req-traced-1"
    assert g.attributes["twinkle.tenant_id"] == tenant_id

    wait, run = _job_spans(got, "forward_backward")
    for span in (wait, run):  # children of the request's span, in its trace
        assert span.context.trace_id == g.context.trace_id
        assert span.parent is not None and span.parent.span_id == g.context.span_id
        assert span.attributes["twinkle.tenant_id"] == tenant_id
        assert span.attributes["twinkle.request_id"] == "req-traced-1"
        assert span.attributes["twinkle.model_id"] == model_id
        assert span.attributes["twinkle.seq_id"] == 1 and span.attributes["twinkle.job.tokens"] == 4
    assert run.kind.name == "CONSUMER" and run.attributes["twinkle.outcome"] == "ok"
    assert [e.name for e in wait.events] == ["fetched"]
    # the wait starts where the gateway made the job (inside its request), and ends where the run starts
    assert g.start_time <= wait.start_time <= g.end_time
    assert wait.start_time <= wait.events[0].timestamp <= wait.end_time == run.start_time <= run.end_time

    # the model's creation is a trace of its own, with its own job spans
    create_wait, create_run = _job_spans(got, "create_model")
    create_request = by_name(got, "POST /api/v1/create_model")[0]
    assert create_run.context.trace_id == create_request.context.trace_id != g.context.trace_id
    assert create_wait.parent.span_id == create_request.context.span_id
    # every request is a span; polling is a span of its own trace, not a child of the job's
    polls = by_name(got, "POST /api/v1/retrieve_future")
    assert len(polls) == 2 and all(p.parent is None for p in polls)
    # no span names a tenant, and no attribute holds the key
    assert not any(tenant_id in s.name or "tenant" in s.name for s in got)
    key = headers["X-API-Key"]
    assert not any(key in str(v) or key[:10] in str(v) for s in got for v in s.attributes.values())
    assert all(s.resource.attributes["service.name"] == "twinkle-test" for s in got)


async def _tenant_id(db: Any, name: str) -> str:
    from server.db import repositories as repo

    async with db.session() as s:
        row = await repo.tenant_by_name(s, name)
        assert row is not None
        return str(row.id)


def test_a_merged_step_links_the_jobs_of_several_traces(spans: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two tenants' forward_backwards run as one merged pass: each job's spans stay in its own request's trace, and
    one `twinkle.step` span (a trace of its own) links to both requests; each run span links back to it."""
    tracer = tracing._tracer
    assert tracer is not None
    rng = np.random.default_rng(0)

    def under_request(job: Job) -> tuple[Job, Any]:  # as new_job makes it inside a request's span
        with tracer.start_as_current_span("request") as span:
            return job.model_copy(update=tracing.job_fields()), span

    a, request_a = under_request(fb("a", 1, random_rows(rng, 2, 4, 8)))
    b, request_b = under_request(fb("b", 1, random_rows(rng, 2, 4, 8)))
    assert a.traceparent is not None and a.queued_at_ns is not None
    trainer = RecordingTrainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path))
    results = asyncio.run(_drive(trainer, [[create("a"), create("b")], [a, b]]))
    assert results[a.job_id].ok and results[b.job_id].ok
    assert ["a", "b"] in trainer.steps or ["b", "a"] in trainer.steps  # merged

    got = spans.get_finished_spans()
    steps = [s for s in by_name(got, "twinkle.step") if s.attributes["twinkle.step.merged"]]
    assert len(steps) == 1
    step = steps[0]
    assert step.parent is None and step.attributes["twinkle.step.jobs"] == 2
    assert step.attributes["twinkle.step.tokens"] == a.payload.tokens + b.payload.tokens  # type: ignore[union-attr]
    assert {link.context.span_id for link in step.links} == {request_a.context.span_id, request_b.context.span_id}
    for job, request in ((a, request_a), (b, request_b)):
        wait = [s for s in by_name(got, "twinkle.job.wait") if s.attributes["twinkle.job.id"] == job.job_id]
        run = [s for s in by_name(got, "twinkle.job.run") if s.attributes["twinkle.job.id"] == job.job_id]
        assert len(wait) == len(run) == 1
        assert wait[0].parent.span_id == run[0].parent.span_id == request.context.span_id
        assert run[0].context.trace_id == request.context.trace_id != step.context.trace_id
        assert [link.context.span_id for link in run[0].links] == [step.context.span_id]
        assert step.start_time <= run[0].start_time and run[0].end_time <= step.end_time
    # the creates carried no trace: no spans for them
    assert all(s.attributes.get("twinkle.job.kind") != "create_model" for s in got)


def test_tracing_off_costs_nothing_on_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off, a job made by the builder carries no trace fields, its JSON is what it was before tracing existed, and
    the worker's span bookkeeping never starts."""
    assert not tracing.enabled()
    assert tracing.job_fields() == {} and tracing.start_request("POST") is None
    job = job_builder.new_job(tenant_id="t", base_model="m", model_id="r", seq_id=1,
                              payload=create("r").payload)
    assert job.traceparent is None and job.queued_at_ns is None
    assert "traceparent" not in job.model_dump_json() and "queued_at_ns" not in job.model_dump_json()
    spans = tracing.JobSpans("m")
    spans.fetched(job.model_copy(update={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}))
    assert spans.open == {}


def test_traceparent_parsing() -> None:
    pytest.importorskip("opentelemetry")
    sc = tracing.parse_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    assert sc is not None and sc.trace_id == 0x0AF7651916CD43DD8448EB211C80319C and sc.trace_flags.sampled
    assert sc.span_id == 0xB7AD6B7169203331 and sc.is_remote
    for bad in ("", "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "00-xyz-b7ad6b7169203331-01",
                "00-" + "0" * 32 + "-b7ad6b7169203331-01", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331"):
        assert tracing.parse_traceparent(bad) is None
    assert tracing.traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert tracing.traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"


def test_an_endpoint_without_the_otel_extra_stops_the_start(tmp_path: Path) -> None:
    script = ("import sys\n"
              "sys.modules['opentelemetry.sdk'] = None\n"
              "from deploy.cli import main\n"
              "sys.exit(main(['serve', '--data-dir', sys.argv[1]]))\n")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TWINKLE_OTEL_ENDPOINT": "http://127.0.0.1:4318"}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "d")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pip install 'twinkle-server[otel]'" in done.stderr and not (tmp_path / "d").exists()
