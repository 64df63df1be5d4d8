"""Custom losses in the trainer's merged step: a custom loss equal to weighted cross-entropy gives the same
gradient as cross_entropy, and a custom loss that blows its size budget or is not finite fails only its own job."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from api_schemas.jobs import ForwardBackward, ForwardBackwardResult, Job
from tests.unit.engine_jobs import fb, job, loss_of, random_rows
from tests.unit.test_custom_loss import program
from tests.unit.test_merged import MODELS, TOL, _grads, _rel, _step, _trainer


def weighted_ce(logprobs, weights):  # type: ignore[no-untyped-def]
    return -(logprobs * weights).sum(), {"custom/tokens:sum": (weights != 0).sum().float()}


def bomb(logprobs, weights):  # type: ignore[no-untyped-def]
    return logprobs.repeat(10**5, 10**5).sum(), {}


def not_finite(logprobs, weights):  # type: ignore[no-untyped-def]
    return (logprobs / 0.0).sum(), {}


def as_custom(plain: Job, fn) -> Job:  # type: ignore[no-untyped-def]
    """The same datums as a cross_entropy job, run by `fn` as a server-side custom loss."""
    assert isinstance(plain.payload, ForwardBackward)
    prog = program(fn, {"logprobs": 1, "weights": 1}, loss_id=f"custom-loss-{fn.__name__}")
    payload = plain.payload.model_copy(update={
        "loss_fn": "custom", "loss_config": {"loss_id": prog.loss_id}, "custom_loss": prog})
    return job(plain.model_id, plain.seq_id, payload)


def test_custom_losses_in_a_merged_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    t = _trainer(tiny_model_dir, tmp_path, "float64")
    rng = np.random.default_rng(4)
    plain = {m: fb(m, 3, random_rows(rng, 3, 4, 14)) for m, _, _ in MODELS}
    solo = {}
    for m in ("a", "d"):
        r = t.execute(plain[m])
        assert r.ok, r.error
        solo[m] = (loss_of(r.body), _grads(t, m))
    jobs = [as_custom(plain["a"], weighted_ce), as_custom(plain["b"], bomb), as_custom(plain["c"], not_finite),
            plain["d"]]
    results = {r.job_id: r for r in _step(t, jobs)}
    a, b, c, d = (results[j.job_id] for j in jobs)
    assert a.ok and d.ok, (a.error, d.error)
    assert loss_of(a.body) == pytest.approx(solo["a"][0], rel=1e-9)
    assert _rel(_grads(t, "a"), solo["a"][1]) < 1e-9  # custom == cross_entropy, in the merged pass too
    assert _rel(_grads(t, "d"), solo["d"][1]) < 1e-9  # the other tenants are untouched
    output, batch = a.output, plain["a"].payload
    assert isinstance(output, ForwardBackwardResult) and isinstance(batch, ForwardBackward)
    assert output.metrics["custom/tokens:sum"] == sum(len(tokens) for tokens, _ in batch.datums())
    for r, why in ((b, "exceeds the limit"), (c, "not finite")):
        assert not r.ok and r.error is not None and r.error.category.value == "user" and why in r.error.message
    assert all(g is None for g in t.pool.get("b").grads) and all(g is None for g in t.pool.get("c").grads)


def test_a_job_without_its_graph_fails_as_the_users(tiny_model_dir: Path, tmp_path: Path) -> None:
    t = _trainer(tiny_model_dir, tmp_path, "float32")
    custom = as_custom(fb("a", 3, [[5, 6, 7, 8]]), weighted_ce)
    assert isinstance(custom.payload, ForwardBackward)
    stripped = job("a", 3, custom.payload.model_copy(update={"custom_loss": None}))
    r = t.execute(stripped)
    assert not r.ok and r.error is not None and r.error.category.value == "user" and "no graph" in r.error.message
    assert torch.isfinite(torch.tensor(loss_of(t.execute(fb("a", 4, [[5, 6, 7, 8]])).body)))


def floor_div(logprobs, weights):  # type: ignore[no-untyped-def]
    return -((logprobs // 0.5) * weights).sum() - (logprobs * weights).sum(), {}  # floor_divide has no backward


def test_a_loss_whose_backward_fails_fails_alone(tiny_model_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A loss that runs forward but whose backward raises fails as the user's, in its own job: the merged pass is
    not faulted (which would run every tenant's job again, one by one)."""
    t = _trainer(tiny_model_dir, tmp_path, "float32")
    rng = np.random.default_rng(5)
    plain = {m: fb(m, 3, random_rows(rng, 3, 4, 14)) for m in ("a", "d")}
    r = t.execute(plain["d"])
    assert r.ok, r.error
    solo = _grads(t, "d")
    passes = []
    run = t._merged.run
    monkeypatch.setattr(t._merged, "run", lambda jobs, on_result: (passes.append(len(jobs)), run(jobs, on_result)))
    jobs = [as_custom(plain["a"], floor_div), plain["d"]]
    results = {r.job_id: r for r in _step(t, jobs)}
    a, d = results[jobs[0].job_id], results[jobs[1].job_id]
    assert not a.ok and a.error is not None and a.error.category.value == "user", a.error
    assert "backward" in a.error.message and "floor_divide" in a.error.message
    assert d.ok, d.error
    assert passes == [2]  # one merged pass, not rerun job by job
    assert _rel(_grads(t, "d"), solo) < TOL["float32"]
    assert all(g is None for g in t.pool.get("a").grads)


def test_a_forward_only_loss_is_the_same_next_to_a_training_job(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A forward-only job runs no backward, whoever shares its pass: a training job in the same pass (which turns
    autograd on for the pass) must not make its loss pay for, or fail in, a backward it never runs."""
    t = _trainer(tiny_model_dir, tmp_path, "float32")
    rng = np.random.default_rng(6)
    forward = as_custom(fb("a", 3, random_rows(rng, 2, 4, 14), forward_only=True), floor_div)
    alone = t.execute(forward)
    assert alone.ok, alone.error
    results = {r.job_id: r for r in _step(t, [forward, fb("d", 3, random_rows(rng, 2, 4, 14))])}
    assert all(r.ok for r in results.values()), [r.error for r in results.values()]
    assert loss_of(results[forward.job_id].body) == pytest.approx(loss_of(alone.body), rel=1e-6)
