"""A quiet first start (the key box and the URL, no library INFO lines) and opt-in JSON logs whose request id
follows a training request from the gateway into the worker that ran its job."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import tinker
from tinker import types

from tests.support.server import ServerProcess


def _key(log: str) -> str:
    found = re.findall(r"tml-[A-Za-z0-9_-]{30,}", log)
    assert len(set(found)) == 1, found
    return found[0]


def test_quiet_first_start(tmp_path: Path, server_model_dir: Path) -> None:
    srv = ServerProcess(tmp_path / "d", str(server_model_dir)).start()
    try:
        httpx.get(f"{srv.base_url}/api/v1/healthz")
        log = srv.log()
    finally:
        srv.stop()
    assert "alembic" not in log and "Uvicorn running" not in log and "Waiting for application" not in log, log
    assert "First start: tenant 'default' was created with this API key:" in log
    assert f"Twinkle server listening on {srv.base_url}" in log
    key = _key(log)
    box = [line for line in log.splitlines() if key in line]
    assert len(box) == 1 and box[0].startswith("│") and box[0].rstrip().endswith("│")  # once, inside the box


def test_json_logs_carry_the_request_id_to_the_worker(tmp_path: Path, server_model_dir: Path) -> None:
    srv = ServerProcess(tmp_path / "d", str(server_model_dir), args=("--log-level", "debug", "--log-format", "json"))
    srv.start()
    try:
        key = _key(srv.log())
        echoed = httpx.get(f"{srv.base_url}/api/v1/healthz", headers={"X-Request-Id": "trace-42"})
        assert echoed.headers["x-request-id"] == "trace-42"
        fresh = [httpx.get(f"{srv.base_url}/api/v1/healthz", headers={"X-Request-Id": "a b"}).headers["x-request-id"]
                 for _ in range(2)]  # not a plain token: a fresh id instead, another each time
        assert fresh[0] != fresh[1] and all(re.fullmatch(r"[0-9a-f]{20,}", f) for f in fresh), fresh
        with tinker.ServiceClient(base_url=srv.base_url, api_key=key) as sc:
            tc = sc.create_lora_training_client(base_model=srv.base_model, rank=4).result()
            tokens = [3, 8, 13, 21, 34]
            tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": tokens[1:], "weights": [1.0] * 4})], "cross_entropy").result()
        log = srv.log()
    finally:
        srv.stop()
    records = []
    for line in log.splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
        else:  # the boxes and progress bars are for people, never log records
            assert '"level"' not in line
        assert key not in line or line.startswith("│")  # the key only in its box, never in a log record
        assert key[:10] not in line or line.startswith("│")  # nor its prefix (SQL parameters are never logged)
    assert records and all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    http = [r for r in records if r["logger"] == "twinkle.http" and "POST /api/v1/forward_backward -> 200" in r["msg"]]
    assert len(http) == 1 and http[0]["request_id"]
    rid = http[0]["request_id"]
    worker = [r for r in records if r["logger"] == "workers.dispatcher" and "(forward_backward of" in r["msg"]]
    assert [r["request_id"] for r in worker] == [rid], worker
    assert any(r["logger"] == "twinkle.http" and r.get("request_id") == "trace-42" for r in records)
