"""A thousand live adapters on one base model (issue: adapter scale): idle ones page to host memory and disk under
small budgets, none is refused, and the few that train give the same weights as when trained with no idle
neighbours at all (fp32, 1e-6)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.unit.engine_jobs import create, fb, optim, random_rows
from workers.checkpoints.store import CheckpointStore
from workers.engine.base_model import BaseModel
from workers.engine.threads import ThreadChooser
from workers.engine.paging import DEVICE, DISK, HOST, PagingConfig, state_bytes
from workers.engine.trainer import Trainer

LIVE = 1000
ACTIVE = ["m3", "m500", "m999"]


def _first_step(trainer: Trainer, model: str, i: int) -> None:
    """Create `model` (rank 8, every linear layer) and take one step, so it holds Adam state."""
    assert trainer.execute(create(model, rank=8, seed=i, tenant=f"t{i % 10}")).ok
    rows = random_rows(np.random.default_rng(i), 1, 4, 8)
    assert trainer.execute(fb(model, 1, rows)).ok
    assert trainer.execute(optim(model, 2)).ok


def _train_active(trainer: Trainer) -> None:
    rng = np.random.default_rng(7)
    for step in range(3):
        seq = 3 + 2 * step
        results: list = []
        trainer.execute_step([fb(m, seq, random_rows(rng, 2, 3, 12)) for m in ACTIVE], results.append)
        assert [r.ok for r in results] == [True] * len(ACTIVE)
        for m in ACTIVE:
            assert trainer.execute(optim(m, seq + 1)).ok


def test_a_thousand_live_adapters_train_like_three_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    probe = Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path / "probe"))
    _first_step(probe, "p", 0)
    one = state_bytes(probe.pool.get("p"))
    config = PagingConfig(device_budget_bytes=20 * one, host_budget_bytes=50 * one, spill_dir=tmp_path / "spill")
    # one intra-op thread for both trainers: the measured thread choice (workers/engine/threads.py) may differ between
    # them, and another count sums a matmul in another order (~1e-6 apart in fp32), which is not what this checks
    crowded = Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path / "a"), paging=config,
                      threads=ThreadChooser(fixed=1))
    for i in range(LIVE):
        _first_step(crowded, f"m{i}", i)
    tiers = [a.tier for a in crowded.pool.adapters.values()]
    assert len(tiers) == LIVE  # every one accepted and kept
    assert tiers.count(DEVICE) <= 20 and tiers.count(HOST) <= 50 and tiers.count(DISK) >= LIVE - 70
    _train_active(crowded)

    alone = Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path / "b"), threads=ThreadChooser(fixed=1))
    for m in ACTIVE:
        _first_step(alone, m, int(m[1:]))
    _train_active(alone)
    for m in ACTIVE:
        a, b = crowded.pool.get(m), alone.pool.get(m)
        assert a.optim.step == b.optim.step == 4
        for x, y in zip(a.params, b.params):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
