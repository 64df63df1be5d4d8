"""Pure ordering and batching decisions: which queued jobs run now, and which run together in one step.

No I/O, no clock of its own (time is passed in), no torch.

Per model, operations run strictly in `seq_id` order: a model's line starts at seq 0 (create_model or a
create-via-load) and each executed job advances it by one. Early arrivals wait. A job whose predecessor never
arrives (a lost or rejected request) waits at most `gap_timeout` seconds; then the gap is skipped.

`next_step` turns the heads of the lines into steps:
- a *barrier* head (create, optim_step, save, load, skip) holds back only its own model; the barrier heads of
  several models run one after the other in one step (at most `max_barriers_in_a_row`);
- the *mergeable* heads (forward / forward_backward) of different models run together in one merged step,
  at most one job per model, up to `token_budget` padded tokens (rows x longest row). The first job picked
  always runs, even when it alone exceeds the budget, so a huge batch is delayed at most by fairness.
Fairness between tenants is start-time fair queueing on tokens: every tenant has a finish tag F (tokens it was
served, in virtual time); a job of tenant t starts at S = max(F_t, V), where V is the start tag of the job most
recently picked, and the candidate with the smallest S is picked next. A tenant that sends a huge batch advances
its own tag by that many tokens, so a small tenant's next job is picked before the huge tenant's next one; a
tenant returning from idle starts at V, never with banked credit.

A ReleaseModel job (the model's session ended) stands outside the seq order: it runs once nothing of its model is
queued any more, and the model's line goes with it. Later jobs of a released model are rejected at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from api_schemas.jobs import ForwardBackward, Job, ReleaseModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobSize:
    """The work of one job: its rows (datums), its longest row and its total tokens."""

    rows: int = 1
    max_len: int = 1
    tokens: int = 1


@dataclass(frozen=True)
class Rejection:
    job: Job
    reason: str


@dataclass(frozen=True)
class Step:
    """Jobs to run together, each of a distinct model: barrier jobs (one after the other, merged=False), or
    forward/forward_backward jobs (one merged pass)."""

    jobs: tuple[Job, ...]
    merged: bool


@dataclass
class _Entry:
    job: Job
    arrived: float
    size: JobSize


@dataclass
class _Line:
    next_seq: int
    pending: dict[int, _Entry] = field(default_factory=dict)
    release: Job | None = None  # a ReleaseModel waiting for the line to empty

    def head(self) -> _Entry | None:
        return self.pending.get(self.next_seq)

    def pop_head(self) -> Job:
        entry = self.pending.pop(self.next_seq)
        self.next_seq += 1
        return entry.job


def mergeable(job: Job) -> bool:
    return isinstance(job.payload, ForwardBackward)


def _unit_size(job: Job) -> JobSize:
    return JobSize()


class Scheduler:
    max_barriers_in_a_row = 8
    max_remembered_releases = 100_000  # released model ids kept to reject their late jobs (oldest forgotten first)

    def __init__(
        self, gap_timeout: float, token_budget: int = 16384, measure: Callable[[Job], JobSize] | None = None
    ) -> None:
        self.gap_timeout = gap_timeout
        self.token_budget = token_budget
        self.measure = measure or _unit_size
        self._lines: dict[str, _Line] = {}
        self._finish: dict[str, float] = {}  # tenant -> finish tag (virtual tokens served)
        self._vtime = 0.0
        self._barriers_in_a_row = 0
        self._released: dict[str, None] = {}  # insertion-ordered set
        self._releasing: dict[str, None] = {}  # models whose line holds a release (looked at without a full scan)

    def add(self, job: Job, now: float) -> Rejection | None:
        if job.model_id in self._released:
            return Rejection(job, f"model {job.model_id} was released when its session ended")
        line = self._lines.get(job.model_id)
        if isinstance(job.payload, ReleaseModel):
            line = self._lines.setdefault(job.model_id, _Line(next_seq=0))
            if line.release is not None:
                return Rejection(job, f"model {job.model_id} is already being released")
            line.release = job
            self._releasing[job.model_id] = None
            return None
        if line is None:
            line = self._lines[job.model_id] = _Line(next_seq=0)
        if job.seq_id < line.next_seq:
            return Rejection(job, f"seq_id {job.seq_id} of {job.model_id} was already executed")
        if job.seq_id in line.pending:
            return Rejection(job, f"seq_id {job.seq_id} of {job.model_id} is already queued")
        size = self.measure(job) if mergeable(job) else JobSize(0, 0, 0)
        line.pending[job.seq_id] = _Entry(job, now, size)
        return None

    def _skip_gaps(self, now: float) -> None:
        for model_id, line in self._lines.items():
            if line.pending and line.next_seq not in line.pending:
                oldest = min(e.arrived for e in line.pending.values())
                if now - oldest >= self.gap_timeout:
                    log.warning("%s: seq_id %d did not arrive within %.0f s; running from seq_id %d (a late one "
                                "will be refused)", model_id, line.next_seq, self.gap_timeout, min(line.pending))
                    line.next_seq = min(line.pending)

    def pop_ready(self, now: float) -> list[Job]:
        """Every job that may run now, each model's in seq order (one job at a time, no merging)."""
        self._skip_gaps(now)
        ready: list[Job] = []
        for line in self._lines.values():
            while line.next_seq in line.pending:
                ready.append(line.pop_head())
        while (release := self._pop_release()) is not None:
            ready.append(release)
        return ready

    def has_ready(self, now: float) -> bool:
        self._skip_gaps(now)
        return any(not self._lines[m].pending for m in self._releasing) or any(
            line.next_seq in line.pending for line in self._lines.values())

    def _pop_release(self) -> Job | None:
        """A release whose model has nothing queued any more; the model's line ends with it."""
        for model_id in self._releasing:
            line = self._lines[model_id]
            if line.release is not None and not line.pending:
                del self._lines[model_id], self._releasing[model_id]
                self._released[model_id] = None
                if len(self._released) > self.max_remembered_releases:
                    del self._released[next(iter(self._released))]
                return line.release
        return None

    def next_step(self, now: float) -> Step | None:
        """The next step to run, or None when every line waits for a missing seq_id (or is empty)."""
        self._skip_gaps(now)
        release = self._pop_release()
        if release is not None:
            return Step((release,), merged=False)
        heads = [(line, e) for line in self._lines.values() if (e := line.head()) is not None]
        if not heads:
            return None
        barriers = [(line, e) for line, e in heads if not mergeable(e.job)]
        merge = [(line, e) for line, e in heads if mergeable(e.job)]
        # Barriers are cheap and hold back their own model: they go first, but a stream of them (one tenant's
        # saves) may delay everybody's merged pass by at most `max_barriers_in_a_row` barrier jobs. Heads of
        # different models run together in one step (in arrival order), so many tenants' optim_steps cost one
        # hand-over to the compute thread instead of one each.
        if barriers and (not merge or self._barriers_in_a_row < self.max_barriers_in_a_row):
            room = self.max_barriers_in_a_row - self._barriers_in_a_row if merge else self.max_barriers_in_a_row
            picked = sorted(barriers, key=lambda le: le[1].arrived)[: max(room, 1)]
            self._barriers_in_a_row += len(picked)
            return Step(tuple(line.pop_head() for line, _ in picked), merged=False)
        self._barriers_in_a_row = 0
        return Step(tuple(self._pack(merge)), merged=True)

    def _pack(self, heads: list[tuple[_Line, _Entry]]) -> list[Job]:
        picked: list[Job] = []
        rows = width = 0
        candidates = sorted(heads, key=lambda le: le[1].arrived)  # ties go to the earlier arrival
        while candidates:
            best = min(candidates, key=self._start_tag)
            candidates.remove(best)
            line, entry = best
            size = entry.size
            if picked and (rows + size.rows) * max(width, size.max_len) > self.token_budget:
                continue  # does not fit beside what was picked; a smaller candidate still may
            s = self._start_tag(best)
            self._vtime = s
            self._finish[entry.job.tenant_id] = s + max(size.tokens, 1)
            rows, width = rows + size.rows, max(width, size.max_len)
            picked.append(line.pop_head())
        return picked

    def _start_tag(self, candidate: tuple[_Line, _Entry]) -> float:
        return max(self._finish.get(candidate[1].job.tenant_id, 0.0), self._vtime)

    def next_deadline(self) -> float | None:
        """When the oldest held-back job's gap will be skipped, if any job is held back."""
        times = [
            min(e.arrived for e in line.pending.values()) + self.gap_timeout
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
        self._releasing.pop(model_id, None)

    def waiting(self) -> int:
        return sum(len(line.pending) for line in self._lines.values())
