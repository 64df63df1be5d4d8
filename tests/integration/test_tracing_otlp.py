"""Tracing as an operator turns it on (TWINKLE_OTEL_ENDPOINT): `twinkle-server serve` exports its spans over
OTLP/HTTP to a collector (here a tiny receiver recording POSTs to /v1/traces), and in the cluster wiring the
worker process's spans of a job join the gateway's trace of the request, the trace context having crossed Redis in
the job."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import tinker
from tinker import types

from tests.integration.conftest import running
from tests.support.otlp import OtlpReceiver
from tests.support.server import ServerProcess, WorkerProcess, free_port

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
pytest.importorskip("redis")

TOKENS = [3, 8, 13, 21, 34, 55, 89]


def _train_one_step(server: ServerProcess, key: str, base_model: str) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=key) as sc:
        tc = sc.create_lora_training_client(base_model=base_model, rank=4).result()
        tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={
            "target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})], "cross_entropy").result()


def _spans_of_the_step(receiver: OtlpReceiver, timeout: float = 20.0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The forward_backward request's span and the job spans of its trace, once the worker's run span arrived."""
    deadline = time.monotonic() + timeout
    while True:
        spans = receiver.spans()
        requests = [s for s in spans if s["name"] == "POST /api/v1/forward_backward"]
        if requests:
            trace = [s for s in spans if s["trace_id"] == requests[0]["trace_id"] and s is not requests[0]]
            if any(s["name"] == "twinkle.job.run" for s in trace) or time.monotonic() > deadline:
                return requests[0], trace
        elif time.monotonic() > deadline:
            raise AssertionError(f"no forward_backward span arrived: {[s['name'] for s in spans]}")
        time.sleep(0.2)


def _check(request: dict[str, Any], trace: list[dict[str, Any]], worker_process: str) -> None:
    assert request["parent_span_id"] == "" and request["attributes"]["http.route"] == "/api/v1/forward_backward"
    assert request["resource"]["service.name"] == "twinkle-ops-test"
    assert request["resource"]["twinkle.process"] == "gateway"
    names = sorted(s["name"] for s in trace)
    assert names == ["twinkle.job.run", "twinkle.job.wait"], names
    for span in trace:
        assert span["parent_span_id"] == request["span_id"]
        assert span["attributes"]["twinkle.job.kind"] == "forward_backward"
        assert span["attributes"]["twinkle.tenant_id"] == request["attributes"]["twinkle.tenant_id"]
        assert span["resource"]["twinkle.process"] == worker_process
    run = next(s for s in trace if s["name"] == "twinkle.job.run")
    assert run["attributes"]["twinkle.outcome"] == "ok"


def test_serve_exports_a_request_trace_over_otlp_http(tiny_model_dir: Path, tmp_path: Path) -> None:
    with OtlpReceiver() as receiver:
        env = {"TWINKLE_OTEL_ENDPOINT": receiver.url, "TWINKLE_OTEL_SERVICE_NAME": "twinkle-ops-test",
               "OTEL_BSP_SCHEDULE_DELAY": "100"}
        server = ServerProcess(tmp_path, str(tiny_model_dir), env=env)
        key = server.create_key("tenant-t")
        try:
            server.start()
            _train_one_step(server, key, str(tiny_model_dir))
            request, trace = _spans_of_the_step(receiver)
            _check(request, trace, "gateway")  # embedded: the worker runs in the gateway's process
        except BaseException:
            print(server.log())
            raise
        finally:
            server.stop()
        assert {path for path, _ in receiver.posts} == {"/v1/traces"}
        assert key not in str(receiver.spans())


def test_cluster_trace_crosses_redis(tiny_model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    with OtlpReceiver() as receiver:
        env = {"TWINKLE_REDIS_URL": redis_url, "TWINKLE_REDIS_PREFIX": f"o{uuid.uuid4().hex[:8]}",
               "TWINKLE_OTEL_ENDPOINT": receiver.url + "/v1/traces", "TWINKLE_OTEL_SERVICE_NAME": "twinkle-ops-test",
               "OTEL_BSP_SCHEDULE_DELAY": "100"}
        gateway = ServerProcess(tmp_path, str(tiny_model_dir), env=env)
        worker = WorkerProcess(tmp_path, str(tiny_model_dir), env=env)
        key = gateway.create_key("tenant-c")
        with running(gateway, worker):
            _train_one_step(gateway, key, str(tiny_model_dir))
            request, trace = _spans_of_the_step(receiver)
            _check(request, trace, "worker")


def test_doctor_checks_the_collector(tmp_path: Path) -> None:
    def doctor(endpoint: str) -> str:
        out = subprocess.run([sys.executable, "-m", "deploy.cli", "doctor", "--data-dir", str(tmp_path), "--port",
                              str(free_port()), "--base-model", str(tmp_path)], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1", "TWINKLE_OTEL_ENDPOINT": endpoint})
        return next(line.strip() for line in out.stdout.splitlines() if line[8:].startswith("tracing"))

    with OtlpReceiver() as receiver:
        line = doctor(receiver.url)
        assert line.startswith("ok") and f"{receiver.url}/v1/traces" in line, line
        assert receiver.posts == [("/v1/traces", b"")]
    closed = doctor(f"http://127.0.0.1:{free_port()}")
    assert closed.startswith("FAIL") and "TWINKLE_OTEL_ENDPOINT" in closed, closed


def test_ray_replicas_get_the_tracing_settings() -> None:
    pytest.importorskip("ray")
    from deploy.ray_app import worker_options
    from server.config import Settings

    opts = worker_options(Settings(redis_url="redis://127.0.0.1:6379/0", otel_endpoint="http://collector:4318",
                                   otel_service_name="twinkle-ray"))
    assert (opts.otel_endpoint, opts.otel_service_name) == ("http://collector:4318", "twinkle-ray")
    assert worker_options(Settings(redis_url="redis://127.0.0.1:6379/0")).otel_endpoint is None
