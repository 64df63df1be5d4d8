"""The per-step routes answered by server/api/hot_routes.py give the same answers as their FastAPI routes.

Two gateways in this process on the in-process queue: one as served, one whose gate has no fast path (FastAPI
answers everything). A no-op worker completes each job. Every request below goes to both; status,
content type, headers that matter and bodies (ids aside) must be equal, for answers and for errors.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.middleware import Middleware

from api_schemas.jobs import JobResult, OptimStepResult, queue_name
from api_schemas.models import ServedModel
from jobqueue.local_queue import LocalQueue
from server.api.gate import Gate
from server.api.hot_routes import ROUTES
from server.app import create_app
from server.config import Settings
from server.services.tenants import create_key

MODEL = "test/noop"
ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


def _gateway(tmp: Path, hot: bool) -> tuple[FastAPI, LocalQueue]:
    tmp.mkdir()
    queue = LocalQueue()
    served = ServedModel(name=MODEL, vocab_size=1000, max_context=1024, tokenizer_id=MODEL)

    async def worker() -> None:  # answers every training job at once, with an empty metrics body
        while True:
            for job in await queue.fetch(queue_name(MODEL, "train"), 1.0):
                out = OptimStepResult(metrics={}, learning_rate=0.0, step=0)  # answered as {"metrics": {}}
                await queue.complete(JobResult(job_id=job.job_id, output=out), job=job)

    settings = Settings(data_dir=tmp, max_request_bytes=4096, long_poll_seconds=5)
    app = create_app(settings, queue, {MODEL: served}, background=[worker])
    if not hot:
        app.user_middleware = [Middleware(Gate, *m.args, **{**m.kwargs, "hot": {}}) if m.cls is Gate else m
                               for m in app.user_middleware]
    return app, queue


class Gateway:
    def __init__(self, client: TestClient) -> None:
        self.http = client
        self.key, _ = client.portal.call(create_key, client.app.state.ctx.db, "tenant")  # type: ignore[union-attr]
        self.headers = {"X-API-Key": self.key}
        sid = self.post("/api/v1/create_session", {"tags": []}).json()["session_id"]
        made = self.post("/api/v1/create_model", {"session_id": sid, "model_seq_id": 0, "base_model": MODEL,
                                                  "lora_config": {"rank": 1}}).json()
        assert self.post("/api/v1/retrieve_future", {"request_id": made["request_id"]}).status_code == 200
        self.model_id = made["model_id"]

    def post(self, path: str, body: Any = None, content: bytes | None = None, **headers: str):  # type: ignore[no-untyped-def]
        return self.http.post(path, json=body, content=content, headers={**self.headers, **headers})


@pytest.fixture
def gateways(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Gateway, Gateway]]:
    monkeypatch.delenv("TWINKLE_DATABASE_URL", raising=False)
    monkeypatch.delenv("TWINKLE_REDIS_URL", raising=False)
    hot_app, _ = _gateway(tmp_path / "hot", hot=True)
    plain_app, _ = _gateway(tmp_path / "plain", hot=False)
    with TestClient(hot_app) as hot, TestClient(plain_app) as plain:
        yield Gateway(hot), Gateway(plain)


def _same(a, b, ids: tuple[str, ...] = (), names: tuple[str, str] = ("", "")) -> None:  # type: ignore[no-untyped-def]
    """Same status, content type, Retry-After and body; `ids` are fields that hold fresh ids, `names` the two
    gateways' model ids (as they appear in messages)."""
    assert a.status_code == b.status_code, (a.text, b.text)
    assert a.headers["content-type"] == b.headers["content-type"]
    assert a.headers.get("retry-after") == b.headers.get("retry-after")
    ja, jb = (json.loads(r.text.replace(n, "<model>") if n else r.text) for r, n in ((a, names[0]), (b, names[1])))
    for k in ids:
        assert isinstance(ja.pop(k), str) and isinstance(jb.pop(k), str)
    assert ja == jb


