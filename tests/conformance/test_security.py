"""Auth, tenant isolation and input validation: every bad request gets a 4xx JSON body before anything is queued."""

from __future__ import annotations

import shutil
import struct
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from tests.conformance.test_sft import batch
from tests.support.server import ServerProcess, cli


def _post(server: ServerProcess, path: str, key: str | None, **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
    headers = {"X-API-Key": key} if key else {}
    headers.update(kw.pop("headers", {}))
    return httpx.post(f"{server.base_url}/api/v1/{path}", headers=headers, timeout=30, **kw)


def _fb_body(model_id: str, seq_id: int, tokens: list[int], targets: list[int], weights: list[float],
             loss_fn: str = "cross_entropy") -> bytes:
    datum = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=struct.pack(f"<{len(tokens)}i", *tokens)))])
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=np.asarray(targets, "<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[len(targets)]))
    datum.loss_fn_inputs["weights"].CopyFrom(
        pb.Tensor(dense=np.asarray(weights, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[len(weights)]))
    return pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, data=[datum], loss_fn=loss_fn).SerializeToString()


def _result(server: ServerProcess, key: str, request_id: str) -> httpx.Response:
    deadline = time.monotonic() + 30  # a held-back job (a seq_id gap) would make this fail, not pass slowly
    while time.monotonic() < deadline:
        r = _post(server, "retrieve_future", key, json={"request_id": request_id})
        if r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again":
            continue
        return r
    raise AssertionError(f"future {request_id} did not complete within 30 s")


def _raw_model(server: ServerProcess, key: str) -> str:
    """A model driven by raw HTTP, so the test controls its seq_ids."""
    session = _post(server, "create_session", key, json={"tags": [], "user_metadata": {}}).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": server.base_model, "lora_config": {"rank": 2, "seed": 0}}
    fut = _post(server, "create_model", key, json=body).json()
    assert "model_id" in _result(server, key, fut["request_id"]).json()
    return str(fut["model_id"])


def _fb(server: ServerProcess, key: str, body: bytes) -> httpx.Response:
    return _post(server, "forward_backward", key, content=body, headers={"Content-Type": "application/x-protobuf"})


@pytest.fixture(scope="module")
def model_a(server: ServerProcess):  # type: ignore[no-untyped-def]
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a)
    tc = sc.create_lora_training_client(base_model=server.base_model, rank=2).result()
    yield sc, tc
    sc.close("success")


def test_missing_wrong_and_revoked_keys_get_401(server: ServerProcess) -> None:
    for key in (None, "tml-not-a-real-key", "no-prefix"):
        r = _post(server, "create_session", key, json={"tags": [], "user_metadata": {}})
        assert r.status_code == 401 and "detail" in r.json(), r.text
    key = server.create_key("tenant-revoked")  # the conformance server caches keys for 1 s (TWINKLE_AUTH_CACHE_SECONDS)
    assert _post(server, "create_session", key, json={}).status_code == 200
    rows = [line.split() for line in cli("keys", "list", data_dir=server.data_dir).splitlines()[1:]]
    key_id = next(row[0] for row in rows if row[1] == "tenant-revoked")
    cli("keys", "revoke", key_id, data_dir=server.data_dir)  # returns once every gateway has looked for the change
    assert _post(server, "create_session", key, json={}).status_code == 401
    assert server.api_key_a not in (server.data_dir / "twinkle.db").read_bytes().decode("latin-1")  # hashed only


