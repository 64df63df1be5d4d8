"""The compute side's metrics (workers/metrics.py) against what the engine did: paging moves balance the adapters
found in each tier, the occupancy gauge is the pool's count, and a job's tokens reach the bounded tenant label."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY, generate_latest

from api_schemas.jobs import JobResult
from tests.support.prom import Samples, parse, value
from tests.unit.engine_jobs import fb
from tests.unit.test_paging import MODELS, _one_adapter_bytes, _run
from workers import metrics
from workers.checkpoints.store import CheckpointStore
from workers.engine.base_model import BaseModel
from workers.engine.paging import DEVICE, DISK, HOST, PagingConfig
from workers.engine.trainer import Trainer


def _scrape() -> Samples:
    return parse(generate_latest(REGISTRY).decode())


def test_paging_traffic_balances_the_tiers(tiny_model_dir: Path, tmp_path: Path) -> None:
    one = _one_adapter_bytes(tiny_model_dir, tmp_path)
    config = PagingConfig(device_budget_bytes=2 * one, host_budget_bytes=one, spill_dir=tmp_path / "spill")
    trainer = Trainer(BaseModel("paging-metrics", tiny_model_dir), CheckpointStore(tmp_path / "a"), paging=config)
    metrics.occupancy.watch(trainer)
    _run(trainer, rounds=2)
    s = _scrape()

    def moves(source: str, target: str) -> float:
        return value(s, "twinkle_adapter_pages_total", base_model="paging-metrics", source=source, target=target)

    tiers = trainer.pool.tiers()
    assert moves(DEVICE, HOST) > 0 and moves(HOST, DISK) > 0 and moves(DISK, HOST) > 0
    # every adapter was created on the device; the moves in and out of each tier leave what is there now
    assert len(MODELS) + moves(HOST, DEVICE) - moves(DEVICE, HOST) == tiers[DEVICE]
    assert moves(DEVICE, HOST) + moves(DISK, HOST) - moves(HOST, DEVICE) - moves(HOST, DISK) == tiers[HOST]
    assert moves(HOST, DISK) - moves(DISK, HOST) == tiers[DISK]
    assert value(s, "twinkle_adapter_paged_bytes_total", base_model="paging-metrics", source=DEVICE,
                 target=HOST) > 0
    for tier, n in tiers.items():
        assert value(s, "twinkle_adapters", base_model="paging-metrics", tier=tier) == n


def test_tenant_labels_are_bounded() -> None:
    labels = metrics.TenantLabels(limit=2)
    assert [labels(t) for t in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]


def test_a_failed_job_counts_no_tokens() -> None:
    job = fb("m-failed", 1, [[5, 6, 7]])
    job = job.model_copy(update={"base_model": "failed-metrics"})
    before = _scrape()
    metrics.job_finished(job, JobResult(job_id=job.job_id, error={"category": "user", "message": "bad"}), 0.01)
    metrics.job_finished(job, JobResult(job_id=job.job_id, output=None), 0.02)
    after = _scrape()
    assert value(after, "twinkle_jobs_total", base_model="failed-metrics", outcome="user_error") == 1
    assert value(after, "twinkle_jobs_total", base_model="failed-metrics", outcome="ok") == 1
    assert value(after, "twinkle_tokens_total", base_model="failed-metrics", kind="trained") == job.payload.tokens > 0  # the ok one only
    assert value(before, "twinkle_job_duration_seconds_count", base_model="failed-metrics") == 0
    assert value(after, "twinkle_job_duration_seconds_count", base_model="failed-metrics") == 2
