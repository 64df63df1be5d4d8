"""Pure ordering decisions: which queued jobs may run now. No I/O, no clock of its own (time is passed in).

Per model, operations run strictly in `seq_id` order: a model's line starts at seq 0 (create_model or a
create-via-load) and each executed job advances it by one. Early arrivals wait. A job whose predecessor never
arrives (a lost or rejected request) waits at most `gap_timeout` seconds; then the gap is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from api_schemas.jobs import Job


@dataclass
class _Line:
    next_seq: int
    pending: dict[int, tuple[Job, float]] = field(default_factory=dict)  # seq -> (job, arrival time)


@dataclass(frozen=True)
class Rejection:
    job: Job
    reason: str


class Scheduler:
    def __init__(self, gap_timeout: float) -> None:
        self.gap_timeout = gap_timeout
        self._lines: dict[str, _Line] = {}

    def add(self, job: Job, now: float) -> Rejection | None:
        line = self._lines.get(job.model_id)
        if line is None:
            line = self._lines[job.model_id] = _Line(next_seq=0)
        if job.seq_id < line.next_seq:
            return Rejection(job, f"seq_id {job.seq_id} of {job.model_id} was already executed")
        if job.seq_id in line.pending:
            return Rejection(job, f"seq_id {job.seq_id} of {job.model_id} is already queued")
        line.pending[job.seq_id] = (job, now)
        return None

    def pop_ready(self, now: float) -> list[Job]:
        """Every job that may run now, each model's in seq order; skips gaps older than gap_timeout."""
        ready: list[Job] = []
        for line in self._lines.values():
            if line.pending and line.next_seq not in line.pending:
                oldest = min(arrived for _, arrived in line.pending.values())
                if now - oldest >= self.gap_timeout:
                    line.next_seq = min(line.pending)
            while line.next_seq in line.pending:
                job, _ = line.pending.pop(line.next_seq)
                ready.append(job)
                line.next_seq += 1
        return ready

    def next_deadline(self) -> float | None:
        """When the oldest held-back job's gap will be skipped, if any job is held back."""
        times = [
            min(arrived for _, arrived in line.pending.values()) + self.gap_timeout
            for line in self._lines.values()
            if line.pending
        ]
        return min(times) if times else None

    def resume(self, model_id: str, next_seq: int) -> None:
        """Continue a model's line at `next_seq`: its earlier jobs ran on a worker that has since died."""
        line = self._lines.setdefault(model_id, _Line(next_seq=next_seq))
        line.next_seq = max(line.next_seq, next_seq)

    def forget(self, model_id: str) -> None:
        self._lines.pop(model_id, None)

    def waiting(self) -> int:
        return sum(len(line.pending) for line in self._lines.values())
