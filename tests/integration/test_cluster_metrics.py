"""The cluster wiring (gateway + Redis + a separate `twinkle-server worker`): the worker's metrics reach the
gateway's /metrics through Redis with a `worker` label, by the right amounts, and a training request's id is in
the gateway's JSON log line and in the worker's line about its job."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.integration.conftest import running
from tests.support.prom import scrape, value
from tests.support.server import ServerProcess, WorkerProcess

pytest.importorskip("redis")

TOKENS = [3, 8, 13, 21, 34, 55, 89]


def _records(log: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def test_worker_metrics_and_request_ids_cross_redis(tiny_model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    env = {"TWINKLE_REDIS_URL": redis_url, "TWINKLE_REDIS_PREFIX": f"m{uuid.uuid4().hex[:8]}",
           "TWINKLE_METRICS_PUBLISH_SECONDS": "0.3", "TWINKLE_LOG_FORMAT": "json", "TWINKLE_LOG_LEVEL": "DEBUG"}
    gateway = ServerProcess(tmp_path, str(tiny_model_dir), env=env)
    worker = WorkerProcess(tmp_path, str(tiny_model_dir), env=env)
    key = gateway.create_key("tenant-m")
    with running(gateway, worker):  # checked while the session lives: finishing it releases the adapter
        with tinker.ServiceClient(base_url=gateway.base_url, api_key=key) as sc:
            tc = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
            tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={
                "target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})], "cross_entropy").result()
            deadline = time.monotonic() + 10
            while True:  # the worker publishes every 0.3 s
                samples = scrape(gateway.base_url)
                trained = value(samples, "twinkle_tokens_total", kind="trained")
                if trained or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        workers = {dict(ls).get("worker") for (n, ls) in samples if n == "twinkle_tokens_total"}
        assert trained == len(TOKENS) - 1 and len(workers) == 1, samples
        label = workers.pop()
        assert label is not None and label.startswith("worker@")
        assert value(samples, "twinkle_jobs_total", kind="forward_backward", outcome="ok", worker=label) == 1
        assert value(samples, "twinkle_adapters", tier="device", worker=label) == 1
        # the gateway's own families carry no worker label
        assert value(samples, "twinkle_http_requests_total", route="/api/v1/forward_backward", status="200") == 1
        assert all("worker" not in dict(ls) for (n, ls) in samples if n == "twinkle_http_requests_total")
        assert value(samples, "twinkle_queue_depth", lane="train") == 0

        http = [r for r in _records(gateway.log()) if r["logger"] == "twinkle.http"
                and "POST /api/v1/forward_backward -> 200" in r["msg"]]
        assert len(http) == 1
        done = [r for r in _records(worker.log()) if r["logger"] == "workers.dispatcher"
                and "(forward_backward of" in r["msg"]]
        assert [r.get("request_id") for r in done] == [http[0]["request_id"]]
