"""A forward_backward request's protobuf body is parsed exactly once on its whole way: the gateway decodes it into
the engine-native job (api_schemas/jobs.py), and quotas, the scheduler and the merged pass read the typed job.

The embedded app runs in this process (gateway, in-process queue, the real trainer on the tiny model), so every
parse, wherever it happens, goes through the counted `ForwardBackwardRequest.FromString`."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb

from deploy.embedded import build_embedded_app
from server.config import Settings
from server.services.tenants import create_key


def _request(model_id: str, seq_id: int, tokens: list[int]) -> bytes:
    n = len(tokens) - 1
    datum = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=struct.pack(f"<{n}i", *tokens[:-1])))])
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=np.asarray(tokens[1:], "<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[n]))
    datum.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=np.ones(n, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32,
                                                       shape=[n]))
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", data=[datum])
    return msg.SerializeToString()


def test_one_protobuf_parse_per_forward_backward(tiny_model_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TWINKLE_DATABASE_URL", raising=False)
    monkeypatch.delenv("TWINKLE_REDIS_URL", raising=False)
    # a tokens-per-minute quota makes admission size every job too (it must read the typed job, not the body)
    monkeypatch.setenv("TWINKLE_QUOTA_TOKENS_PER_MINUTE", "1000000")
    settings = Settings(data_dir=tmp_path, base_model=str(tiny_model_dir), long_poll_seconds=20)
    parses = []
    original = pb.ForwardBackwardRequest.FromString

    def counted(raw: bytes) -> pb.ForwardBackwardRequest:
        parses.append(len(raw))
        return original(raw)

    monkeypatch.setattr(pb.ForwardBackwardRequest, "FromString", staticmethod(counted))
    with TestClient(build_embedded_app(settings)) as http:
        key, _ = http.portal.call(create_key, http.app.state.ctx.db, "tenant")  # type: ignore[union-attr]
        headers = {"X-API-Key": key}
        sid = http.post("/api/v1/create_session", json={"tags": []}, headers=headers).json()["session_id"]
        made = http.post("/api/v1/create_model", headers=headers, json={
            "session_id": sid, "model_seq_id": 0, "base_model": str(tiny_model_dir), "lora_config": {"rank": 2}}).json()
        assert http.post("/api/v1/retrieve_future", json={"request_id": made["request_id"]},
                         headers=headers).status_code == 200
        body = _request(made["model_id"], 1, [5, 6, 7, 8, 9])
        fut = http.post("/api/v1/forward_backward", content=body,
                        headers={**headers, "Content-Type": "application/x-protobuf"}).json()
        answer = http.post("/api/v1/retrieve_future", json={"request_id": fut["request_id"]}, headers=headers)
        assert answer.status_code == 200 and answer.headers["content-type"] == "application/x-protobuf", answer.text
        out = pb.ForwardBackwardOutput.FromString(answer.content)
        assert out.metrics["loss:sum"] > 0 and out.loss_fn_outputs[0].num_datums == 1
    assert parses == [len(body)]
