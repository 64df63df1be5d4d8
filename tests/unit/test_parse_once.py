"""A forward_backward request's protobuf body is parsed exactly once on its whole way: the gateway decodes it into
the engine-native job (api_schemas/jobs.py), and quotas, the scheduler and the merged pass read the typed job.

The embedded app runs in this process (gateway, in-process queue, the real trainer on the tiny model), so every
parse, wherever it happens, goes through the counted `ForwardBackwardRequest.FromString`."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb

from deploy.embedded import build_embedded_app
from server.config import Settings
from tests.support.embedded import fb_request, tenant_model


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
        headers, model_id = tenant_model(http, str(tiny_model_dir))
        body = fb_request(model_id, 1, [5, 6, 7, 8, 9])
        fut = http.post("/api/v1/forward_backward", content=body,
                        headers={**headers, "Content-Type": "application/x-protobuf"}).json()
        answer = http.post("/api/v1/retrieve_future", json={"request_id": fut["request_id"]}, headers=headers)
        assert answer.status_code == 200 and answer.headers["content-type"] == "application/x-protobuf", answer.text
        out = pb.ForwardBackwardOutput.FromString(answer.content)
        assert out.metrics["loss:sum"] > 0 and out.loss_fn_outputs[0].num_datums == 1
    assert parses == [len(body)]
