"""Per-tenant quotas end to end: `twinkle-server tenants set-quota`, held requests answered with
`try_again` + `paused_rate_limit`, released without loss; the stock SDK trains and samples through the limits."""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from tests.support.server import ServerProcess, cli


@pytest.fixture(scope="module")
def limited(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # short long-polls, so a held request is seen as held instead of waited for
    srv = ServerProcess(tmp_path_factory.mktemp("quota-server"), str(tiny_model_dir),
                        env={"TWINKLE_LONG_POLL_SECONDS": "1", "TWINKLE_QUOTA_CACHE_SECONDS": "0",
                             "TWINKLE_ACCESS_LOG": "true"})  # the 429s are checked in the access log
    srv.key_q = srv.create_key("q")  # type: ignore[attr-defined]
    srv.key_s = srv.create_key("s")  # type: ignore[attr-defined]
    cli("tenants", "set-quota", "q", "--tokens-per-minute", "600", "--max-models", "1", data_dir=srv.data_dir)
    cli("tenants", "set-quota", "s", "--tokens-per-minute", "60", data_dir=srv.data_dir)
    assert "600" in cli("tenants", "list", data_dir=srv.data_dir)
    srv.start()
    yield srv
    srv.stop()


def _post(http: httpx.Client, path: str, **kw: Any) -> Any:
    r = http.post(f"/api/v1/{path}", **kw)
    assert r.status_code == 200, r.text
    return r.json()


def _model(http: httpx.Client, base_model: str) -> tuple[str, str, str]:
    """(session id, model id, request id of the create)"""
    session = _post(http, "create_session", json={"tags": []})["session_id"]
    fut = _post(http, "create_model", json={"session_id": session, "model_seq_id": 0, "base_model": base_model,
                                            "lora_config": {"rank": 2}})
    return session, fut["model_id"], fut["request_id"]


def _fb_body(model_id: str, seq: int, rows: list[list[int]]) -> bytes:
    """A cross_entropy forward_backward request as the SDK sends it (protobuf): each row predicts its next tokens."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn="cross_entropy")
    for tokens in rows:
        n = len(tokens) - 1
        datum = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(
            tokens=struct.pack(f"<{n}i", *tokens[:-1])))])
        datum.loss_fn_inputs["target_tokens"].CopyFrom(
            pb.Tensor(dense=np.asarray(tokens[1:], "<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[n]))
        datum.loss_fn_inputs["weights"].CopyFrom(
            pb.Tensor(dense=np.ones(n, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[n]))
        msg.data.append(datum)
    return msg.SerializeToString()


def _poll(http: httpx.Client, request_id: str, deadline: float = 60) -> tuple[Any, list[Any]]:
    """The final answer of a future and every try_again seen before it."""
    waits, end = [], time.monotonic() + deadline
    while time.monotonic() < end:
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        body = r.json() if r.headers["content-type"].startswith("application/json") else r.content
        if not (isinstance(body, dict) and body.get("type") == "try_again"):
            return body, waits
        waits.append(body)
    raise AssertionError(f"{request_id} did not finish; try_agains: {waits[-3:]}")


def test_held_requests_report_paused_rate_limit_and_complete(limited: ServerProcess) -> None:
    headers = {"X-API-Key": limited.key_q}  # type: ignore[attr-defined]
    with httpx.Client(base_url=limited.base_url, headers=headers, timeout=30) as http:
        session, model, _ = _model(http, limited.base_model)
        big = _fb_body(model, 1, [[5] * 591])  # 590 of the 600 tokens a minute
        small = _fb_body(model, 2, [[6] * 41])  # needs 30 more: held ~3 s
        proto = {"content-type": "application/x-protobuf"}
        first = _post(http, "forward_backward", content=big, headers=proto)["request_id"]
        second = _post(http, "forward_backward", content=small, headers=proto)["request_id"]
        body, waits = _poll(http, second)
        assert isinstance(body, bytes)  # the ForwardBackwardOutput protobuf: the request was not lost
        paused = [w for w in waits if w.get("queue_state") == "paused_rate_limit"]
        assert paused and "tokens per minute" in paused[0]["queue_state_reason"], waits
        assert isinstance(_poll(http, first)[0], bytes)

        # models limit 1: a second live run waits until the first one's session finishes
        _, other_model, create_id = _model(http, limited.base_model)
        r = http.post("/api/v1/retrieve_future", json={"request_id": create_id})
        assert r.json().get("queue_state") == "paused_rate_limit", r.text
        assert "models limit" in r.json()["queue_state_reason"]
        _post(http, f"sessions/{session}/finish", json={})
        answer, _ = _poll(http, create_id)
        assert answer.get("model_id") == other_model, answer


def test_sdk_trains_and_samples_through_the_limits(limited: ServerProcess) -> None:
    key = limited.key_s  # type: ignore[attr-defined]
    rows = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]] * 2  # 20 tokens a step at 60 tokens a minute
    data = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                        loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)}) for r in rows]
    with tinker.ServiceClient(base_url=limited.base_url, api_key=key) as sc:
        tc = sc.create_lora_training_client(base_model=limited.base_model, rank=2).result()
        start = time.monotonic()
        losses = []
        for _ in range(4):  # 80 tokens: the last step waits for the bucket (~20 s)
            fut = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(fut.result().metrics["loss:sum"])
        assert time.monotonic() - start > 10
        assert all(math.isfinite(x) for x in losses) and losses[0] != losses[-1]  # every step ran and trained
        sampler = sc.create_sampling_client(base_model=limited.base_model).result()
        params = types.SamplingParams(max_tokens=4, temperature=0.0)
        out = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, params).result()  # 429s, then it goes
        assert len(out.sequences[0].tokens) >= 1
    assert " 429 " in limited.log() or "429 Too Many Requests" in limited.log()
