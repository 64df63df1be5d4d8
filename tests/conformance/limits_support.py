"""Helpers of the input-limits table (test_input_limits.py): one tenant's raw-HTTP view (a session, a model whose
seq_ids the test keeps, a sampling session) and the request bodies the table sends."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from tests.conformance.test_security import _result
from tests.support.server import ServerProcess

PROTO = {"Content-Type": "application/x-protobuf"}


@dataclass
class Tenant:
    """One tenant's raw-HTTP view: a session, a model whose seq_ids the test keeps, a sampling session."""

    srv: ServerProcess
    key: str
    http: httpx.Client = field(init=False)
    session: str = ""
    model: str = ""
    seq: int = 1
    sampler: str = ""
    sample_seq: int = 1

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.srv.base_url, headers={"X-API-Key": self.key}, timeout=60)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        if "json" in kw:  # NaN and Infinity as Python's json writes them (httpx refuses to)
            kw["content"], kw["headers"] = json.dumps(kw.pop("json")), {"Content-Type": "application/json"}
        return self.http.post(path if path.startswith("/") else f"/api/v1/{path}", **kw)

    def ok(self, path: str, **kw: Any) -> Any:
        r = self.post(path, **kw)
        assert r.status_code == 200, (path, r.text)
        return r.json()

    def new_session(self) -> str:
        return str(self.ok("create_session", json={"tags": []})["session_id"])

    def create_model(self, session: str, seq: int, rank: int = 2) -> httpx.Response:
        return self.post("create_model", json={"session_id": session, "model_seq_id": seq,
                                               "base_model": self.srv.base_model, "lora_config": {"rank": rank}})

    def setup(self) -> Tenant:
        self.session = self.new_session()
        fut = self.create_model(self.session, 0).json()
        assert "model_id" in _result(self.srv, self.key, fut["request_id"]).json()
        self.model = fut["model_id"]
        self.sampler = self.ok("create_sampling_session", json={
            "session_id": self.session, "sampling_session_seq_id": 0, "base_model": self.srv.base_model,
        })["sampling_session_id"]
        return self

    def take_seq(self) -> int:
        self.seq += 1
        return self.seq - 1

    def fb(self, body: Callable[[str, int], bytes]) -> httpx.Response:
        """A protobuf forward_backward on the model at its next seq_id (a 400 from the service consumes it)."""
        r = self.post("forward_backward", content=body(self.model, self.seq), headers=PROTO)
        self.seq += r.status_code in (200, 400)
        return r

    def json_fb(self, datums: list[dict[str, Any]]) -> httpx.Response:
        """0.16.1's JSON forward_backward body."""
        body = {"model_id": self.model, "seq_id": self.seq,
                "forward_backward_input": {"data": datums, "loss_fn": "cross_entropy"}}
        r = self.post("forward_backward", content=json.dumps(body), headers={"Content-Type": "application/json"})
        self.seq += r.status_code in (200, 400)
        return r

    def sample(self, tokens: list[int], num_samples: int = 1, **params: Any) -> httpx.Response:
        self.sample_seq += 1
        return self.post("asample", json={"sampling_session_id": self.sampler, "seq_id": self.sample_seq, "num_samples":
                                          num_samples, "prompt": {"chunks": [{"type": "encoded_text",
                                                                              "tokens": tokens}]},
                                          "sampling_params": {"max_tokens": 1, **params}})

    def done(self, r: httpx.Response) -> Any:
        """An accepted request's future, retrieved: it must succeed."""
        assert r.status_code == 200, r.text
        out = _result(self.srv, self.key, r.json()["request_id"])
        assert out.status_code == 200 and "error" not in (out.json() if out.headers["content-type"].startswith(
            "application/json") else {}), out.text
        return out


def jdatum(tokens: list[int], weights: list[float] | None = None) -> dict[str, Any]:
    n = len(tokens)
    w = [1.0] * n if weights is None else weights
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]}, "loss_fn_inputs": {
        "target_tokens": {"data": tokens, "dtype": "int64", "shape": [n]},
        "weights": {"data": w, "dtype": "float32", "shape": [n]}}}


def is_body(model: str, seq: int, advantages: list[float]) -> bytes:
    """An importance_sampling forward_backward of one datum with these advantages."""
    n = len(advantages)
    datum = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=struct.pack(f"<{n}i", *[5] * n)))])
    for name, arr, dt in (("target_tokens", np.full(n, 6, "<i8"), pb.DTYPE_INT64),
                          ("logprobs", np.full(n, -1.0, "<f4"), pb.DTYPE_FLOAT32),
                          ("advantages", np.asarray(advantages, "<f4"), pb.DTYPE_FLOAT32)):
        datum.loss_fn_inputs[name].CopyFrom(pb.Tensor(dense=arr.tobytes(), dtype=dt, shape=[n]))
    return pb.ForwardBackwardRequest(model_id=model, seq_id=seq, data=[datum],
                                     loss_fn="importance_sampling").SerializeToString()
