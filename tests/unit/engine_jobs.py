"""Job builders shared by the engine tests (merged passes, paging, dispatcher)."""

from __future__ import annotations

import uuid

import numpy as np

from api_schemas.jobs import CreateModel, ForwardBackward, ForwardBackwardResult, Job, JobResult, OptimStep
from api_schemas.training import AdamW, LoraSpec

ADAM = AdamW(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.01, grad_clip_norm=0.0)


def job(model_id: str, seq: int, payload, tenant: str | None = None) -> Job:  # type: ignore[no-untyped-def]
    return Job(job_id=str(uuid.uuid4()), tenant_id=tenant or f"t-{model_id}", base_model="tiny", model_id=model_id,
               seq_id=seq, payload=payload)


def create(model_id: str, rank: int = 4, seed: int = 0, tenant: str | None = None, **targets: bool) -> Job:
    return job(model_id, 0, CreateModel(lora=LoraSpec(rank=rank, seed=seed, **targets)), tenant)


def optim(model_id: str, seq: int) -> Job:
    return job(model_id, seq, OptimStep(optimizer=ADAM))


def fb(model_id: str, seq: int, rows: list[list[int]], *, forward_only: bool = False, weights: float = 1.0,
       tenant: str | None = None) -> Job:
    """A cross_entropy forward(_backward) job: each row predicts its own next tokens."""
    datums = []
    for tokens in rows:
        n = len(tokens) - 1
        w = np.linspace(0.5, 1.5, n).astype("<f4") * weights
        datums.append((np.asarray(tokens[:-1]), {"target_tokens": np.asarray(tokens[1:]), "weights": w}))
    batch = ForwardBackward.build(datums, forward_only=forward_only, loss_fn="cross_entropy")
    return job(model_id, seq, batch, tenant)


def random_rows(rng: np.random.Generator, count: int, low: int, high: int, vocab: int = 300) -> list[list[int]]:
    return [rng.integers(3, vocab, size=int(rng.integers(low, high + 1))).tolist() for _ in range(count)]


def loss_of(body: bytes) -> float:
    """loss:sum of a forward_backward result (its body, as a queue carries it)."""
    output = JobResult.from_body("", body).output
    assert isinstance(output, ForwardBackwardResult), output
    return float(output.metrics["loss:sum"])
