"""Fuzzing: schemathesis over the server's own /openapi.json with two tenants' keys, and protobuf bodies of random
and truncated bytes. Target: no 5xx, no answer the document does not declare (status, content type, schema).

Bounded: TWINKLE_FUZZ_EXAMPLES cases per operation and pass (positive, negative, and positive with tenant A's real
ids and paths in place of generated ones, so cases reach past the lookups; default 4), on
the tiny model, the fuzzers' own server (conftest.fuzz_server; whatever the fuzzer creates stays there). Run it alone:
    .venv/bin/python -m pytest -q tests/conformance/test_fuzz.py -s     (prints the figures)
"""

from __future__ import annotations

import os
import random
import struct

import httpx
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from tests.conformance.fuzzing import Report, fuzz
from tests.conformance.isolation_world import World, build
from tests.support.server import ServerProcess

EXAMPLES = int(os.environ.get("TWINKLE_FUZZ_EXAMPLES", "4"))


def _known(w: World) -> dict[str, str]:
    """Tenant A's real ids and paths, by the parameter and body field names the routes use."""
    run_ckpt = {"run_id": w.run, "model_id": w.run, "kind": "weights", "name": "s", "checkpoint_id": "weights/s"}
    paths = {k: w.weights for k in ("path", "tinker_path", "source_path", "twinkle_path", "name_or_path")}
    return {**run_ckpt, **paths, "session_id": w.session, "sampler_id": w.sampling_session,
            "sampling_session_id": w.sampling_session, "request_id": w.future, "push_id": w.push_id,
            "provider": "huggingface", "model": w.base_model, "base_model": w.base_model, "model_path": w.sampler,
            "processor_id": w.processor, "adapter_uri": w.native_path, "loss_id": w.loss_id}


def test_schemathesis_finds_no_server_error_and_no_contract_violation(fuzz_server: ServerProcess) -> None:
    report = Report()
    keys = [fuzz_server.api_key_a, fuzz_server.api_key_b]  # type: ignore[attr-defined]
    fuzz(fuzz_server.base_url, keys, EXAMPLES, report, known=_known(build(fuzz_server)))
    print("\nfuzz:", report.summary())
    assert report.cases >= 200 * EXAMPLES, report.summary()  # ~100 operations x 3 passes: the run reached them all
    assert fuzz_server.running(), fuzz_server.log()
    assert not report.failures, report.summary()


def _model(srv: ServerProcess, key: str) -> str:
    h = {"X-API-Key": key}
    session = httpx.post(f"{srv.base_url}/api/v1/create_session", json={"tags": []}, headers=h).json()["session_id"]
    made = httpx.post(f"{srv.base_url}/api/v1/create_model", headers=h, json={
        "session_id": session, "model_seq_id": 0, "base_model": srv.base_model, "lora_config": {"rank": 2}}).json()
    return str(made["model_id"])


def _body(model_id: str, seq_id: int) -> bytes:
    tokens, targets = [5, 6, 7, 8], [6, 7, 8, 9]
    datum = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=struct.pack("<4i", *tokens)))])
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=np.asarray(targets, "<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[4]))
    datum.loss_fn_inputs["weights"].CopyFrom(
        pb.Tensor(dense=np.ones(4, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[4]))
    return pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, data=[datum, datum],
                                     loss_fn="cross_entropy").SerializeToString()


def _parses(body: bytes) -> bool:
    try:
        pb.ForwardBackwardRequest.FromString(body)
        return True
    except DecodeError:
        return False


def test_protobuf_bodies_of_random_and_truncated_bytes_get_4xx(fuzz_server: ServerProcess) -> None:
    key = fuzz_server.api_key_a  # type: ignore[attr-defined]
    url = f"{fuzz_server.base_url}/api/v1/forward_backward"
    full = _body(_model(fuzz_server, key), 1)
    rng = random.Random(19)
    bodies = [("random", rng.randbytes(rng.randint(0, 400))) for _ in range(60)]
    bodies += [("truncated", full[:n]) for n in range(0, len(full), max(1, len(full) // 60))]
    bodies += [("flipped", bytes(b ^ (1 << rng.randrange(8)) if i == at else b for i, b in enumerate(full)))
               for at in rng.sample(range(len(full)), 30)]
    bodies += [("zstd garbage", rng.randbytes(64))]
    statuses: dict[str, list[int]] = {}
    with httpx.Client(headers={"X-API-Key": key}, timeout=60) as http:
        for kind, body in bodies:
            headers = {"Content-Type": "application/x-protobuf"}
            if kind == "zstd garbage":
                headers["Content-Encoding"] = "zstd"
            r = http.post(url, content=body, headers=headers)
            statuses.setdefault(kind, []).append(r.status_code)
            assert r.status_code < 500, (kind, body[:80], r.status_code, r.text)
            if r.status_code == 200:  # only a body that still is a whole, valid request (e.g. cut between datums)
                assert kind != "random" and _parses(body), (kind, body[:80], r.text)
            else:
                assert 400 <= r.status_code < 500 and r.json()["category"] == "user", (kind, r.status_code, r.text)
    print("\nprotobuf fuzz:", {k: len(v) for k, v in statuses.items()}, "accepted:",
          sum(s == 200 for v in statuses.values() for s in v))
    assert fuzz_server.running()
