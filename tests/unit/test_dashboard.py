"""The dashboard's pieces without a browser: the per-run loss history (what it records, its bounds), and the
in-process gateway's dashboard routes: the overview per key (a tenant's own only, an operator's every tenant, keys by
prefix), the page and its two assets with their security headers, nothing else served, nothing from elsewhere."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import event

import server.app as app_module
from api_schemas.jobs import (
    ForwardBackward,
    ForwardBackwardResult,
    Job,
    JobError,
    JobResult,
    ModelReady,
    OptimStepResult,
    Output,
    queue_name,
)
from api_schemas.models import ServedModel
from jobqueue.local_queue import LocalQueue
from server.api.dashboard import STATIC
from server.app import create_app
from server.config import Settings
from server.services import lifecycle
from server.services.loss_history import LossHistory
from server.services.tenants import create_key
from tests.unit.test_hot_routes import MODEL, _gateway
from tests.support.embedded import fb_request, tenant_model


def _fb_job(job_id: str, model: str, seq: int, forward_only: bool = False) -> Job:
    tokens = np.arange(4, dtype=np.int64)
    payload = ForwardBackward.build([(tokens, {"target_tokens": tokens})], forward_only=forward_only,
                                    loss_fn="cross_entropy")
    return Job(job_id=job_id, tenant_id="t", base_model="m", lane="train", model_id=model, seq_id=seq,
               payload=payload)


def _loss(value: float) -> JobResult:
    return JobResult(job_id="x", output=ForwardBackwardResult(outputs={}, metrics={"loss:sum": value}))


def test_history_records_training_losses_once_in_order() -> None:
    h = LossHistory()
    for i, loss in enumerate((3.0, 2.5, 2.0)):
        h.queued(_fb_job(f"j{i}", "run", seq=2 * i + 1))
    h.queued(_fb_job("eval", "run", seq=7, forward_only=True))  # an evaluation is no training step
    for i, loss in enumerate((3.0, 2.5, 2.0)):
        h.delivered(f"j{i}", _loss(loss))
    h.delivered("j0", _loss(9.0))  # a second retrieve_future of the same step adds nothing
    h.delivered("eval", _loss(1.0))
    h.delivered("unknown", _loss(1.0))
    assert [(p.seq_id, p.loss, p.tokens) for p in h.of("run")] == [(1, 3.0, 4), (3, 2.5, 4), (5, 2.0, 4)]
    assert h.of("other") == []


def test_history_skips_failures_and_non_finite_losses() -> None:
    h = LossHistory()
    for i in range(3):
        h.queued(_fb_job(f"j{i}", "run", seq=i))
    h.delivered("j0", JobResult(job_id="j0", error=JobError(category="user", message="bad")))
    h.delivered("j1", _loss(math.nan))
    h.delivered("j2", JobResult(job_id="j2", output=OptimStepResult(metrics={}, learning_rate=0.1, step=1)))
    assert h.of("run") == []


def test_history_is_bounded_per_run_runs_and_pending() -> None:
    h = LossHistory(points=3, runs=2, pending=2)
    for i in range(5):
        h.queued(_fb_job(f"a{i}", "a", seq=i))
        h.delivered(f"a{i}", _loss(float(i)))
    assert [p.loss for p in h.of("a")] == [2.0, 3.0, 4.0]  # the last `points`
    for run in ("b", "a", "c"):  # a trained after b: b is the least recently trained run, forgotten first
        h.queued(_fb_job(f"{run}-x", run, seq=99))
        h.delivered(f"{run}-x", _loss(1.0))
    assert h.of("b") == [] and h.of("a") and h.of("c")
    for i in range(3):
        h.queued(_fb_job(f"p{i}", "p", seq=i))
    h.delivered("p0", _loss(1.0))  # the oldest pending job was forgotten
    h.delivered("p2", _loss(2.0))
    assert [p.loss for p in h.of("p")] == [2.0]


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.delenv("TWINKLE_DATABASE_URL", raising=False)
    monkeypatch.delenv("TWINKLE_REDIS_URL", raising=False)
    app, _ = _gateway(tmp_path / "gw", hot=True)
    with TestClient(app) as c:
        yield c


def _keys(c: TestClient) -> dict[str, str]:
    db = c.app.state.ctx.db  # type: ignore[attr-defined]
    out = {}
    for name, admin in (("alpha", False), ("beta", False), ("ops", True)):
        made = lambda n=name, a=admin: create_key(db, n, admin=a)  # noqa: E731
        out[name], _ = c.portal.call(made)  # type: ignore[union-attr,misc]
    return out


def test_overview_per_key(client: TestClient) -> None:
    keys = _keys(client)
    get = lambda key: client.get("/dashboard/api/overview", headers={"X-API-Key": key})  # noqa: E731
    assert client.get("/dashboard/api/overview").status_code == 401
    assert get("tml-unknown").status_code == 401
    alpha = get(keys["alpha"])
    assert alpha.status_code == 200 and alpha.headers["cache-control"] == "no-store"
    body = alpha.json()
    assert (body["role"], body["viewer"], body["service"]) == ("tenant", "alpha", None)
    assert [t["name"] for t in body["tenants"]] == ["alpha"] and body["tenants"][0]["keys"] is None
    op = get(keys["ops"])
    names = {t["name"]: t for t in op.json()["tenants"]}
    assert op.json()["role"] == "operator" and set(names) == {"alpha", "beta", "ops"}
    assert [k["prefix"] for k in names["beta"]["keys"]] == [keys["beta"][:10]]
    assert all(k not in op.text and k[10:] not in op.text for k in keys.values())
    assert {q["lane"] for q in op.json()["service"]["queues"]} == {"train", "sample"}


def test_page_and_assets(client: TestClient) -> None:
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = client.get(f"/dashboard/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    for name in ("index.html", "..%2Fapi%2Fdashboard.py", "missing.js"):
        assert client.get(f"/dashboard/static/{name}").status_code == 404
    assert client.get("/dashboard/static/../../app.py").status_code == 404


def test_no_asset_names_another_origin() -> None:
    for f in STATIC.iterdir():
        text = f.read_text().replace('"http://www.w3.org/2000/svg"', "")  # SVG's namespace name, never fetched
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), f  # no CDN, no external URL
        # server data is set as text, never parsed as markup
        assert not re.search(r"\.(inner|outer)HTML\b|insertAdjacentHTML|document\.write", text), f


# --- loss curves in SQL: written in batches, shown by a restarted gateway, still per tenant ---
def _loss_gateway(data_dir: Path) -> FastAPI:
    """A gateway on `data_dir` whose worker answers a forward_backward at seq_id s with loss:sum 100/s."""
    queue = LocalQueue()
    served = ServedModel(name=MODEL, vocab_size=1000, max_context=1024, tokenizer_id=MODEL)

    async def worker() -> None:
        while True:
            for job in await queue.fetch(queue_name(MODEL, "train"), 1.0):
                out: Output
                if isinstance(job.payload, ForwardBackward):
                    n = job.payload.tokens
                    out = ForwardBackwardResult.of([{"logprobs": np.zeros(n, "f4"),
                                                     "elementwise_loss": np.zeros(n, "f4")}],
                                                   {"loss:sum": 100.0 / job.seq_id})
                else:
                    out = ModelReady(model_id=job.model_id)
                await queue.complete(JobResult(job_id=job.job_id, output=out), job=job)

    return create_app(Settings(data_dir=data_dir, long_poll_seconds=5), queue, {MODEL: served}, background=[worker])


class _Tenant:
    def __init__(self, http: TestClient, name: str) -> None:
        self.http = http
        self.headers, self.model_id = tenant_model(http, MODEL, rank=1, tenant=name)

    def post(self, path: str, body: Any) -> Any:
        return self.http.post(path, json=body, headers=self.headers)

    def step(self, seq: int) -> None:
        fut = self.http.post("/api/v1/forward_backward", content=fb_request(self.model_id, seq, [5, 6, 7, 8, 9]),
                             headers={**self.headers, "Content-Type": "application/x-protobuf"})
        assert fut.status_code == 200, fut.text
        assert self.post("/api/v1/retrieve_future", {"request_id": fut.json()["request_id"]}).status_code == 200

    def curves(self) -> dict[str, list[tuple[int, float]]]:
        body = self.http.get("/dashboard/api/overview", headers=self.headers).json()
        return {r["run_id"]: [(p["seq_id"], p["loss"]) for p in r["losses"]] for t in body["tenants"]
                for r in t["runs"]}


def test_loss_curves_survive_a_restart_and_stay_per_tenant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TWINKLE_DATABASE_URL", raising=False)
    monkeypatch.delenv("TWINKLE_REDIS_URL", raising=False)

    async def no_maintenance(ctx: Any) -> None:  # rounds are run by hand below
        return None

    monkeypatch.setattr(app_module, "run_maintenance", no_maintenance)
    writes: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "loss_points" in statement and not statement.lstrip().upper().startswith("SELECT"):
            writes.append(statement.split()[0].upper())

    with TestClient(_loss_gateway(tmp_path)) as http:
        ctx = http.app.state.ctx  # type: ignore[attr-defined]
        event.listen(ctx.db.engine.sync_engine, "before_cursor_execute", count)
        a, b = _Tenant(http, "alpha"), _Tenant(http, "beta")
        for seq in (1, 2, 3):
            a.step(seq)
        b.step(1)
        assert writes == []  # training steps write nothing to SQL: the points wait in memory
        assert a.curves() == {a.model_id: [(1, 100.0), (2, 50.0), (3, 100 / 3)]}
        http.portal.call(lifecycle.maintain_once, ctx)  # a maintenance round: one batch
        assert writes == ["INSERT", "DELETE"] and ctx.losses.unwritten == 0
        a.step(4)  # written by the shutdown
        a_run, b_run = a.model_id, b.model_id
    assert writes == ["INSERT", "DELETE"] * 2

    with TestClient(_loss_gateway(tmp_path)) as http:  # a new gateway on the same data dir
        ctx = http.app.state.ctx  # type: ignore[attr-defined]
        assert ctx.losses.of(a_run) == []  # nothing in its memory: the curves come from SQL
        a.http = b.http = http
        assert a.curves() == {a_run: [(1, 100.0), (2, 50.0), (3, 100 / 3), (4, 25.0)]}
        assert b.curves() == {b_run: [(1, 100.0)]}
        a.step(5)  # a new point, not written yet, joins the stored ones at once
        assert a.curves()[a_run][-2:] == [(4, 25.0), (5, 20.0)]
        # B naming A's run (it cannot through the dashboard, whose runs are its own) still gets none of its points
        b_id = http.portal.call(_tenant_of, ctx.db, b_run)  # type: ignore[union-attr]
        got = http.portal.call(ctx.losses.curves, ctx.db, b_id, [(a_run, True)])  # type: ignore[union-attr]
        assert got == {}
        fresh = LossHistory()
        assert http.portal.call(fresh.curves, ctx.db, b_id, [(a_run, True)]) == {a_run: []}  # type: ignore[union-attr]


async def _tenant_of(db: Any, model_id: str) -> str:
    from server.db.models import ModelRow

    async with db.session() as s:
        row = await s.get(ModelRow, model_id)
        assert row is not None
        return str(row.tenant_id)
