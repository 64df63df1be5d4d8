"""A job's fingerprint is the same for the same request wherever it is decoded: an SDK retry after a gateway restart,
or on another gateway, must find its first job (its dedup key), not a 400 "already used for a different request".
Protobuf maps (a datum's loss_fn_inputs) decode in an order that differs from one process to the next; the
fault campaign (benchmarks/fault_campaign.py) found it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from api_schemas.jobs import ForwardBackward, Job

DECODE = r"""
import numpy as np
from api_schemas.jobs import ForwardBackward, Job
from api_schemas.tinker import proto
from api_schemas.tinker.proto import pb

m = pb.ForwardBackwardRequest(model_id="m", seq_id=3, loss_fn="importance_sampling")
for seed in range(2):
    d = m.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(5, 13, dtype="<i4").tobytes()
    for k in ("target_tokens", "weights", "logprobs", "advantages"):
        t = d.loss_fn_inputs[k]
        t.dtype, t.shape[:] = (pb.DTYPE_INT64 if k == "target_tokens" else pb.DTYPE_FLOAT32), [8]
        t.dense = (np.arange(8, dtype="<i8") if k == "target_tokens" else np.full(8, seed, dtype="<f4")).tobytes()
decoded = proto.decode_forward_backward(pb.ForwardBackwardRequest.FromString(m.SerializeToString()))
payload = ForwardBackward.build(proto.batch_datums(decoded), forward_only=False, loss_fn=decoded.loss_fn)
job = Job(job_id="j", tenant_id="t", base_model="b", lane="train", model_id="m", seq_id=3, payload=payload)
print(list(decoded.data[0].inputs), job.fingerprint())
"""


def job(inputs: dict[str, np.ndarray], config: dict[str, float]) -> Job:
    payload = ForwardBackward.build([(np.arange(4), inputs)], forward_only=False, loss_fn="ppo", loss_config=config)
    return Job(job_id="j", tenant_id="t", base_model="b", lane="train", model_id="m", seq_id=1, payload=payload)


def test_key_order_does_not_change_the_fingerprint() -> None:
    a = {"target_tokens": np.arange(4), "weights": np.ones(4, "<f4"), "advantages": np.zeros(4, "<f4")}
    b = dict(reversed(list(a.items())))
    assert list(a) != list(b)
    assert job(a, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).fingerprint() == job(
        b, {"clip_high_threshold": 1.2, "clip_low_threshold": 0.8}).fingerprint()
    assert job(a, {}).fingerprint() != job({**a, "weights": np.zeros(4, "<f4")}, {}).fingerprint()  # content counts


def test_the_same_request_decoded_in_several_processes_has_one_fingerprint() -> None:
    runs = [subprocess.run([sys.executable, "-c", DECODE], capture_output=True, text=True, check=True).stdout.split()
            for _ in range(4)]
    assert len({r[-1] for r in runs}) == 1, runs
