"""The gate (server/api/gate.py): authentication before the body, bounded bodies, and its place in the stack.

Requests are driven as raw ASGI calls into a started app where the test must see how much of a body was read:
the body comes from a `receive` that counts what it handed out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_schemas.tinker.custom_loss import MAX_REQUEST_BYTES as CUSTOM_LOSS_BYTES
from server.api.gate import Gate
from server.api.hot_routes import ROUTES
from server.auth.credentials import OPENAI_KEY, TINKER_KEY, api_key
from tests.unit.test_hot_routes import ADAM, Gateway, _gateway

LIMIT = 4096  # the test gateway's max_request_bytes
MISSING = "missing X-API-Key header"
MISSING_OPENAI = "missing API key: send Authorization: Bearer tml-... (or X-API-Key)"
INVALID = "invalid or revoked API key"


class Recorder:
    """A middleware like a metrics one: records each request's path and answer status."""

    seen: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                Recorder.seen.append((scope["path"], message["status"]))
            await send(message)

        await self.app(scope, receive, recording)


@pytest.fixture
def gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gateway]:
    monkeypatch.delenv("TWINKLE_DATABASE_URL", raising=False)
    monkeypatch.delenv("TWINKLE_REDIS_URL", raising=False)
    app, _ = _gateway(tmp_path / "gw", hot=True)
    app.add_middleware(Recorder)  # after create_app, as a deployment would add one
    Recorder.seen = []
    with TestClient(app) as client:
        yield Gateway(client)


class Body:
    """A client body: `chunks` chunks of `size` bytes (forever when None), counting what the app received."""

    def __init__(self, size: int = 1 << 20, chunks: int | None = None) -> None:
        self.size, self.chunks, self.received = size, chunks, 0

    async def receive(self) -> Message:
        if self.chunks is not None and self.received >= self.size * self.chunks:
            return {"type": "http.disconnect"}
        self.received += self.size
        more = self.chunks is None or self.received < self.size * self.chunks
        return {"type": "http.request", "body": b"x" * self.size, "more_body": more}


def _call(g: Gateway, path: str, headers: dict[str, str], body: Body, method: str = "POST") -> tuple[int, Any]:
    raw = [(k.lower().encode(), v.encode()) for k, v in {"content-type": "application/json", **headers}.items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": raw,
             "client": ("test", 1), "server": ("testserver", 80)}
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    app: FastAPI = g.http.app  # type: ignore[assignment]
    g.http.portal.call(app, scope, body.receive, send)  # type: ignore[union-attr]
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(payload)


ROUTES_BY_KIND = [  # (path, headers a client sends besides the key): hot, FastAPI JSON, FastAPI streamed, OpenAI
    ("/api/v1/optim_step", {}),
    ("/api/v1/forward_backward", {"Content-Type": "application/x-protobuf"}),
    ("/api/v1/save_weights", {}),
    ("/api/v1/create_custom_loss", {}),
]


@pytest.mark.parametrize("path,headers", ROUTES_BY_KIND)
def test_no_or_a_wrong_key_is_refused_before_the_body_is_read(gateway: Gateway, path: str,
                                                              headers: dict[str, str]) -> None:
    for key, detail in ((None, MISSING), ("", MISSING), ("tml-wrong", INVALID), ("no-prefix", INVALID)):
        body = Body()  # endless: reading any of it would never end
        status, answer = _call(gateway, path, {**headers, **({"X-API-Key": key} if key is not None else {}),
                                               "Content-Length": str(1 << 40)}, body)
        assert (status, answer) == (401, {"detail": detail, "category": "user"})
        assert body.received == 0
    body = Body()
    assert _call(gateway, "/v1/chat/completions", {"Authorization": "Bearer tml-wrong"}, body) == \
        (401, {"detail": INVALID, "category": "user"})
    assert _call(gateway, "/v1/chat/completions", {}, body) == (401, {"detail": MISSING_OPENAI, "category": "user"})
    assert body.received == 0


@pytest.mark.parametrize("path,headers", ROUTES_BY_KIND)
def test_a_body_over_the_limit_is_a_413_read_no_further_than_the_limit(gateway: Gateway, path: str,
                                                                      headers: dict[str, str]) -> None:
    limit = CUSTOM_LOSS_BYTES if path.endswith("custom_loss") else LIMIT
    detail = (f"a create_custom_loss body may have at most {limit} bytes" if path.endswith("custom_loss")
              else f"request body exceeds the limit of {limit} bytes")
    expected = (413, {"detail": detail, "category": "user"})
    keyed = {**headers, "X-API-Key": gateway.key}
    unread = Body()
    assert _call(gateway, path, {**keyed, "Content-Length": str(limit + 1)}, unread) == expected
    assert unread.received == 0  # refused on its Content-Length
    for chunk in (1000, limit + 1):  # no Content-Length (chunked): read up to the first chunk past the limit
        streamed = Body(size=chunk)
        assert _call(gateway, path, keyed, streamed) == expected
        assert limit < streamed.received <= limit + chunk
    at_limit = Body(size=limit, chunks=1)  # exactly the limit passes the gate (then is refused for what it is)
    status, _ = _call(gateway, path, {**keyed, "Content-Length": str(limit)}, at_limit)
    assert status in (400, 404, 422)


