"""The engine in-process on the tiny model: optim_step equals torch.optim.AdamW, adapters never touch each other."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from api_schemas.jobs import CreateModel, ForwardBackward, Job, OptimStep
from api_schemas.training import AdamW, LoraSpec
from workers.checkpoints.store import CheckpointStore
from workers.engine.base_model import BaseModel
from workers.engine.trainer import Trainer


def _job(model_id: str, seq: int, payload) -> Job:  # type: ignore[no-untyped-def]
    return Job(job_id=str(uuid.uuid4()), tenant_id="t", base_model="tiny", model_id=model_id, seq_id=seq,
               payload=payload)


def _fb(model_id: str, seq: int, tokens: list[int], weight: float = 1.0) -> Job:
    n = len(tokens) - 1
    datum = (np.asarray(tokens[:-1]), {"target_tokens": np.asarray(tokens[1:]), "weights": np.full(n, weight, "<f4")})
    return _job(model_id, seq, ForwardBackward.build([datum], forward_only=False, loss_fn="cross_entropy"))


@pytest.fixture()
def trainer(tiny_model_dir: Path, tmp_path: Path) -> Trainer:
    return Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path / "ckpt"))


def _ok(trainer: Trainer, job: Job) -> None:
    result = trainer.execute(job)
    assert result.ok, result.error


def test_optim_step_equals_torch_adamw(trainer: Trainer) -> None:
    _ok(trainer, _job("m", 0, CreateModel(lora=LoraSpec(rank=4, seed=7))))
    adam = AdamW(learning_rate=3e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.05, grad_clip_norm=0.0)
    adapter = trainer.pool.get("m")
    ref = [p.detach().clone().requires_grad_(True) for p in adapter.params]
    opt = torch.optim.AdamW(ref, lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                            weight_decay=adam.weight_decay)
    for step in range(3):
        _ok(trainer, _fb("m", 1 + 2 * step, [5, 9, 30, 44, 2, 17, 8]))
        for r, g in zip(ref, adapter.grads):
            r.grad = g.clone()
        opt.step()
        _ok(trainer, _job("m", 2 + 2 * step, OptimStep(optimizer=adam)))
        diff = max((r - p).abs().max().item() for r, p in zip(ref, adapter.params))
        assert diff < 1e-6, (step, diff)
    assert max(p.abs().max().item() for p in adapter.params[1::2]) > 0  # B moved away from zero: not vacuous


def test_adapters_and_base_are_isolated(trainer: Trainer) -> None:
    base_before = {k: v.clone() for k, v in trainer.base.model.state_dict().items()}
    _ok(trainer, _job("a", 0, CreateModel(lora=LoraSpec(rank=2, seed=1))))
    _ok(trainer, _job("b", 0, CreateModel(lora=LoraSpec(rank=2, seed=2))))
    b_before = [p.detach().clone() for p in trainer.pool.get("b").params]
    adam = AdamW(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)
    for step in range(2):
        _ok(trainer, _fb("a", 1 + 2 * step, [3, 4, 5, 6, 7]))
        _ok(trainer, _job("a", 2 + 2 * step, OptimStep(optimizer=adam)))
    assert all(g is None for g in trainer.pool.get("b").grads)
    assert all(torch.equal(x, y) for x, y in zip(b_before, trainer.pool.get("b").params))
    after = trainer.base.model.state_dict()
    for k, v in base_before.items():
        if "lora" not in k:
            assert torch.equal(v, after[k]), k


def test_non_finite_loss_fails_only_that_job(trainer: Trainer) -> None:
    """Finite inputs can still overflow (weights near float32 max): the job fails as a user error, no gradient is
    accumulated, and the same adapter and others go on training."""
    _ok(trainer, _job("x", 0, CreateModel(lora=LoraSpec(rank=2, seed=1))))
    bad = _fb("x", 1, [5, 6, 7, 8], weight=3e38)
    result = trainer.execute(bad)
    assert not result.ok and result.error is not None and result.error.category.value == "user"
    assert "not finite" in result.error.message
    assert all(g is None for g in trainer.pool.get("x").grads)
    _ok(trainer, _fb("x", 2, [5, 6, 7, 8]))
    assert all(g is not None and torch.isfinite(g).all() for g in trainer.pool.get("x").grads)


def test_failed_optim_step_drops_its_gradients(trainer: Trainer) -> None:
    _ok(trainer, _job("y", 0, CreateModel(lora=LoraSpec(rank=2, seed=1))))
    _ok(trainer, _fb("y", 1, [5, 6, 7, 8]))
    adapter = trainer.pool.get("y")
    adapter.grads = [torch.full_like(g, float("inf")) for g in adapter.grads]  # as if a norm overflowed
    before = [p.detach().clone() for p in adapter.params]
    adam = AdamW(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)
    result = trainer.execute(_job("y", 2, OptimStep(optimizer=adam)))
    assert not result.ok and result.error is not None and result.error.category.value == "user"
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.pool.get("y").params))
    _ok(trainer, _fb("y", 3, [5, 6, 7, 8]))
    _ok(trainer, _job("y", 4, OptimStep(optimizer=adam)))
    assert not all(torch.equal(b, p) for b, p in zip(before, trainer.pool.get("y").params))
