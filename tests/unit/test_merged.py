"""Merged passes: each tenant's gradients, losses and outputs in a merged step equal its solo ones; tenants fail alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from api_schemas.jobs import ForwardBackwardResult, Job, JobResult
from tests.unit.engine_jobs import create, fb, loss_of, optim, random_rows
from workers.checkpoints.store import CheckpointStore
from workers.engine.base_model import BaseModel
from workers.engine.trainer import Trainer

TOL = {"float64": 1e-9, "float32": 1e-5}
# (model, rank, targets): different ranks and target modules in one pass
MODELS = [
    ("a", 2, dict(train_attn=True, train_mlp=False, train_unembed=False)),
    ("b", 8, dict(train_attn=True, train_mlp=True, train_unembed=True)),
    ("c", 4, dict(train_attn=False, train_mlp=True, train_unembed=True)),
    ("d", 1, dict(train_attn=False, train_mlp=False, train_unembed=True)),
]


def _trainer(model_dir: Path, tmp: Path, dtype: str) -> Trainer:
    t = Trainer(BaseModel("tiny", model_dir, dtype=dtype), CheckpointStore(tmp / "ckpt"))
    rng = np.random.default_rng(1)
    for i, (m, rank, targets) in enumerate(MODELS):
        assert t.execute(create(m, rank=rank, seed=i, **targets)).ok
        # one real step, so B is no longer zero and every LoRA weight gets a nonzero gradient
        assert t.execute(fb(m, 1, random_rows(rng, 2, 4, 12))).ok
        assert t.execute(optim(m, 2)).ok
    return t


def _grads(t: Trainer, model: str) -> list[torch.Tensor]:
    adapter = t.pool.get(model)
    out = [g.detach().clone() for g in adapter.grads if g is not None]
    adapter.grads = [None] * len(adapter.params)
    return out


def _rel(x: list[torch.Tensor], y: list[torch.Tensor]) -> float:
    assert len(x) == len(y) and x
    num = max((a - b).abs().max().item() for a, b in zip(x, y))
    den = max(b.abs().max().item() for b in y)
    assert den > 0
    return num / den


def _step(t: Trainer, jobs: list[Job]) -> list[JobResult]:
    results: list[JobResult] = []
    t.execute_step(jobs, results.append)
    assert sorted(r.job_id for r in results) == sorted(j.job_id for j in jobs)  # one result each
    return results


def _logprobs(r: JobResult) -> np.ndarray:
    """Every datum's logprobs of a forward_backward result, concatenated (float32, as the result carries them)."""
    assert isinstance(r.output, ForwardBackwardResult)
    return np.concatenate([o["logprobs"].ravel() for o in r.output.datum_outputs()])


def _jobs(seed: int, seq: int = 3) -> list[Job]:
    rng = np.random.default_rng(seed)
    # rows of very different lengths, so the merged batch pads every tenant's rows to another tenant's length
    shapes = {"a": (3, 3, 9), "b": (1, 30, 30), "c": (2, 2, 5), "d": (4, 10, 20)}
    return [fb(m, seq, random_rows(rng, *shapes[m])) for m, _, _ in MODELS]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_merged_grads_equal_solo(tiny_model_dir: Path, tmp_path: Path, dtype: str) -> None:
    t = _trainer(tiny_model_dir, tmp_path, dtype)
    jobs = _jobs(7)
    solo_losses, solo_grads, solo_lp = {}, {}, {}
    for j in jobs:
        r = t.execute(j)
        assert r.ok, r.error
        solo_losses[j.model_id], solo_grads[j.model_id] = loss_of(r.body), _grads(t, j.model_id)
        solo_lp[j.model_id] = _logprobs(r)
    results = {r.job_id: r for r in _step(t, jobs)}
    for j in jobs:
        r = results[j.job_id]
        assert r.ok, r.error
        assert _rel(_grads(t, j.model_id), solo_grads[j.model_id]) < TOL[dtype], j.model_id
        assert loss_of(r.body) == pytest.approx(solo_losses[j.model_id], rel=TOL[dtype])
        lp = _logprobs(r)
        np.testing.assert_allclose(lp, solo_lp[j.model_id], rtol=1e-5, atol=1e-6)


def test_other_tenants_data_changes_nothing_else(tiny_model_dir: Path, tmp_path: Path) -> None:
    t = _trainer(tiny_model_dir, tmp_path, "float64")
    first = _jobs(11)
    assert all(r.ok for r in _step(t, first))
    before = {m: _grads(t, m) for m, _, _ in MODELS}
    second = list(first)
    second[1] = fb("b", 3, random_rows(np.random.default_rng(99), 5, 40, 60))  # b's data changes (and gets longer)
    assert all(r.ok for r in _step(t, second))
    for m, _, _ in MODELS:
        rel = _rel(_grads(t, m), before[m])
        assert (rel > 1e-3) if m == "b" else (rel < 1e-12), (m, rel)


