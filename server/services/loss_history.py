"""Per-run loss history for the dashboard's curves: the `loss:sum` of each training forward_backward, kept in SQL.

Recorded where the gateway already sees both ends of a job (server/services/jobs.py): `queued` remembers a
training `ForwardBackward` job (not forward-only ones) with its tenant, run and seq_id, `delivered` takes its loss
from the result the first time this gateway hands it to a client. The per-step path touches memory only: the point
joins the run's ring and a buffer of points to write; the maintenance loop (and the app's shutdown) writes the
buffer to SQL in one batch (`flush`, as the usage meter's counts: server/services/usage.py) and then keeps each
written run's newest `POINTS` seq_ids (server/db/loss_repo.py). A crash loses at most one round's points.

The dashboard reads `curves`: a run's stored points are read from SQL once (one query for all the runs of a view
that need it) and merged by seq_id with the points this gateway delivered since; behind several gateways (cluster
mode) a live run's stored points are read again once `refresh` seconds old, so the steps other gateways delivered
appear within about two maintenance rounds. A restarted gateway draws every run's curve from SQL.

Bounded in memory too: the last `POINTS` points per run (a ring), the `RUNS` runs most recently trained or viewed
(the least recently used one is forgotten first; SQL still has it), the pending jobs and the points not written yet.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from api_schemas.jobs import ForwardBackward, ForwardBackwardResult, Job, JobResult
from server.db import loss_repo
from server.db.database import Database

log = logging.getLogger(__name__)

POINTS = 500  # per run, in memory and in SQL
RUNS = 1_000  # runs with a history in memory
_PENDING = 10_000  # forward_backward jobs awaiting their first delivery
_UNWRITTEN = 100_000  # points delivered but not written yet (the oldest go first when SQL is away that long)


@dataclass(frozen=True)
class LossPoint:
    seq_id: int  # the run's operation number (its x axis: forward_backward order)
    loss: float  # `loss:sum` of the job (every loss reports it)
    tokens: int  # the job's tokens (loss per token = loss / tokens for an unweighted cross-entropy)
    at: float  # unix time the result was delivered


@dataclass
class _Run:
    tenant_id: str
    local: deque[LossPoint]  # what this gateway delivered (since it started, or since the run was forgotten)
    stored: list[LossPoint] | None = None  # what SQL held when last read; None: not read yet
    read_at: float = 0.0  # time.monotonic() of that read
    merged: list[LossPoint] | None = field(default=None, repr=False)  # stored + local, by seq_id (cached)


class LossHistory:
    def __init__(self, points: int = POINTS, runs: int = RUNS, pending: int = _PENDING,
                 unwritten: int = _UNWRITTEN) -> None:
        self._points, self._runs, self._max_pending = points, runs, pending
        self._history: OrderedDict[str, _Run] = OrderedDict()  # model id -> its points
        self._pending: OrderedDict[str, tuple[str, str, int, int]] = OrderedDict()  # job id -> tenant, run, seq, tokens
        self._unwritten: deque[tuple[str, str, LossPoint]] = deque(maxlen=unwritten)  # (tenant, run, point)

    def queued(self, job: Job) -> None:
        p = job.payload
        if isinstance(p, ForwardBackward) and not p.forward_only and not p.base_only:
            self._pending[job.job_id] = (job.tenant_id, job.model_id, job.seq_id, p.tokens)
            while len(self._pending) > self._max_pending:
                self._pending.popitem(last=False)

    def delivered(self, job_id: str, result: JobResult) -> None:
        pending = self._pending.pop(job_id, None)
        if pending is None or not isinstance(result.output, ForwardBackwardResult):
            return
        loss = result.output.metrics.get("loss:sum")
        if loss is None or not math.isfinite(loss):  # a failed step's loss is no point of a curve
            return
        tenant_id, model_id, seq_id, tokens = pending
        point = LossPoint(seq_id, float(loss), tokens, time.time())
        run = self._run(tenant_id, model_id)
        run.local.append(point)
        run.merged = None
        self._unwritten.append((tenant_id, model_id, point))

    def _run(self, tenant_id: str, model_id: str) -> _Run:
        """The run's entry, made the most recently used one (the least recently used run is forgotten first)."""
        run = self._history.pop(model_id, None)
        if run is None or run.tenant_id != tenant_id:
            run = _Run(tenant_id, deque(maxlen=self._points))
        self._history[model_id] = run
        while len(self._history) > self._runs:
            self._history.popitem(last=False)
        return run

    def of(self, model_id: str) -> list[LossPoint]:
        """The run's points in memory, oldest first (empty when this gateway has none, or forgot them)."""
        run = self._history.get(model_id)
        return self._merged(run) if run is not None else []

    def _merged(self, run: _Run) -> list[LossPoint]:
        if run.merged is None:
            by_seq = {p.seq_id: p for p in run.stored or ()}
            by_seq.update((p.seq_id, p) for p in run.local)
            run.merged = [by_seq[s] for s in sorted(by_seq)[-self._points:]]
        return run.merged

    async def curves(self, db: Database, tenant_id: str, model_ids: Sequence[tuple[str, bool]],
                     refresh: float | None = None) -> dict[str, list[LossPoint]]:
        """The curve of each of the tenant's runs `(model id, live)`: SQL's points (read in one query for the runs
        not read yet, or, with `refresh`, live ones read longer ago than that) merged with this gateway's newer
        ones. A run of another tenant gets nothing."""
        now = time.monotonic()
        runs: dict[str, _Run] = {}
        stale: list[str] = []
        for model_id, live in model_ids:
            known = self._history.get(model_id)
            if known is not None and known.tenant_id != tenant_id and known.local:
                continue  # another tenant's run (its points came from that tenant's jobs)
            run = self._run(tenant_id, model_id)  # an entry made by another tenant's view only is replaced
            runs[model_id] = run
            if run.stored is None or (live and refresh is not None and now - run.read_at >= refresh):
                stale.append(model_id)
        if stale:
            async with db.connection() as conn:
                stored = await loss_repo.points(conn, tenant_id, stale)
            for model_id in stale:
                run = runs[model_id]
                run.stored = [LossPoint(*p) for p in stored.get(model_id, ())][-self._points:]
                run.read_at, run.merged = now, None
        return {model_id: self._merged(run) for model_id, run in runs.items()}

    async def flush(self, db: Database) -> None:
        """Write the points delivered since the last flush in one batch, then bound each written run to its newest
        `POINTS` seq_ids. A failed write keeps them for the next round."""
        if not self._unwritten:
            return
        batch = list(self._unwritten)
        self._unwritten.clear()
        rows = [{"tenant_id": t, "model_id": m, "seq_id": p.seq_id, "loss": p.loss, "tokens": p.tokens,
                 "at": loss_repo.when(p.at)} for t, m, p in batch]
        try:
            async with db.connection() as conn:
                await loss_repo.add(conn, rows)
                await loss_repo.keep_newest(conn, sorted({m for _, m, _ in batch}), self._points)
        except Exception:  # put back before what arrived meanwhile; over the bound, the oldest go
            self._unwritten = deque([*batch, *self._unwritten], maxlen=self._unwritten.maxlen)
            raise

    @property
    def unwritten(self) -> int:
        return len(self._unwritten)