def test_a_client_that_goes_away_mid_body_queues_nothing(gateway: Gateway) -> None:
    sent: list[Message] = []
    messages: list[Message] = [{"type": "http.request", "body": b'{"model_id"', "more_body": True},
                               {"type": "http.disconnect"}]

    async def receive() -> Message:
        return messages.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/api/v1/optim_step", "headers": [(b"x-api-key",
             gateway.key.encode())], "query_string": b"", "root_path": ""}
    gateway.http.portal.call(gateway.http.app, scope, receive, send)  # type: ignore[union-attr,arg-type]
    assert sent == []
    r = gateway.post("/api/v1/optim_step", {"model_id": gateway.model_id, "seq_id": 1, "adam_params": ADAM})
    assert gateway.post("/api/v1/retrieve_future", {"request_id": r.json()["request_id"]}).json() == {"metrics": {}}


def test_middleware_added_to_the_app_sees_the_per_step_routes(gateway: Gateway,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    app: FastAPI = gateway.http.app  # type: ignore[assignment]
    assert app.user_middleware[-1].cls is Gate  # innermost: every other middleware is in front of it
    served_fast: list[str] = []
    for path, route in ROUTES.items():
        async def spy(*args: Any, _run: Any = route.run, _path: str = path) -> Any:
            served_fast.append(_path)
            return await _run(*args)
        monkeypatch.setitem(ROUTES, path, type(route)(route.request, spy))
    Recorder.seen.clear()
    r = gateway.post("/api/v1/optim_step", {"model_id": gateway.model_id, "seq_id": 1, "adam_params": ADAM})
    done = gateway.post("/api/v1/retrieve_future", {"request_id": r.json()["request_id"]})
    assert done.json() == {"metrics": {}}
    gateway.post("/api/v1/optim_step", {"seq_id": 2})  # FastAPI's 422, through the same stack
    gateway.http.post("/api/v1/asample", json={})  # no key: the gate's 401
    assert served_fast == ["/api/v1/optim_step", "/api/v1/retrieve_future"]
    assert Recorder.seen == [("/api/v1/optim_step", 200), ("/api/v1/retrieve_future", 200),
                             ("/api/v1/optim_step", 422), ("/api/v1/asample", 401)]


def test_each_route_family_takes_its_key_in_its_headers(gateway: Gateway) -> None:
    key, http = gateway.key, gateway.http
    for headers in ({"Authorization": f"Bearer {key}"}, {"X-API-Key": key}, {"Authorization": f"bearer  {key} "},
                    {"Authorization": "Basic abc", "X-API-Key": key}):
        assert http.get("/v1/models", headers=headers).status_code == 200, headers
    r = http.get("/v1/models", headers={"Authorization": "Bearer ", "X-API-Key": key})  # a Bearer header wins
    assert (r.status_code, r.json()["detail"]) == (401, MISSING_OPENAI)
    for headers in ({"Authorization": f"Bearer {key}"}, {"Twinkle-Authorization": f"Bearer {key}"}):
        r = http.post("/api/v1/create_session", json={"tags": []}, headers=headers)  # older SDKs under twinkle-kit
        assert r.status_code == 200, (headers, r.text)
    r = http.post("/api/v1/create_session", json={"tags": []}, headers={"Authorization": f"Token {key}"})
    assert (r.status_code, r.json()["detail"]) == (401, MISSING)  # the Tinker routes: X-API-Key or a Bearer key
    assert http.get("/healthz").status_code == 200  # no key needed


def test_api_key_reads_the_accepted_headers_in_order() -> None:
    def key(accepted: Any, **headers: str) -> str | None:
        return api_key([(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()], accepted)

    assert key(TINKER_KEY, x_api_key="tml-a", authorization="Bearer tml-b") == "tml-a"
    assert key(TINKER_KEY, authorization="Bearer tml-b") == "tml-b"
    assert key(TINKER_KEY, twinkle_authorization="Bearer tml-c") == "tml-c"
    assert key(TINKER_KEY, authorization="Basic abc") is None
    assert key(OPENAI_KEY, x_api_key="tml-a", authorization="Bearer tml-b") == "tml-b"
    assert key(OPENAI_KEY, x_api_key="tml-a", authorization="Token tml-b") == "tml-a"
    assert key(OPENAI_KEY, authorization="BEARER   tml-b  ") == "tml-b"
    assert key(OPENAI_KEY, authorization="Bearer ", x_api_key="tml-a") == ""
    assert api_key([(b"x-api-key", b"tml-1"), (b"x-api-key", b"tml-2")], TINKER_KEY) == "tml-1"


def test_a_route_the_gate_does_not_see_authenticates_in_its_dependency(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TWINKLE_DATABASE_URL", raising=False)
    app, _ = _gateway(tmp_path / "bare", hot=True)
    app.user_middleware = [m for m in app.user_middleware if m.cls is not Gate]
    with TestClient(app) as client:
        g = Gateway(client)  # creates a session and a model with its key
        r = client.post("/api/v1/create_session", json={"tags": []})
        assert (r.status_code, r.json()) == (401, {"detail": MISSING, "category": "user"})
        r = client.post("/api/v1/create_session", json={"tags": []}, headers={"X-API-Key": "tml-wrong"})
        assert (r.status_code, r.json()) == (401, {"detail": INVALID, "category": "user"})
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {g.key}"}).status_code == 200