def test_non_finite_tenant_fails_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    t = _trainer(tiny_model_dir, tmp_path, "float64")
    jobs = _jobs(5)
    solo = {}
    for j in jobs:
        if j.model_id != "c":
            assert t.execute(j).ok
            solo[j.model_id] = _grads(t, j.model_id)
    with torch.no_grad():
        t.pool.get("c").params[1].fill_(float("nan"))  # c's forward turns NaN: its loss is not finite
    results = {r.job_id: r for r in _step(t, jobs)}
    for j in jobs:
        r = results[j.job_id]
        if j.model_id == "c":
            assert not r.ok and r.error is not None and r.error.category.value == "user"
            assert "not finite" in r.error.message
            assert all(g is None for g in t.pool.get("c").grads)
        else:
            assert r.ok, r.error
            assert _rel(_grads(t, j.model_id), solo[j.model_id]) < 1e-9


def test_forward_only_completes_before_backward_and_bad_job_fails_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    t = _trainer(tiny_model_dir, tmp_path, "float32")
    rng = np.random.default_rng(3)
    fwd = fb("a", 3, random_rows(rng, 2, 5, 9), forward_only=True)
    train = fb("b", 3, random_rows(rng, 2, 5, 9))
    unknown = fb("zz", 1, random_rows(rng, 1, 5, 9))
    order = [r.job_id for r in _step(t, [train, fwd, unknown])]
    assert order == [unknown.job_id, fwd.job_id, train.job_id]
    assert all(g is None for g in t.pool.get("a").grads)  # forward-only accumulates nothing
    assert any(g is not None for g in t.pool.get("b").grads)


def test_same_model_twice_accumulates_in_order(tiny_model_dir: Path, tmp_path: Path) -> None:
    t = _trainer(tiny_model_dir, tmp_path, "float64")
    rng = np.random.default_rng(4)
    j1, j2 = fb("a", 3, random_rows(rng, 2, 4, 8)), fb("a", 4, random_rows(rng, 1, 6, 6))
    for j in (j1, j2):
        assert t.execute(j).ok
    sequential = _grads(t, "a")
    assert all(r.ok for r in _step(t, [j1, j2, fb("b", 3, random_rows(rng, 1, 5, 5))]))
    assert _rel(_grads(t, "a"), sequential) < 1e-12


def test_a_failed_merged_pass_reruns_its_jobs_alone(tiny_model_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    t = _trainer(tiny_model_dir, tmp_path, "float64")
    jobs = _jobs(8)
    solo = {}
    for j in jobs:
        assert t.execute(j).ok
        solo[j.model_id] = _grads(t, j.model_id)
    real = t._merged._forward

    def forward_fails_when_merged(items):  # type: ignore[no-untyped-def]
        if len(items) > 1:
            raise RuntimeError("out of memory (simulated)")
        return real(items)

    monkeypatch.setattr(t._merged, "_forward", forward_fails_when_merged)
    results = _step(t, jobs)
    assert all(r.ok for r in results), [r.error for r in results]
    for j in jobs:
        assert _rel(_grads(t, j.model_id), solo[j.model_id]) < 1e-12  # accumulated exactly once


@pytest.mark.parametrize("tokens", [8, 300])
def test_routed_lora_term_equals_each_route_alone(tokens: int) -> None:
    """Rows of adapters with different ranks, of an adapter this layer lacks, and of no adapter: output and every
    adapter's gradient equal those of each route's rows run alone (fp64)."""
    from workers.engine.multi_lora import LoraLinear, Route, routed

    torch.manual_seed(0)
    layer = LoraLinear(torch.nn.Linear(12, 20, dtype=torch.float64))
    gen = torch.Generator().manual_seed(1)
    for name, rank in (("a", 4), ("b", 2)):
        layer.add_adapter(name, rank, scale=2.0, generator=gen)
        with torch.no_grad():
            layer.lora_B[name].normal_(generator=gen)
    routes = [Route("a", 0, 2), Route(None, 2, 3), Route("b", 3, 4), Route("other", 4, 5), Route("a", 5, 6)]
    x = torch.randn(6, tokens, 12, dtype=torch.float64)
    params = [layer.lora_A["a"], layer.lora_B["a"], layer.lora_A["b"], layer.lora_B["b"]]
    with routed({}, routes):
        merged = layer(x)
    grads = torch.autograd.grad((merged * merged).sum(), params)

    solo = []
    for r in routes:
        with routed({}, [Route(r.adapter_id, 0, r.stop - r.start)]):
            solo.append(layer(x[r.start : r.stop]))
    alone = torch.cat(solo)
    assert torch.allclose(merged, alone, rtol=1e-12, atol=1e-12)
    for g, want in zip(grads, torch.autograd.grad((alone * alone).sum(), params)):
        assert torch.allclose(g, want, rtol=1e-10, atol=1e-12)
