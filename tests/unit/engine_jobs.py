"""Job builders shared by the engine tests (merged passes, paging, dispatcher)."""

from __future__ import annotations

import struct
import uuid

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from api_schemas.jobs import (
    AdamSpec,
    CreateModel,
    ForwardBackward,
    Job,
    LoraSpec,
    OptimStep,
)

ADAM = AdamSpec(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.01, grad_clip_norm=0.0)


def job(model_id: str, seq: int, payload, tenant: str | None = None) -> Job:  # type: ignore[no-untyped-def]
    return Job(job_id=str(uuid.uuid4()), tenant_id=tenant or f"t-{model_id}", base_model="tiny", model_id=model_id,
               seq_id=seq, payload=payload, result_type="x")


def create(model_id: str, rank: int = 4, seed: int = 0, tenant: str | None = None, **targets: bool) -> Job:
    return job(model_id, 0, CreateModel(lora=LoraSpec(rank=rank, seed=seed, **targets)), tenant)


def optim(model_id: str, seq: int) -> Job:
    return job(model_id, seq, OptimStep(adam=ADAM))


def fb(model_id: str, seq: int, rows: list[list[int]], *, forward_only: bool = False, weights: float = 1.0,
       tenant: str | None = None) -> Job:
    """A cross_entropy forward(_backward) job: each row predicts its own next tokens."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn="cross_entropy", forward_only=forward_only)
    for tokens in rows:
        n = len(tokens) - 1
        datum = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(
            tokens=struct.pack(f"<{n}i", *tokens[:-1])))])
        datum.loss_fn_inputs["target_tokens"].CopyFrom(
            pb.Tensor(dense=np.asarray(tokens[1:], "<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[n]))
        w = np.linspace(0.5, 1.5, n).astype("<f4") * weights
        datum.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=w.tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[n]))
        msg.data.append(datum)
    return job(model_id, seq, ForwardBackward(request_pb=msg.SerializeToString(), forward_only=forward_only), tenant)


def random_rows(rng: np.random.Generator, count: int, low: int, high: int, vocab: int = 300) -> list[list[int]]:
    return [rng.integers(3, vocab, size=int(rng.integers(low, high + 1))).tolist() for _ in range(count)]


def loss_of(body: bytes) -> float:
    out = pb.ForwardBackwardOutput.FromString(body)
    return float(out.metrics["loss:sum"])
