"""The dispatcher on the in-process queue: jobs of many models that are waiting together run as merged steps,
each result is acknowledged on its own, and a failing tenant's job fails alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np

from api_schemas.jobs import RELEASE_SEQ, Job, JobResult, ReleaseModel, queue_name
from jobqueue.local_queue import LocalQueue
from tests.unit.engine_jobs import create, fb, job, loss_of, optim, random_rows
from workers.checkpoints.store import CheckpointStore
from workers.dispatcher import Dispatcher
from workers.engine.base_model import BaseModel
from workers.engine.trainer import Trainer


class RecordingTrainer(Trainer):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.steps: list[list[str]] = []

    def execute_step(self, jobs: list[Job], on_result: Callable[[JobResult], None]) -> None:
        self.steps.append([j.model_id for j in jobs])
        super().execute_step(jobs, on_result)


async def _drive(trainer: Trainer, batches: list[list[Job]]) -> dict[str, JobResult]:
    queue = LocalQueue()
    name = queue_name("tiny", "train")
    dispatcher = Dispatcher(queue, name, trainer.execute, gap_timeout=5, fetch_timeout=0.05)
    results: dict[str, JobResult] = {}
    runner = asyncio.create_task(dispatcher.run())
    try:
        for batch in batches:  # each batch is queued at once, then waited for
            for j in batch:
                await queue.submit(j)
            for j in batch:
                r = await queue.wait_result(j.job_id, 60)
                assert r is not None
                results[j.job_id] = r
    finally:
        dispatcher.stop()
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    return results


def test_waiting_jobs_of_many_models_run_merged(tiny_model_dir: Path, tmp_path: Path) -> None:
    models = [f"m{i}" for i in range(5)]
    rng = np.random.default_rng(0)
    rows = {m: random_rows(rng, 2, 4, 16) for m in models}
    creates = [create(m, rank=2 + i, seed=i) for i, m in enumerate(models)]
    fbs = [fb(m, 1, rows[m]) for m in models]
    fbs[2] = fb("m2", 1, rows["m2"], weights=float("inf"))  # m2's loss is not finite: it fails, alone
    steps = [optim(m, 2) for m in models]

    merged = RecordingTrainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path / "a"))
    got = asyncio.run(_drive(merged, [creates, fbs, steps]))
    # each batch, queued together, ran in one or two steps: the forward_backwards as merged passes, the creates and
    # the optim_steps one after the other in one hand-over to the compute thread (not one step per job)
    assert sum(map(len, merged.steps)) == 3 * len(models) and len(merged.steps) <= 6, merged.steps
    assert all(len(set(s)) == len(s) for s in merged.steps), merged.steps  # a model at most once per step

    solo = Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path / "b"))
    for j in creates:
        assert solo.execute(j).ok
    for j in fbs:
        want, have = solo.execute(j), got[j.job_id]
        assert want.ok == have.ok, (j.model_id, have.error)
        if want.ok:
            assert abs(loss_of(have.body) - loss_of(want.body)) <= 1e-5 * abs(loss_of(want.body))
        else:
            assert have.error is not None and "finite" in have.error.message
    for j in steps:
        assert got[j.job_id].ok == solo.execute(j).ok
    for m in models:
        for x, y in zip(merged.pool.get(m).params, solo.pool.get(m).params):
            assert (x - y).abs().max().item() < 1e-5, m


def test_release_frees_the_model_after_its_queued_jobs_and_rejects_later_ones(tiny_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    trainer = Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path))
    rows = random_rows(np.random.default_rng(1), 2, 4, 8)
    gone = job("m1", RELEASE_SEQ, ReleaseModel(reason="its client session ended"))
    late = optim("m1", 3)
    got = asyncio.run(_drive(trainer, [
        [create("m1"), create("m2")],
        [fb("m1", 1, rows), optim("m1", 2), gone, fb("m2", 1, rows)],  # the release comes after m1's jobs
        [late, optim("m2", 2)],
    ]))
    assert all(r.ok for r in got.values() if r.job_id != late.job_id)
    assert got[late.job_id].error is not None and "released" in got[late.job_id].error.message
    assert "m1" not in trainer.pool.adapters and "m2" in trainer.pool.adapters
    assert all("m1" not in layer.lora_A for layer in trainer.base.layers.values())
