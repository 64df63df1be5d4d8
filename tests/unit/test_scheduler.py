"""Table-driven tests of the pure scheduler: seq_id order, held-back early arrivals, gaps, duplicates, merged steps,
token budget and fairness between tenants."""

from __future__ import annotations

import pytest

from api_schemas.jobs import RELEASE_SEQ, ForwardBackward, Job, OptimStep, ReleaseModel, Skip
from api_schemas.training import AdamW
from workers.scheduler import JobSize, Scheduler


def job(model: str, seq: int) -> Job:
    return Job(
        job_id=f"{model}-{seq}", tenant_id="t", base_model="b", model_id=model, seq_id=seq,
        payload=Skip(reason="test"),
    )


@pytest.mark.parametrize(
    "arrivals, expected",
    [
        ([("m", 0), ("m", 1), ("m", 2)], [("m", 0), ("m", 1), ("m", 2)]),
        # chunks sent in parallel, first chunk last: nothing runs until seq 1 arrives
        ([("m", 0), ("m", 3), ("m", 2), ("m", 1), ("m", 4)], [("m", 0), ("m", 1), ("m", 2), ("m", 3), ("m", 4)]),
        ([("m", 2), ("m", 1)], []),  # seq 0 (create) never came: everything waits
        ([("a", 0), ("b", 0), ("b", 1), ("a", 2)], [("a", 0), ("b", 0), ("b", 1)]),
    ],
)
def test_order(arrivals: list[tuple[str, int]], expected: list[tuple[str, int]]) -> None:
    s = Scheduler(gap_timeout=100)
    ran = []
    for model, seq in arrivals:
        assert s.add(job(model, seq), now=0) is None
        ran += [(j.model_id, j.seq_id) for j in s.pop_ready(now=0)]
    assert ran == expected


def test_gap_is_skipped_after_timeout() -> None:
    s = Scheduler(gap_timeout=10)
    s.add(job("m", 0), now=0)
    assert [j.seq_id for j in s.pop_ready(now=0)] == [0]
    s.add(job("m", 2), now=1)
    s.add(job("m", 3), now=2)
    assert s.pop_ready(now=5) == []
    assert s.next_deadline() == 11
    assert [j.seq_id for j in s.pop_ready(now=11)] == [2, 3]
    assert s.waiting() == 0


@pytest.mark.parametrize("seq, reason", [(0, "already executed"), (1, "already queued")])
def test_rejects_stale_and_duplicate(seq: int, reason: str) -> None:
    s = Scheduler(gap_timeout=10)
    s.add(job("m", 0), now=0)
    s.pop_ready(now=0)
    s.add(job("m", 2), now=0)
    s.add(job("m", 1), now=0) if seq == 1 else None
    rejection = s.add(job("m", seq), now=0)
    assert rejection is not None and reason in rejection.reason


# --- merged steps, token budget, fairness ---

def fbjob(model: str, seq: int, tenant: str | None = None) -> Job:
    req = ForwardBackward.build([], forward_only=False, loss_fn="cross_entropy")  # sized by the tests' measure
    return Job(job_id=f"{model}-{seq}", tenant_id=tenant or model, base_model="b", model_id=model, seq_id=seq,
               payload=req)


