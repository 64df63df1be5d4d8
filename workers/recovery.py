"""Durable adapter state for crash recovery: snapshots, and rebuilding a model a dead worker held.

A model's adapter lives in one worker's memory. Every acknowledged job that changed it is kept in the queue's
replay log (ordered by seq_id) until a snapshot covers it. Snapshots (weights + optimizer state) are taken after
every `snapshot_every`-th optim_step and after every load_weights (so a replay never re-reads a checkpoint that
may since have been overwritten). A worker that meets a model it does not hold, but which the queue says has run
before, loads the last snapshot and re-executes the logged jobs after it: the effects of acknowledged jobs are
restored exactly once, and jobs the dead worker ran but never acknowledged are simply run again.
"""

from __future__ import annotations

import logging
import re
import uuid

from api_schemas.jobs import (
    CreateModel,
    ForwardBackward,
    Gradients,
    Job,
    JobResult,
    LoadWeights,
    OptimStep,
)
from jobqueue.base import RecoveryState
from workers.checkpoints.store import CheckpointStore
from workers.engine.trainer import Trainer

log = logging.getLogger(__name__)

SNAPSHOT_ROOT = "_recovery"
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")


class RecoveryError(RuntimeError):
    """The durable state of a model cannot be turned back into an adapter (e.g. its snapshot files are gone)."""


class Recovery:
    def __init__(self, trainer: Trainer, store: CheckpointStore, snapshot_every: int = 10) -> None:
        self.trainer = trainer
        self.store = store
        self.snapshot_every = max(1, snapshot_every)
        self._steps: dict[str, int] = {}  # optim_steps since the model's last snapshot

    @staticmethod
    def mutates(job: Job, result: JobResult) -> bool:
        """Did this job change the adapter (so it must be replayed on a rebuild)?"""
        p = job.payload
        if not result.ok:
            return False
        return isinstance(p, (CreateModel, OptimStep, LoadWeights)) or (
            isinstance(p, ForwardBackward) and not p.forward_only
        ) or (isinstance(p, Gradients) and p.action == "clear")

    def wants_snapshot(self, job: Job, result: JobResult) -> bool:
        if not result.ok or job.model_id in self.trainer.full:  # a full copy: rebuilt by replay, never snapshot
            return False
        if isinstance(job.payload, LoadWeights):
            self._steps[job.model_id] = 0
            return True
        if isinstance(job.payload, OptimStep):
            n = self._steps.get(job.model_id, 0) + 1
            self._steps[job.model_id] = n % self.snapshot_every
            return n >= self.snapshot_every
        return False

    def snapshot(self, model_id: str, seq_id: int) -> str:
        """Write the model's adapter (weights + optimizer; gradients are empty after an optim_step or a load)."""
        adapter = self.trainer.pool.get(model_id)
        key = f"{SNAPSHOT_ROOT}/{_UNSAFE.sub('_', model_id)}/{seq_id:012d}-{uuid.uuid4().hex[:8]}"
        with self.store.writing(key) as folder:
            self.trainer.pool.save(adapter, folder, with_optimizer=True)
        return key

    def discard(self, storage_key: str) -> None:
        self.store.delete(storage_key)

    def forget(self, model_id: str, snapshot_keys: list[str]) -> None:
        """The model was released: delete its snapshots and its step count."""
        self._steps.pop(model_id, None)
        for key in snapshot_keys:
            self.discard(key)

    def rebuild(self, state: RecoveryState) -> int:
        """Restore the model from its snapshot plus the replay of the logged jobs; returns how many were replayed."""
        pool = self.trainer.pool
        pool.drop(state.model_id)
        if state.snapshot_key is not None:
            folder = self.store.existing(state.snapshot_key)
            if folder is None:
                raise RecoveryError(f"snapshot {state.snapshot_key} of {state.model_id} is missing")
            pool.load(state.model_id, folder, with_optimizer=True, create=True)
        for job in state.ops:
            result = self.trainer.execute(job)
            if not result.ok:  # it succeeded the first time: the replay must too
                raise RecoveryError(f"replay of {job.payload.kind} seq {job.seq_id} failed: {result.error}")
        self._steps[state.model_id] = sum(isinstance(j.payload, OptimStep) for j in state.ops)
        log.warning(
            "rebuilt %s from %s + %d replayed jobs (up to seq %d)",
            state.model_id, state.snapshot_key or "scratch", len(state.ops), state.last_seq,
        )
        return len(state.ops)
