"""Adapter paging: under a memory budget idle adapters go to host memory and disk, come back on use, and train
exactly as if they had stayed; nothing is refused or deleted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.unit.engine_jobs import create, fb, optim, random_rows
from workers.checkpoints.store import CheckpointStore
from workers.engine.base_model import BaseModel
from workers.engine.paging import DEVICE, DISK, HOST, PagingConfig, state_bytes
from workers.engine.trainer import Trainer

MODELS = [f"m{i}" for i in range(5)]


def _run(trainer: Trainer, rounds: int, check=None) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    for i, m in enumerate(MODELS):
        assert trainer.execute(create(m, rank=2 + i % 3, seed=i, tenant="t" if i < 3 else "u")).ok
    seq = 1
    for _ in range(rounds):
        for m in MODELS:  # forward_backward for everybody first, so paged adapters carry gradients
            assert trainer.execute(fb(m, seq, random_rows(rng, 2, 3, 10))).ok
            if check:
                check(trainer)
        for m in MODELS:
            assert trainer.execute(optim(m, seq + 1)).ok
            if check:
                check(trainer)
        seq += 2


def _one_adapter_bytes(model_dir: Path, tmp: Path) -> int:
    t = Trainer(BaseModel("tiny", model_dir), CheckpointStore(tmp / "probe"))
    assert t.execute(create("p", rank=4)).ok
    assert t.execute(fb("p", 1, [[5, 6, 7, 8]])).ok
    assert t.execute(optim("p", 2)).ok
    assert t.execute(fb("p", 3, [[5, 6, 7, 8]])).ok
    return state_bytes(t.pool.get("p"))


def test_paged_training_equals_unpaged(tiny_model_dir: Path, tmp_path: Path) -> None:
    one = _one_adapter_bytes(tiny_model_dir, tmp_path)
    config = PagingConfig(device_budget_bytes=2 * one, host_budget_bytes=one, spill_dir=tmp_path / "spill")
    paged = Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path / "a"), paging=config)
    seen_tiers: set[str] = set()

    def check(t: Trainer) -> None:
        adapters = list(t.pool.adapters.values())
        assert len(adapters) == len(MODELS)  # never deleted
        seen_tiers.update(a.tier for a in adapters)
        on_device = [a for a in adapters if a.tier == DEVICE]
        assert sum(state_bytes(a) for a in on_device) <= config.device_budget_bytes or len(on_device) == 1
        for a in adapters:  # only device adapters are attached to the layers
            attached = any(a.model_id in layer.lora_A for layer in t.base.layers.values())
            assert attached == (a.tier == DEVICE), (a.model_id, a.tier)
        assert len(list(config.spill_dir.glob("*/*.safetensors"))) == sum(a.tier == DISK for a in adapters)

    _run(paged, rounds=3, check=check)
    assert seen_tiers == {DEVICE, HOST, DISK}
    plain = Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path / "b"))
    _run(plain, rounds=3)
    for m in MODELS:
        a, b = paged.pool.get(m), plain.pool.get(m)
        assert a.optim.step == b.optim.step == 3
        for x, y in zip(a.params, b.params):
            assert torch.equal(x, y), m  # paging copies bits: training is bit-for-bit unchanged
        for x, y in zip(a.optim.exp_avg_sq, b.optim.exp_avg_sq):
            assert torch.equal(x, y), m


def test_tenant_resident_limit_and_drop(tiny_model_dir: Path, tmp_path: Path) -> None:
    limits = {"t": 1}
    config = PagingConfig(host_budget_bytes=0, spill_dir=tmp_path / "spill", tenant_resident_limit=limits.get)
    trainer = Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path / "a"), paging=config)
    _run(trainer, rounds=1)
    tiers = {m: trainer.pool.adapters[m].tier for m in MODELS}
    assert sum(tiers[m] == DEVICE for m in MODELS[:3]) == 1  # tenant t: one adapter on the device
    assert all(tiers[m] == DEVICE for m in MODELS[3:])  # tenant u has no limit
    assert sum(tiers[m] == DISK for m in MODELS[:3]) == 2  # host budget 0: straight on to disk
    spilled = next(m for m in MODELS[:3] if tiers[m] == DISK)
    path = trainer.pool.adapters[spilled].spill_path
    assert path is not None and path.exists()
    trainer.pool.drop(spilled)
    assert not path.exists() and spilled not in trainer.pool.adapters