def test_the_hot_lane_answers_what_fastapi_answers(gateways: tuple[Gateway, Gateway]) -> None:
    hot, plain = gateways
    assert all(path.startswith("/api/v1/") for path in ROUTES)

    def both(path: str, body: Any = None, content: bytes | None = None, ids: tuple[str, ...] = (),
             **headers: str) -> tuple[Any, Any]:
        def fill(g: Gateway) -> Any:
            return {**body, "model_id": g.model_id} if isinstance(body, dict) and "model_id" in body else body
        a = hot.post(path, fill(hot), content, **headers)
        b = plain.post(path, fill(plain), content, **headers)
        _same(a, b, ids, (hot.model_id, plain.model_id))
        return a, b

    # a step: optim_step queues a future, retrieve_future returns the worker's bytes
    a, b = both("/api/v1/optim_step", {"model_id": "", "seq_id": 1, "adam_params": ADAM}, ids=("request_id", "model_id"))
    ra, rb = (g.post("/api/v1/retrieve_future", {"request_id": r.json()["request_id"]}) for g, r in ((hot, a), (plain, b)))
    _same(ra, rb)
    assert ra.json() == {"metrics": {}}
    # a retry of the same seq_id is the same future
    again = hot.post("/api/v1/optim_step", {"model_id": hot.model_id, "seq_id": 1, "adam_params": ADAM})
    assert again.json()["request_id"] == a.json()["request_id"]

    # errors: body that does not validate (FastAPI's 422), service errors, authentication, unknown ids
    both("/api/v1/optim_step", {"seq_id": 2})
    both("/api/v1/optim_step", {"model_id": "", "seq_id": 2, "adam_params": {**ADAM, "beta1": 1.5}})
    both("/api/v1/optim_step", {"model_id": "not-a-model", "seq_id": 2, "adam_params": ADAM})
    both("/api/v1/optim_step", {"model_id": "", "seq_id": 2, "adam_params": ADAM})  # seq 2 now holds the rejection
    both("/api/v1/optim_step", {"model_id": "", "seq_id": 3, "adam_params": ADAM}, **{"X-API-Key": "tml-wrong"})
    both("/api/v1/retrieve_future", {"request_id": str(uuid.uuid4())})
    both("/api/v1/retrieve_future", {"request_id": 5})
    both("/api/v1/forward_backward", content=b"\x00not protobuf", **{"Content-Type": "application/x-protobuf"})
    # the JSON body of older SDKs (0.16.1): a future, a rejection of its contents, a body without its batch
    datum = {"model_input": {"chunks": [{"tokens": [5, 6, 7]}]},
             "loss_fn_inputs": {"target_tokens": {"data": [6, 7, 8], "dtype": "int64", "shape": [3]},
                                "weights": {"data": [1.0, 1.0, 1.0], "dtype": "float32", "shape": [3]}}}
    batch = {"data": [datum], "loss_fn": "cross_entropy", "loss_fn_config": None}
    both("/api/v1/forward_backward", {"model_id": "", "seq_id": 3, "forward_backward_input": batch},
         ids=("request_id", "model_id"))
    outside = {**datum, "model_input": {"chunks": [{"tokens": [5, 6, 5000]}]}}
    both("/api/v1/forward_backward", {"model_id": "", "seq_id": 4, "forward_backward_input": {**batch, "data": [outside]}})
    both("/api/v1/forward_backward", {"model_id": "", "seq_id": 5})
    both("/api/v1/asample", {"prompt": {"chunks": []}, "num_samples": 1, "sampling_params": {}})
    for g in (hot, plain):  # no key at all
        r = g.http.post("/api/v1/optim_step", json={"model_id": g.model_id, "seq_id": 2, "adam_params": ADAM})
        assert r.status_code == 401 and r.json()["detail"] == "missing X-API-Key header"


def test_the_hot_lane_bounds_bodies_and_passes_other_requests_on(
        gateways: tuple[Gateway, Gateway], monkeypatch: pytest.MonkeyPatch) -> None:
    hot, _ = gateways
    served_here: list[str] = []
    for path, route in ROUTES.items():
        async def spy(*args: Any, _run: Any = route.run, _path: str = path) -> Any:
            served_here.append(_path)
            return await _run(*args)
        monkeypatch.setitem(ROUTES, path, dataclasses.replace(route, run=spy))
    big = {"model_id": hot.model_id, "seq_id": 3, "adam_params": ADAM, "pad": "x" * 5000}
    r = hot.post("/api/v1/optim_step", big)
    assert r.status_code == 413 and r.json()["category"] == "user", r.text
    # not JSON: FastAPI's answer, as before the hot lane existed
    r = hot.post("/api/v1/optim_step", content=b"seq_id=3", **{"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 422, r.text
    assert hot.http.get("/api/v1/optim_step", headers=hot.headers).status_code == 405
    # nothing above queued anything: the next seq_id still runs
    r = hot.post("/api/v1/optim_step", {"model_id": hot.model_id, "seq_id": 1, "adam_params": ADAM})
    done = hot.post("/api/v1/retrieve_future", {"request_id": r.json()["request_id"]})
    assert done.status_code == 200 and done.json() == {"metrics": {}}
    assert served_here == ["/api/v1/optim_step", "/api/v1/retrieve_future"]  # by the hot lane, not FastAPI
