"""Executes training jobs on the base model + adapter pool and turns each into a JobResult.

`execute_step` runs one scheduler step: a barrier job alone, or the forward/forward_backward jobs of several
models in one merged pass (workers/engine/merged.py). `execute` runs one job (the same code: a step of one).
A job that fails for a user reason (bad shapes, non-finite loss, missing checkpoint) yields a failed result with
category `user`; anything else is `server`. Either way the worker goes on with the next job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from api_schemas.jobs import (
    CreateModel,
    ForwardBackward,
    Gradients,
    GradientsResult,
    Job,
    JobResult,
    LoadWeights,
    ModelReady,
    OptimStep,
    OptimStepResult,
    Output,
    Released,
    ReleaseModel,
    SaveResult,
    SaveWeights,
    Skip,
    Skipped,
)
from workers.checkpoints.store import CheckpointStore
from workers.engine.adapter_pool import AdapterPool
from workers.engine.base_model import BaseModel
from workers.engine.errors import UserJobError, failure
from workers.engine.full_param import FullParamError, FullRuns, is_full_checkpoint
from workers.engine.merged import MergedPass, job_size
from workers.engine.optim import gradient_norm, optimizer_step
from workers.engine.paging import PagingConfig
from workers.engine.threads import ThreadChooser
from workers.memory import MemoryLedger, MemoryRefused
from workers.scheduler import JobSize

__all__ = ["Trainer", "UserJobError"]

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, base: BaseModel, store: CheckpointStore, paging: PagingConfig | None = None,
                 ledger: MemoryLedger | None = None, threads: ThreadChooser | None = None) -> None:
        self.base = base
        self.threads = threads or ThreadChooser()  # intra-op threads per pass, by its size (workers/engine/threads.py)
        self.pool = AdapterPool(base, paging)
        self.full = FullRuns(base, ledger)  # full-parameter runs: private copies (workers/engine/full_param.py)
        self.store = store
        self._merged = MergedPass(base, self.pool)

    def occupancy(self) -> tuple[str, dict[str, int]]:
        """(base model, its adapters per tier): the `twinkle_adapters` metric (workers/metrics.py)."""
        return self.base.name, self.pool.tiers()

    def _pool_of(self, model_id: str) -> AdapterPool | FullRuns:
        return self.full if model_id in self.full else self.pool

    @property
    def token_budget(self) -> int:
        """Padded tokens one merged pass should carry by default: on a CPU, passes beyond a few thousand tokens
        lose cache locality and run slower than their parts (benchmarks/merged_step.py); an accelerator wants
        large passes."""
        return 4096 if self.base.device.type == "cpu" else 32768

    @staticmethod
    def measure(job: Job) -> JobSize:
        """The scheduler's view of a job's size (rows, longest row, tokens)."""
        return job_size(job)

    def execute(self, job: Job) -> JobResult:
        results: list[JobResult] = []
        self.execute_step([job], results.append)
        return results[0]

    def execute_step(self, jobs: list[Job], on_result: Callable[[JobResult], None]) -> None:
        """Run one step; every job's result goes to `on_result` (once) as soon as it is known."""
        batch: list[Job] = []
        for job in jobs:  # in order: a barrier job never passes a pass of its own model's earlier jobs
            if isinstance(job.payload, ForwardBackward):
                batch.append(job)
                continue
            self._run_batch(batch, on_result)
            batch = []
            on_result(self._run_one(job))
        self._run_batch(batch, on_result)

    def _run_batch(self, jobs: list[Job], on_result: Callable[[JobResult], None]) -> None:
        # One job per model per pass: a model met twice waits for the next pass (its grads accumulate in order).
        rounds: dict[int, list[Job]] = {}
        seen: dict[str, int] = {}
        for job in jobs:
            n = seen[job.model_id] = seen.get(job.model_id, -1) + 1
            rounds.setdefault(n, []).append(job)
        for n in sorted(rounds):
            self._run_merged(rounds[n], on_result)

    def _run_merged(self, jobs: list[Job], on_result: Callable[[JobResult], None]) -> None:
        done: set[str] = set()

        def report(result: JobResult) -> None:
            done.add(result.job_id)
            on_result(result)

        try:
            full = [j for j in jobs if j.model_id in self.full]
            lora = [j for j in jobs if j.model_id not in self.full]
            if lora:
                with self.threads.pass_of(_padded_tokens(lora)):
                    self._merged.run(lora, report)
            for job in full:  # a run's own copy of the weights: a pass of its rows only
                with self.threads.pass_of(_padded_tokens([job])):
                    MergedPass(self.full.get(job.model_id).base, self.full).run([job], report)
        except Exception as e:  # noqa: BLE001 - a fault of the pass: its open jobs run again alone
            left = [j for j in jobs if j.job_id not in done]
            if len(jobs) == 1 or not left:
                for job in left:
                    on_result(failure(job, e))
                return
            # A fault of the merged pass itself (e.g. out of memory): nothing was accumulated for the jobs
            # still open, so each runs again on its own and fails (or succeeds) alone.
            log.warning("merged pass of %d jobs failed (%s); running its jobs one by one", len(jobs), e)
            for job in left:
                self._run_merged([job], on_result)

    def _run_one(self, job: Job) -> JobResult:
        try:
            return JobResult(job_id=job.job_id, output=self._run(job))
        except Exception as e:  # noqa: BLE001 - a fault must fail only this job, never the worker
            return failure(job, e)

    def _run(self, job: Job) -> Output:
        p = job.payload
        if isinstance(p, CreateModel):
            if p.lora is None:
                try:
                    run = self.full.create(job.model_id, job.tenant_id)
                except MemoryRefused as e:
                    raise UserJobError(str(e)) from e
                return ModelReady(model_id=job.model_id,
                                  parameters={n: tuple(t.shape) for n, t in zip(run.names, run.params)})
            adapter = self.pool.create(job.model_id, p.lora, tenant_id=job.tenant_id)
            shapes = {k: tuple(v.shape) for k, v in adapter.peft_state_dict().items()}
            return ModelReady(model_id=job.model_id, parameters=shapes)
        if isinstance(p, OptimStep):
            metrics, lr, step = self.optim_step(job.model_id, p)
            return OptimStepResult(metrics=metrics, learning_rate=lr, step=step)
        if isinstance(p, Gradients):
            return GradientsResult(grad_norm=self.gradients(job.model_id, p))
        if isinstance(p, SaveWeights):
            return self._save(job.model_id, p)
        if isinstance(p, LoadWeights):
            folder = self.store.existing(p.storage_key)
            if folder is None:
                raise UserJobError("checkpoint files not found (deleted or expired)")
            if is_full_checkpoint(folder):
                try:
                    self.full.load(job.model_id, folder, p.with_optimizer, job.tenant_id)
                except (FullParamError, MemoryRefused) as e:
                    raise UserJobError(str(e)) from e
            elif job.model_id in self.full:
                raise UserJobError("a LoRA checkpoint cannot be loaded into a full-parameter run")
            else:
                self.pool.load(job.model_id, folder, p.with_optimizer, p.create, tenant_id=job.tenant_id)
            return ModelReady(model_id=job.model_id)
        if isinstance(p, Skip):
            return Skipped(reason=p.reason)
        if isinstance(p, ReleaseModel):
            self.pool.drop(job.model_id)  # weights, optimizer state, gradients and any paged-out copy
            self.full.drop(job.model_id)  # a full-parameter copy and its memory reservation
            return Released(model_id=job.model_id)
        raise UserJobError(f"unsupported job kind {p.kind}")

    def _save(self, model_id: str, p: SaveWeights) -> SaveResult:
        with self.store.writing(p.storage_key) as folder:
            if model_id in self.full:
                self.full.save(self.full.get(model_id), folder, p.with_optimizer)
            else:
                self.pool.save(self.pool.get(model_id), folder, p.with_optimizer)
            written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            if p.max_bytes is not None and written > p.max_bytes:  # raising here discards the folder
                raise UserJobError(f"storage quota exceeded: the checkpoint needs {written} bytes, "
                                   f"{max(p.max_bytes, 0)} are left; delete checkpoints to free space")
        return SaveResult(storage_key=p.storage_key, size_bytes=self.store.size_bytes(p.storage_key))

    def gradients(self, model_id: str, p: Gradients) -> float:
        """The accumulated gradients' global norm (times p.grad_scale); `clear` then drops them."""
        with self._pool_of(model_id).pinned([model_id]) as (adapter,):
            norm = gradient_norm(adapter.params, list(adapter.grads), p.grad_scale)
            if p.action == "clear":
                adapter.grads = [None] * len(adapter.params)
            return norm

    def optim_step(self, model_id: str, p: OptimStep) -> tuple[dict[str, float], float, int]:
        """(metrics, learning rate used, the model's optimizer steps so far) of one step of the job's optimizer."""
        with self._pool_of(model_id).pinned([model_id]) as (adapter,):  # the first step creates the moments
            elements = sum(t.numel() for t in adapter.params)  # the step's thread count goes by its size
            try:  # the adapter's gradient buffers go in as they are (None: no loss reached that param, zero)
                with self.threads.pass_of(elements, work="optim"):
                    return optimizer_step(adapter.params, adapter.optim, p.optimizer, p.schedule,
                                          grads=list(adapter.grads), grad_scale=p.grad_scale)
            finally:
                # a failed step (non-finite norm) drops its gradients too: the tenant can go on training
                adapter.grads = [None] * len(adapter.params)


def _padded_tokens(jobs: list[Job]) -> int:
    """The tokens of the jobs' merged pass, padding included (rows x the longest row)."""
    sizes = [job_size(job) for job in jobs]
    return sum(s.rows for s in sizes) * max(s.max_len for s in sizes)