def test_other_tenant_gets_404_for_models_and_futures(server: ServerProcess, model_a) -> None:  # type: ignore[no-untyped-def]
    model_id = _raw_model(server, server.api_key_a)
    b = server.api_key_b
    assert _post(server, "get_info", b, json={"model_id": model_id}).status_code == 404
    r = _post(server, "optim_step", b, json={"model_id": model_id, "seq_id": 99, "adam_params": {}})
    assert r.status_code == 404 and "not found" in r.json()["detail"]
    body = _fb_body(model_id, 100, [1, 2, 3], [2, 3, 4], [1, 1, 1])
    r = _post(server, "forward_backward", b, content=body, headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 404
    # a future of tenant A, asked for by tenant B
    r = _fb(server, server.api_key_a, _fb_body(model_id, 1, [5, 6], [6, 7], [1, 1]))
    assert r.status_code == 200, r.text
    req_id = r.json()["request_id"]
    assert _post(server, "retrieve_future", b, json={"request_id": req_id}).status_code == 404
    assert _result(server, server.api_key_a, req_id).headers["content-type"] == "application/x-protobuf"


@pytest.mark.parametrize(
    "make_body, detail",
    [
        (lambda m, s: b"\xff\x00garbage", "protobuf"),  # unparseable: its seq_id is unknown, nothing to consume
        # token ids outside the vocabulary, NaN / Inf loss inputs: tests/conformance/test_input_limits.py
        (lambda m, s: _fb_body(m, s, [1, 2, 3], [2, 3, 4], [1, 1, 1], loss_fn="no_such_loss"), "no_such_loss"),
        (lambda m, s: _fb_body(m, s, [1, 2, 3], [2, 3], [1, 1]), "target_tokens"),
        (lambda m, s: _fb_body("nobody:train:0", s, [1], [2], [1]), "not found"),
    ],
)
def test_bad_forward_backward_input_is_4xx_and_model_keeps_working(server: ServerProcess, make_body, detail) -> None:  # type: ignore[no-untyped-def]
    key = server.api_key_a
    model_id = _raw_model(server, key)
    r = _fb(server, key, make_body(model_id, 1))
    assert 400 <= r.status_code < 500, r.text
    assert detail in r.json()["detail"], r.json()
    # a rejection of a request for this model consumes its seq_id: seq 2 then runs at once instead of waiting
    next_seq = 2 if detail not in ("protobuf", "not found") else 1
    r = _fb(server, key, _fb_body(model_id, next_seq, [1, 2, 3], [2, 3, 4], [1, 1, 1]))
    assert r.status_code == 200, r.text
    out = _result(server, key, r.json()["request_id"])
    assert out.headers["content-type"] == "application/x-protobuf", out.text


def test_failed_job_is_a_failed_future_and_the_worker_goes_on(server: ServerProcess, model_a) -> None:  # type: ignore[no-untyped-def]
    sc, tc = model_a
    path = tc.save_state("to-be-lost").result().path
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    (folder,) = server.data_dir.glob(f"checkpoints/*/{run_id}/{kind}/{name}")
    shutil.rmtree(folder)
    with pytest.raises(tinker.RequestFailedError) as err:
        sc.create_training_client_from_state(path).result()
    assert "not found" in str(err.value)
    out = tc.forward_backward(batch(), "cross_entropy").result()
    assert np.isfinite(out.metrics["loss:sum"])


def test_retry_with_same_seq_id_runs_once_and_a_different_payload_is_rejected(server: ServerProcess) -> None:
    key = server.api_key_a
    model_id = _raw_model(server, key)
    body = _fb_body(model_id, 1, [1, 2, 3], [2, 3, 4], [1, 1, 1])
    first = _fb(server, key, body).json()["request_id"]
    assert _fb(server, key, body).json()["request_id"] == first  # a retry gets the same future
    other = _fb(server, key, _fb_body(model_id, 1, [1, 2, 3], [2, 3, 5], [1, 1, 1]))
    assert other.status_code == 400 and "different" in other.json()["detail"]
    assert _result(server, key, first).headers["content-type"] == "application/x-protobuf"
    step = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.1}}
    r = _post(server, "optim_step", key, json=step)
    assert _post(server, "optim_step", key, json=step).json()["request_id"] == r.json()["request_id"]
    norm = _result(server, key, r.json()["request_id"]).json()["metrics"]["grad_norm"]
    # exactly one accumulation happened: same gradient norm as a twin model (same seed) that saw the batch once
    twin = _raw_model(server, key)
    assert _result(server, key, _fb(server, key, _fb_body(twin, 1, [1, 2, 3], [2, 3, 4], [1, 1, 1])).json()["request_id"])
    r = _post(server, "optim_step", key, json={**step, "model_id": twin})
    assert _result(server, key, r.json()["request_id"]).json()["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-6)
    assert norm > 0
