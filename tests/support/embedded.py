"""The embedded app driven in-process (FastAPI's TestClient): a tenant, its LoRA model, and a forward_backward body
in the Tinker SDK's protobuf, for tests that watch what one request does inside the server."""

from __future__ import annotations

import struct

import numpy as np
from fastapi.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb

from server.services.tenants import create_key


def tenant_model(http: TestClient, base_model: str, rank: int = 2,
                 tenant: str = "tenant") -> tuple[dict[str, str], str]:
    """A new tenant's key headers and the id of a LoRA model it created (the create's future already collected)."""
    key, _ = http.portal.call(create_key, http.app.state.ctx.db, tenant)  # type: ignore[attr-defined,union-attr]
    headers = {"X-API-Key": key}
    sid = http.post("/api/v1/create_session", json={"tags": []}, headers=headers).json()["session_id"]
    made = http.post("/api/v1/create_model", headers=headers, json={
        "session_id": sid, "model_seq_id": 0, "base_model": base_model, "lora_config": {"rank": rank}}).json()
    done = http.post("/api/v1/retrieve_future", json={"request_id": made["request_id"]}, headers=headers)
    assert done.status_code == 200 and done.json()["model_id"] == made["model_id"], done.text
    return headers, made["model_id"]


def fb_request(model_id: str, seq_id: int, tokens: list[int]) -> bytes:
    """A cross_entropy ForwardBackwardRequest of one datum predicting `tokens[1:]`, as the SDK encodes it."""
    n = len(tokens) - 1
    chunk = pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=struct.pack(f"<{n}i", *tokens[:-1])))
    datum = pb.Datum(model_input=[chunk])
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=np.asarray(tokens[1:], "<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[n]))
    datum.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=np.ones(n, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32,
                                                       shape=[n]))
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", data=[datum])
    return msg.SerializeToString()