def barrier(model: str, seq: int) -> Job:
    adam = AdamW(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
    return Job(job_id=f"{model}-{seq}", tenant_id=model, base_model="b", model_id=model, seq_id=seq,
               payload=OptimStep(optimizer=adam))


def steps_of(s: Scheduler, now: float = 0, limit: int = 100) -> list[list[str]]:
    out = []
    while (step := s.next_step(now)) is not None and len(out) < limit:
        assert step.merged == all(isinstance(j.payload, ForwardBackward) for j in step.jobs)
        assert len({j.model_id for j in step.jobs}) == len(step.jobs)  # one job per model per step
        out.append([j.job_id for j in step.jobs])
    return out


def sized(sizes: dict[str, JobSize], budget: int) -> Scheduler:
    return Scheduler(gap_timeout=100, token_budget=budget, measure=lambda j: sizes.get(j.model_id, JobSize()))


@pytest.mark.parametrize(
    "arrivals, expected",
    [
        # forward_backward heads of different models merge; an optim_step holds back only its own model
        ([fbjob("a", 1), barrier("a", 2), fbjob("a", 3), fbjob("b", 1), fbjob("b", 2)],
         [["a-1", "b-1"], ["a-2"], ["a-3", "b-2"]]),
        # one model's chunks (consecutive seq_ids) never share a step
        ([fbjob("a", 1), fbjob("a", 2), fbjob("a", 3)], [["a-1"], ["a-2"], ["a-3"]]),
        # an early arrival waits for its predecessor; other models go on
        ([fbjob("a", 2), fbjob("b", 1), fbjob("c", 1)], [["b-1", "c-1"]]),
        # barrier heads of different models run in one step, before the merged pass
        ([barrier("a", 1), barrier("b", 1), fbjob("c", 1)], [["a-1", "b-1"], ["c-1"]]),
        # ...but a model's second barrier waits for the next step
        ([barrier("a", 1), barrier("a", 2), barrier("b", 1)], [["a-1", "b-1"], ["a-2"]]),
    ],
)
def test_merged_steps(arrivals: list[Job], expected: list[list[str]]) -> None:
    s = Scheduler(gap_timeout=100)
    for model in "abc":
        s.resume(model, 1)
    for j in arrivals:
        assert s.add(j, now=0) is None
    assert steps_of(s) == expected


@pytest.mark.parametrize(
    "sizes, budget, expected",
    [
        # padded cost = rows x longest row: a+b = 3 x 30 fits 100; c would make it 4 x 40
        ({"a": JobSize(2, 30, 50), "b": JobSize(1, 30, 30), "c": JobSize(1, 40, 40)}, 100, [["a-1", "b-1"], ["c-1"]]),
        # a job bigger than the whole budget still runs, alone, and a smaller one fills the next step
        ({"a": JobSize(10, 100, 1000), "b": JobSize(1, 5, 5), "c": JobSize(1, 5, 5)}, 100,
         [["a-1"], ["b-1", "c-1"]]),
        # a candidate that does not fit is passed over, a later smaller one still joins
        ({"a": JobSize(1, 60, 60), "b": JobSize(1, 80, 80), "c": JobSize(1, 10, 10)}, 130, [["a-1", "c-1"], ["b-1"]]),
    ],
)
def test_token_budget(sizes: dict[str, JobSize], budget: int, expected: list[list[str]]) -> None:
    s = sized(sizes, budget)
    for model in "abc":
        s.resume(model, 1)
        assert s.add(fbjob(model, 1), now=0) is None
    assert steps_of(s) == expected


def test_huge_tenant_cannot_starve_a_small_one() -> None:
    sizes = {f"big{i}": JobSize(1, 1000, 1000) for i in range(4)} | {"small": JobSize(1, 10, 10)}
    s = sized(sizes, 1000)
    for i in range(4):  # one tenant, four models, ten 1000-token chunks each
        s.resume(f"big{i}", 1)
        for seq in range(1, 11):
            s.add(fbjob(f"big{i}", seq, tenant="big"), now=0)
    s.resume("small", 1)
    for seq in range(1, 6):
        s.add(fbjob("small", seq, tenant="small"), now=0)
    steps = steps_of(s, limit=10)
    small_steps = [i for i, st in enumerate(steps) if any(j.startswith("small") for j in st)]
    # 40 big chunks arrived first, yet after one of them the small tenant (10 tokens a job, far below its
    # token share) runs in every step until its queue is empty
    assert small_steps == [1, 2, 3, 4, 5]
    assert all(j.startswith("big") for st in steps[6:] for j in st)


def test_returning_tenant_gets_no_banked_credit() -> None:
    s = sized({"x": JobSize(1, 100, 100), "y": JobSize(1, 100, 100)}, 100)
    s.resume("x", 1)
    s.resume("y", 1)
    for seq in range(1, 6):
        s.add(fbjob("x", seq), now=0)
    assert steps_of(s, limit=5) == [[f"x-{i}"] for i in range(1, 6)]  # x alone: served back to back
    for seq in range(6, 12):
        s.add(fbjob("x", seq), now=0)
    for seq in range(1, 7):
        s.add(fbjob("y", seq), now=0)
    tenants = [st[0].split("-")[0] for st in steps_of(s, limit=6)]
    assert tenants.count("x") == 3 and tenants.count("y") == 3, tenants  # y does not run six in a row


def test_a_stream_of_barriers_delays_merged_work_by_a_bounded_number_of_jobs() -> None:
    s = Scheduler(gap_timeout=100)
    for i in range(20):
        s.resume(f"m{i}", 1)
        s.add(barrier(f"m{i}", 1), now=i)
    s.resume("f", 1)
    s.add(fbjob("f", 1), now=30)
    steps = steps_of(s)
    n = Scheduler.max_barriers_in_a_row
    before = steps[: steps.index(["f-1"])]
    assert sum(len(st) for st in before) == n, steps
    assert [j for st in steps for j in st if j != "f-1"] == [f"m{i}-1" for i in range(20)]  # in arrival order


def release(model: str) -> Job:
    return Job(job_id=f"{model}-release", tenant_id="t", base_model="b", model_id=model, seq_id=RELEASE_SEQ,
               payload=ReleaseModel(reason="test"))


def test_release_runs_after_everything_queued_before_it_then_rejects_late_jobs() -> None:
    s = Scheduler(gap_timeout=10)
    s.add(job("m", 0), now=0)
    s.add(job("m", 2), now=0)  # waits for seq 1, which never comes
    s.add(job("other", 0), now=0)
    assert s.add(release("m"), now=0) is None
    assert s.add(release("m"), now=0) is not None  # a second release while one waits
    order = [(j.model_id, j.seq_id) for j in s.pop_ready(now=0)]
    assert order == [("m", 0), ("other", 0)]  # the release waits for seq 2, held back by the gap
    assert s.has_ready(now=5) is False
    step = s.next_step(now=10)  # the gap is skipped: seq 2 runs, then the release
    assert step is not None and [j.seq_id for j in step.jobs] == [2]
    step = s.next_step(now=10)
    assert step is not None and [j.job_id for j in step.jobs] == ["m-release"] and not step.merged
    assert s.next_step(now=10) is None and s.waiting() == 0
    late = s.add(job("m", 3), now=11)
    assert late is not None and "released" in late.reason
    assert s.add(job("other", 1), now=11) is None  # other models go on


def test_release_of_a_model_this_scheduler_never_saw_runs_at_once() -> None:
    s = Scheduler(gap_timeout=10)
    assert s.add(release("gone"), now=0) is None
    assert s.has_ready(now=0)
    assert [j.job_id for j in s.pop_ready(now=0)] == ["gone-release"]
