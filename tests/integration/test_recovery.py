"""Worker crash recovery, in one process against a real Redis: a worker hangs mid-run (its jobs stay pending, its
lease runs out), a fresh worker with a fresh base model takes over, rebuilds the adapter from the last snapshot
plus the replay of acknowledged jobs (including a load_weights), and finishes; the final adapter and optimizer
state equal an uninterrupted run's, and no acknowledged job ran twice."""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from api_schemas.jobs import (
    CreateModel,
    ForwardBackward,
    Job,
    JobResult,
    LoadWeights,
    OptimStep,
    SaveWeights,
    queue_name,
)
from api_schemas.training import AdamW, LoraSpec
from jobqueue.redis_queue import RedisQueue
from workers.checkpoints.store import CheckpointStore
from workers.dispatcher import Dispatcher
from workers.engine.base_model import BaseModel
from workers.engine.trainer import Trainer
from workers.recovery import Recovery

pytest.importorskip("redis")

BASE = "tiny"
MODEL = "sess:train:0"
ADAM = AdamW(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.01, grad_clip_norm=1.0)


def fb_payload(step: int) -> ForwardBackward:
    rng = np.random.default_rng(step)
    datums = []
    for _ in range(2):
        tokens = rng.integers(5, 200, size=9)
        n = len(tokens) - 1
        datums.append((tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(n, "<f4")}))
    return ForwardBackward.build(datums, forward_only=False, loss_fn="cross_entropy")


def script() -> list[Job]:
    """create, 3 steps, save_state, load it back, 4 more steps: seqs 0..16."""
    payloads: list = [CreateModel(lora=LoraSpec(rank=4, seed=11))]
    for step in range(3):
        payloads += [fb_payload(step), OptimStep(optimizer=ADAM)]
    payloads += [SaveWeights(storage_key="t/m/weights/ck", with_optimizer=True),
                 LoadWeights(storage_key="t/m/weights/ck", with_optimizer=True, create=False)]
    for step in range(3, 7):
        payloads += [fb_payload(step), OptimStep(optimizer=ADAM)]
    return [Job(job_id=str(uuid.uuid4()), tenant_id="t", base_model=BASE, model_id=MODEL, seq_id=i, payload=p)
            for i, p in enumerate(payloads)]


def state_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    adapter = trainer.pool.get(MODEL)
    out = {f"p{i}": p.detach().clone() for i, p in enumerate(adapter.params)}
    out.update({f"o/{k}": v.clone() for k, v in adapter.optim.state_dict().items()})
    return out


def test_successor_rebuilds_from_snapshot_and_replay(tiny_model_dir: Path, redis_url: str, prefix: str,
                                                       tmp_path: Path) -> None:
    jobs = script()
    ref_store = CheckpointStore(tmp_path / "ref")
    reference = Trainer(BaseModel(BASE, tiny_model_dir), ref_store)
    for j in jobs:
        assert reference.execute(j).ok
    expected = state_of(reference)
    store = CheckpointStore(tmp_path / "shared")  # the storage both workers share
    release = threading.Event()
    try:
        asyncio.run(_crash_and_recover(jobs, tiny_model_dir, redis_url, prefix, store, release, expected))
    finally:
        release.set()


async def _crash_and_recover(jobs: list[Job], model_dir: Path, redis_url: str, prefix: str, store: CheckpointStore,
                             release: threading.Event, expected: dict[str, torch.Tensor]) -> None:
    gateway = RedisQueue(redis_url, prefix=prefix)
    for j in jobs:
        await gateway.submit(j, dedup_key=f"{j.model_id}#{j.seq_id}")
    q = queue_name(BASE, "train")

    first = Trainer(BaseModel(BASE, model_dir), store)
    # seqs: 0 create, 1-6 three steps, 7 save_state, 8 load_weights, 9-16 four steps. Acknowledged: 0..13
    # (snapshots after the load at 8 and after every 2nd optim_step: 12); the optim_step at 14 hangs, so the
    # successor must replay the forward_backward at 13 (its gradients) on top of the snapshot.
    hang_at = 14

    def execute_then_hang(job: Job) -> JobResult:
        if job.seq_id == hang_at:
            release.wait()
        return first.execute(job)

    qa = RedisQueue(redis_url, prefix=prefix, lease_ttl=1.0)
    a = Dispatcher(qa, q, execute_then_hang, recovery=Recovery(first, store, snapshot_every=2))
    task_a = asyncio.create_task(a.run())
    assert (await gateway.wait_result(jobs[hang_at - 1].job_id, 60)) is not None
    await asyncio.sleep(0.3)
    task_a.cancel()  # the worker "dies": nothing more is acknowledged, its lease is no longer renewed
    qa.consumer(q)._renewer.cancel()  # type: ignore[union-attr]
    a.stop()

    durable = await gateway.recovery_state(MODEL)
    assert durable is not None and durable.last_seq == hang_at - 1
    assert durable.snapshot_seq == 12
    assert [j.seq_id for j in durable.ops] == list(range(durable.snapshot_seq + 1, hang_at))
    assert durable.ops and all(not isinstance(j.payload, LoadWeights) for j in durable.ops)

    second = Trainer(BaseModel(BASE, model_dir), store)  # a new process: nothing in memory
    calls: list[int] = []

    def counted(job: Job) -> JobResult:
        calls.append(job.seq_id)
        return second.execute(job)

    qb = RedisQueue(redis_url, prefix=prefix, lease_ttl=1.0)
    recovery = Recovery(second, store, snapshot_every=2)
    b = Dispatcher(qb, q, counted, recovery=recovery)
    task_b = asyncio.create_task(b.run())
    try:
        for j in jobs[hang_at:]:
            res = await gateway.wait_result(j.job_id, 60)
            assert res is not None and res.ok, res
    finally:
        b.stop()
        task_b.cancel()
        await asyncio.gather(task_b, return_exceptions=True)
    assert calls == list(range(hang_at, len(jobs)))  # only unacknowledged jobs were executed as jobs
    got = state_of(second)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst < 1e-6, worst
    for queue in (gateway, qa, qb):
        await queue.close()
