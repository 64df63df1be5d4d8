"""Per-run loss history for the dashboard's curves: the `loss:sum` of each training forward_backward, in memory.

Recorded where the gateway already sees both ends of a job (server/services/jobs.py): `queued` remembers a
training `ForwardBackward` job (not forward-only ones) with its run and seq_id, `delivered` takes its loss from the
result the first time this gateway hands it to a client. Bounded twice: the last `POINTS` points per run (a ring)
and the `RUNS` runs most recently trained (the least recently trained run is forgotten first), and the pending
jobs likewise. Not in SQL on purpose: a curve is a live view, lost with the gateway process; behind several
gateways each one draws the steps it delivered itself (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from api_schemas.jobs import ForwardBackward, ForwardBackwardResult, Job, JobResult

POINTS = 500  # per run
RUNS = 1_000  # runs with a history
_PENDING = 10_000  # forward_backward jobs awaiting their first delivery


@dataclass(frozen=True)
class LossPoint:
    seq_id: int  # the run's operation number (its x axis: forward_backward order)
    loss: float  # `loss:sum` of the job (every loss reports it)
    tokens: int  # the job's tokens (loss per token = loss / tokens for an unweighted cross-entropy)
    at: float  # unix time the result was delivered


class LossHistory:
    def __init__(self, points: int = POINTS, runs: int = RUNS, pending: int = _PENDING) -> None:
        self._points, self._runs, self._max_pending = points, runs, pending
        self._history: OrderedDict[str, deque[LossPoint]] = OrderedDict()  # model id -> its last points
        self._pending: OrderedDict[str, tuple[str, int, int]] = OrderedDict()  # job id -> (model id, seq_id, tokens)

    def queued(self, job: Job) -> None:
        p = job.payload
        if isinstance(p, ForwardBackward) and not p.forward_only and not p.base_only:
            self._pending[job.job_id] = (job.model_id, job.seq_id, p.tokens)
            while len(self._pending) > self._max_pending:
                self._pending.popitem(last=False)

    def delivered(self, job_id: str, result: JobResult) -> None:
        pending = self._pending.pop(job_id, None)
        if pending is None or not isinstance(result.output, ForwardBackwardResult):
            return
        loss = result.output.metrics.get("loss:sum")
        if loss is None or not math.isfinite(loss):  # a failed step's loss is no point of a curve
            return
        model_id, seq_id, tokens = pending
        ring = self._history.pop(model_id, None)
        if ring is None:
            ring = deque(maxlen=self._points)
        ring.append(LossPoint(seq_id, float(loss), tokens, time.time()))
        self._history[model_id] = ring  # most recently trained last
        while len(self._history) > self._runs:
            self._history.popitem(last=False)

    def of(self, model_id: str) -> list[LossPoint]:
        """The run's points, oldest first (empty when this gateway delivered none, or forgot them)."""
        return list(self._history.get(model_id, ()))
