"""The OpenAPI document is true about errors: real error answers of a running server (401, 400, 403, 404, 410,
413, 422) each have a status the document declares for their route and a body that matches its schema.

No route answers 409 (publishing twice is a success: a 409 would be retried by the SDK for minutes), so none is
declared and none is sent here.
"""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema
import pytest

from tests.conformance.openapi_check import Contract
from tests.support.server import ServerProcess


@pytest.fixture(scope="module")
def contract(server: ServerProcess) -> Contract:
    return Contract(httpx.get(f"{server.base_url}/openapi.json", timeout=30).json())


def _call(server: ServerProcess, method: str, path: str, key: str | None, **kw: Any) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    headers.update(kw.pop("headers", {}))
    return httpx.request(method, f"{server.base_url}{path}", headers=headers, timeout=30, **kw)


def test_the_document_declares_our_bodies_not_fastapis(contract: Contract) -> None:
    schemas = contract.doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    for path, ops in contract.doc["paths"].items():
        for status, answer in (item for op in ops.values() for item in op["responses"].items()):
            if status.startswith(("4", "5")) and path != "/readyz":  # /readyz's 503 is its report (Readiness)
                ref = answer["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ValidationErrorBody" if status == "422" else "/ErrorBody"), (status, ref)
    with pytest.raises(jsonschema.ValidationError):  # the schema is strict enough to tell the forms apart
        jsonschema.validate({"detail": [{"loc": ["body"], "msg": "x", "type": "missing"}]},
                            {"$ref": "#/components/schemas/ValidationErrorBody", **contract.doc})


def test_real_errors_match_the_document(server: ServerProcess, contract: Contract) -> None:
    a, b = server.api_key_a, server.api_key_b  # type: ignore[attr-defined]
    seen: dict[int, list[str]] = {}

    def expect(status: int, method: str, path: str, key: str | None, **kw: Any) -> httpx.Response:
        r = _call(server, method, path, key, **kw)
        assert r.status_code == status, (method, path, r.status_code, r.text[:300])
        contract.check(r)
        assert r.json()["category"] == "user"
        seen.setdefault(status, []).append(path)
        return r

    # 401: no key, an unknown key, on Tinker, native, REST and OpenAI routes
    expect(401, "POST", "/api/v1/create_session", None, json={"tags": []})
    expect(401, "POST", "/api/v1/create_session", "tml-not-a-key", json={"tags": []})
    expect(401, "GET", "/api/v1/training_runs", "tml-not-a-key")
    expect(401, "GET", "/v1/models", None)
    expect(401, "POST", "/api/v1/twinkle/create_session", "tml-nope", json={})
    # 422: a body that does not validate, in our form (detail, category, errors)
    r = expect(422, "POST", "/api/v1/create_model", a, json={"session_id": 5})
    assert r.json()["errors"] and r.json()["detail"] == "invalid request body"
    expect(422, "POST", "/api/v1/retrieve_future", a, content=b"{not json", headers={"Content-Type": "application/json"})
    expect(422, "GET", "/api/v1/training_runs", a, params={"limit": "many"})
    # what the fuzzer found as 500s (SQL INTEGER overflows): now refused as they come in
    expect(422, "GET", "/api/v1/training_runs", a, params={"offset": 2**70})
    expect(422, "GET", "/api/v1/checkpoints", a, params={"offset": 2**31})
    expect(400, "GET", "/api/v1/twinkle/training_runs", a, params={"offset": 2**70})
    expect(422, "GET", f"/api/v1/downloads/{2**70}/x", None, params={"expires": 1, "sig": "x"})
    for seq in ({"model_seq_id": 2**31}, {"sampling_session_seq_id": 2**70}):
        path = "/api/v1/create_model" if "model_seq_id" in seq else "/api/v1/create_sampling_session"
        expect(422, "POST", path, a, json={"session_id": "s", "base_model": server.base_model, **seq})
    # 400: a protobuf body that does not parse, a bad limit, a loss we do not serve
    expect(400, "POST", "/api/v1/forward_backward", a, content=b"\xff\x00garbage",
           headers={"Content-Type": "application/x-protobuf"})
    expect(400, "GET", "/api/v1/twinkle/training_runs", a, params={"limit": 0})
    # 404: unknown ids, and tenant A's ids for tenant B
    session = _call(server, "POST", "/api/v1/create_session", a, json={"tags": []}).json()["session_id"]
    expect(404, "POST", "/api/v1/retrieve_future", a, json={"request_id": "no-such-future"})
    expect(404, "GET", "/api/v1/training_runs/no-such-run", a)
    expect(404, "GET", f"/api/v1/sessions/{session}", b)
    expect(404, "POST", "/v1/chat/completions", b, json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    expect(404, "GET", "/native/v1/pushes/no-such-push", a)
    # a download URL of an export that does not exist (no key needed; the signature is the permission; a
    # tampered or expired signature's 403 is in test_isolation_matrix.py, which makes a real export)
    expect(404, "GET", "/api/v1/downloads/999999/adapter_model.safetensors", None,
           params={"expires": 2_000_000_000, "sig": "00"})
    # 410: a finished session's heartbeat
    assert _call(server, "POST", f"/api/v1/sessions/{session}/finish", a, json={}).status_code == 200
    expect(410, "POST", "/api/v1/session_heartbeat", a, json={"session_id": session})
    # 413: a body over the route's bound (create_custom_loss: 512 KiB)
    expect(413, "POST", "/api/v1/create_custom_loss", a, content=b"{" + b" " * (600 * 1024) + b"}",
           headers={"Content-Type": "application/json"})
    assert sorted(seen) == [400, 401, 404, 410, 413, 422], seen
