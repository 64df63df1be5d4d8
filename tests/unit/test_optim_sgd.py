"""SGD equal to torch.optim.SGD (after clip_grad_norm_), LR schedules, and the state of either optimizer through
checkpoints (old AdamW ones included), optimizer changes and paging: optimizer_step, the engine's entry point."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from api_schemas.jobs import OptimStep
from api_schemas.training import SGD, AdamW, LRSchedule, LoraSpec
from tests.unit.engine_jobs import create, fb
from tests.unit.test_optim import (
    SCHEDULE,
    _close,
    _grads,
    _params,
    _torch_adamw,
    _torch_step,
)
from workers.checkpoints.store import CheckpointStore
from workers.engine import optim
from workers.engine.adapter_pool import Adapter
from workers.engine.base_model import BaseModel
from workers.engine.optim import (
    AdamHyper,
    AdamState,
    InvalidAdamParamsError,
    InvalidOptimizerParamsError,
    OptimState,
    adam_step,
    optimizer_step,
    schedule_factor,
)
from workers.engine.paging import move, read_spill, state_bytes, write_spill
from workers.engine.trainer import Trainer

SGD_CASES = {  # per step (momentum, nesterov, weight_decay, grad_clip_norm); the learning rate changes too
    "plain": [(0.0, False, 0.0, 0.0)] * 4,
    "momentum": [(0.9, False, 0.0, 0.0)] * 4,
    "nesterov": [(0.9, True, 0.0, 0.0)] * 4,
    "weight_decay": [(0.0, False, 0.1, 0.0), (0.0, False, 0.01, 0.0)] * 2,
    "everything": [(0.9, True, 0.1, 0.5), (0.8, True, 0.05, 1e6), (0.5, False, 0.2, 0.5), (0.95, True, 0.0, 0.3)],
    "momentum_starts_late": [(0.0, False, 0.1, 0.0), (0.9, False, 0.1, 0.5), (0.7, True, 0.0, 0.0), (0.0, False, 0.0, 0.0)],
}
LRS = [1e-1, 5e-2, 0.0, 2e-1]


def _sgd(momentum: float, nesterov: bool, weight_decay: float, clip: float, lr: float) -> SGD:
    return SGD(learning_rate=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, grad_clip_norm=clip)


def _torch_sgd_step(opt: torch.optim.SGD, ref: list[torch.Tensor], grads: list[torch.Tensor], spec: SGD) -> None:
    for p, g in zip(ref, grads):
        p.grad = g.clone()
    if spec.grad_clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(ref, spec.grad_clip_norm)
    opt.param_groups[0].update(lr=spec.learning_rate, momentum=spec.momentum, nesterov=spec.nesterov,
                               weight_decay=spec.weight_decay)
    opt.step()


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per_tensor"])
@pytest.mark.parametrize("case", sorted(SGD_CASES))
def test_sgd_matches_torch_sgd_every_step(case: str, foreach: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not foreach:  # the per-tensor path (bfloat16 / float16 params) must be the same update
        monkeypatch.setattr(optim, "_FOREACH_DTYPES", ())
    ours, ref = [p.clone() for p in _params()], [p.clone() for p in _params()]
    opt, state = torch.optim.SGD(ref, lr=1.0, momentum=0.9, foreach=False), OptimState()
    for step, (hyper, lr) in enumerate(zip(SGD_CASES[case], LRS)):
        spec = _sgd(*hyper, lr=lr)
        grads = _grads(step, scale=0.1)
        originals = [g.clone() for g in grads]
        metrics, used_lr, count = optimizer_step(ours, state, spec, grads=list(grads))
        _torch_sgd_step(opt, ref, originals, spec)
        _close(ours, [r.detach() for r in ref])
        _close(grads, originals)  # weight decay, clipping and Nesterov never write into the caller's gradients
        assert (used_lr, count, state.kind) == (lr, step + 1, "sgd") and "step" not in metrics
        assert metrics["learning_rate"] == lr and (metrics["grad_clip_coef"] < 1) == (0 < spec.grad_clip_norm < 1)
    buffers = [opt.state[p].get("momentum_buffer") for p in ref]
    if buffers[0] is None:
        assert not state.momentum_buffer
    else:
        _close(state.momentum_buffer, buffers)


def test_sgd_float32_stays_float32_and_matches_torch() -> None:
    ours = _params(dtype=torch.float32)
    ref = [p.clone() for p in ours]
    opt, state = torch.optim.SGD(ref, lr=1.0, momentum=0.9, foreach=False), OptimState()
    for step, (hyper, lr) in enumerate(zip(SGD_CASES["everything"], LRS)):
        spec = _sgd(*hyper, lr=lr)
        grads = _grads(step, dtype=torch.float32)
        optimizer_step(ours, state, spec, grads=list(grads))
        _torch_sgd_step(opt, ref, grads, spec)
    assert all(t.dtype == torch.float32 for t in ours + state.momentum_buffer)
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x, y.detach(), rtol=1e-6, atol=1e-7)


def test_optimizer_step_adamw_is_adam_step() -> None:
    a, b = [p.clone() for p in _params()], [p.clone() for p in _params()]
    sa, sb = OptimState(), AdamState()
    for step, hp in enumerate(SCHEDULE):
        metrics, lr, count = optimizer_step(a, sa, AdamW(**{k: v for k, v in hp.__dict__.items() if k != "l2"}),
                                           grads=_grads(step))
        legacy = adam_step(b, sb, hp, grads=_grads(step))
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert metrics == {k: v for k, v in legacy.items() if k != "step"} and (lr, count) == (hp.learning_rate, step + 1)
    assert all(torch.equal(x, y) for x, y in zip(sa.exp_avg_sq + sa.exp_avg, sb.exp_avg_sq + sb.exp_avg))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (SGD(learning_rate=-1e-3), "learning_rate"),
        (SGD(learning_rate=1e-3, momentum=-0.5), "momentum"),
        (SGD(learning_rate=1e-3, nesterov=True), "nesterov"),
        (SGD(learning_rate=1e-3, weight_decay=-0.1), "weight_decay"),
        (SGD(learning_rate=1e-3, weight_decay=float("inf")), "finite"),
    ],
)
def test_invalid_sgd_parameters_are_refused_before_any_change(spec: SGD, message: str) -> None:
    params = _params()
    before = [p.clone() for p in params]
    state = OptimState()
    with pytest.raises(InvalidOptimizerParamsError, match=message):
        optimizer_step(params, state, spec, grads=_grads(0))
    assert InvalidOptimizerParamsError is InvalidAdamParamsError  # one user error for every optimizer
    _close(params, before)
    assert state.step == 0 and state.kind is None and not state.tensors()


@pytest.mark.parametrize(
    ("schedule", "factors"),  # factor at steps 0, 1, 2, ... (the model's steps before the step)
    [
        (LRSchedule(), [1.0, 1.0, 1.0]),
        (LRSchedule(warmup_steps=4), [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]),
        (LRSchedule(warmup_steps=2, total_steps=3, min_ratio=0.5), [0.0, 0.5, 1.0, 1.0]),  # constant: no decay
        (LRSchedule(kind="linear", total_steps=4), [1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]),
        (LRSchedule(kind="linear", total_steps=4, min_ratio=0.2), [1.0, 0.8, 0.6, 0.4, 0.2, 0.2]),
        (LRSchedule(kind="linear", warmup_steps=2, total_steps=6), [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]),
        (LRSchedule(kind="cosine", total_steps=4),
         [1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0.5 - 0.5 * math.cos(math.pi / 4), 0.0, 0.0]),
        (LRSchedule(kind="cosine", warmup_steps=1, total_steps=3, min_ratio=0.1), [0.0, 1.0, 0.55, 0.1, 0.1]),
        (LRSchedule(kind="cosine", warmup_steps=2, total_steps=2), [0.0, 0.5, 0.0, 0.0]),  # all warm-up, then the floor
    ],
)
def test_schedule_factors(schedule: LRSchedule, factors: list[float]) -> None:
    got = [schedule_factor(schedule, step) for step in range(len(factors))]
    assert got == pytest.approx(factors, abs=1e-15)
    assert schedule_factor(None, 7) == 1.0


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (LRSchedule(kind="linear"), "needs total_steps"),
        (LRSchedule(kind="cosine", warmup_steps=2), "needs total_steps"),
        (LRSchedule(warmup_steps=-1), "warmup_steps must be >= 0"),
        (LRSchedule(kind="linear", total_steps=10, min_ratio=1.5), "min_ratio"),
        (LRSchedule(kind="cosine", total_steps=10, min_ratio=-0.1), "min_ratio"),
        (LRSchedule(min_ratio=float("nan")), "finite"),
        (LRSchedule(kind="linear", total_steps=0), "total_steps must be >= 1"),
        (LRSchedule(kind="cosine", warmup_steps=5, total_steps=4), "warmup_steps must be <= total_steps"),
    ],
)
def test_invalid_schedules_are_refused_before_any_change(schedule: LRSchedule, message: str) -> None:
    params = _params()
    before = [p.clone() for p in params]
    state = OptimState()
    with pytest.raises(InvalidOptimizerParamsError, match=message):
        optimizer_step(params, state, SGD(learning_rate=0.1), schedule, grads=_grads(0))
    _close(params, before)
    assert state.step == 0


def test_negative_rate_is_refused_even_where_the_warmup_factor_is_zero() -> None:
    with pytest.raises(InvalidOptimizerParamsError, match="learning_rate"):
        optimizer_step(_params(), OptimState(), AdamW(learning_rate=-1.0), LRSchedule(warmup_steps=3),
                       grads=_grads(0))


@pytest.mark.parametrize("spec", [AdamW(learning_rate=1e-2, weight_decay=0.1), _sgd(0.9, True, 0.1, 0.0, 1e-1)])
def test_scheduled_steps_equal_torch_at_the_scheduled_rate(spec: AdamW | SGD) -> None:
    schedule = LRSchedule(kind="cosine", warmup_steps=2, total_steps=5, min_ratio=0.1)
    ours, ref = [p.clone() for p in _params()], [p.clone() for p in _params()]
    opt = _torch_adamw(ref) if isinstance(spec, AdamW) else torch.optim.SGD(ref, lr=1.0, momentum=0.9)
    state = OptimState()
    for step in range(7):
        metrics, lr, count = optimizer_step(ours, state, spec, schedule, grads=_grads(step))
        expected_lr = spec.learning_rate * schedule_factor(schedule, step)
        assert (lr, metrics["learning_rate"], count) == (expected_lr, expected_lr, step + 1)
        scaled = spec.model_copy(update={"learning_rate": expected_lr})
        if isinstance(scaled, AdamW):
            _torch_step(opt, ref, _grads(step), AdamHyper(**scaled.model_dump(exclude={"kind"})))
        else:
            _torch_sgd_step(opt, ref, _grads(step), scaled)
        _close(ours, [r.detach() for r in ref])
    assert lr == pytest.approx(0.1 * spec.learning_rate)  # past total_steps: min_ratio


def _trained(spec: AdamW | SGD, steps: int) -> tuple[list[torch.Tensor], OptimState]:
    params, state = [p.clone() for p in _params()], OptimState()
    for step in range(steps):
        optimizer_step(params, state, spec, grads=_grads(step))
    return params, state


SPECS = [AdamW(learning_rate=1e-2, weight_decay=0.1), _sgd(0.9, True, 0.1, 0.0, 1e-1)]


@pytest.mark.parametrize("spec", SPECS, ids=["adamw", "sgd"])
def test_state_of_either_optimizer_round_trips_and_continues_identically(spec: AdamW | SGD, tmp_path: Path) -> None:
    params, state = _trained(spec, 3)
    state.save(tmp_path / "optimizer.safetensors")
    loaded = OptimState.load(tmp_path / "optimizer.safetensors")
    assert (loaded.kind, loaded.step, loaded.kind_step) == (state.kind, 3, 3)
    copy = [p.clone() for p in params]
    for step in range(3, 6):
        optimizer_step(params, state, spec, grads=_grads(step))
        optimizer_step(copy, loaded, spec, grads=_grads(step))
    assert all(torch.equal(x, y) for x, y in zip(params + state.tensors(), copy + loaded.tensors()))


def test_checkpoints_saved_before_sgd_existed_load_as_adamw(tmp_path: Path) -> None:
    _, state = _trained(SPECS[0], 3)
    save_file(state.state_dict(), str(tmp_path / "optimizer.safetensors"))  # today's format: no metadata
    loaded = OptimState.load(tmp_path / "optimizer.safetensors")
    assert (loaded.kind, loaded.step, loaded.kind_step) == ("adamw", 3, 3)
    assert set(state.state_dict()) == set(load_file(str(tmp_path / "optimizer.safetensors")))
    assert all(torch.equal(x, y) for x, y in zip(state.tensors(), loaded.tensors()))


def test_changing_optimizer_starts_its_buffers_fresh_and_keeps_counting(tmp_path: Path) -> None:
    params, state = _trained(SPECS[0], 3)  # AdamW moments, then SGD: as a freshly built torch.optim.SGD
    ref = [p.clone() for p in params]
    opt = torch.optim.SGD(ref, lr=1.0, momentum=0.9, foreach=False)
    for step in range(3, 5):
        _, _, count = optimizer_step(params, state, SPECS[1], LRSchedule(kind="linear", total_steps=10),
                                     grads=_grads(step))
        _torch_sgd_step(opt, ref, _grads(step), SPECS[1].model_copy(
            update={"learning_rate": SPECS[1].learning_rate * (1 - step / 10)}))
        assert count == step + 1  # the model's steps (and its schedule) go on
    _close(params, [r.detach() for r in ref])
    assert (state.kind, state.kind_step) == ("sgd", 2) and not state.exp_avg and len(state.momentum_buffer) == 3
    state.save(tmp_path / "o.safetensors")
    state = OptimState.load(tmp_path / "o.safetensors")
    assert (state.kind, state.step, state.kind_step) == ("sgd", 5, 2)
    ref = [p.clone() for p in params]  # and back to AdamW: fresh moments, bias correction from its first step
    opt = _torch_adamw(ref)
    optimizer_step(params, state, SPECS[0], grads=_grads(5))
    _torch_step(opt, ref, _grads(5), AdamHyper(**SPECS[0].model_dump(exclude={"kind"})))
    _close(params, [r.detach() for r in ref])
    assert (state.kind, state.step, state.kind_step) == ("adamw", 6, 1) and not state.momentum_buffer


def test_sgd_without_momentum_keeps_no_buffer_and_saves(tmp_path: Path) -> None:
    _, state = _trained(SGD(learning_rate=0.1), 2)
    assert state.kind == "sgd" and not state.tensors()
    state.save(tmp_path / "o.safetensors")
    loaded = OptimState.load(tmp_path / "o.safetensors")
    assert (loaded.kind, loaded.step, loaded.tensors()) == ("sgd", 2, [])


@pytest.mark.parametrize("spec", SPECS, ids=["adamw", "sgd"])
def test_paging_moves_and_spills_every_tensor_of_either_state(spec: AdamW | SGD, tmp_path: Path) -> None:
    params, state = _trained(spec, 2)
    adapter = Adapter("m", LoraSpec(rank=2), 32.0, [], params, [None] * len(params), optim=state)
    expected = [t.clone() for t in state.tensors()]
    assert state_bytes(adapter) == sum(t.numel() * t.element_size() for t in params + expected)
    move(adapter, torch.device("cpu"))
    path = write_spill(adapter, tmp_path)
    assert not adapter.params and not adapter.optim.tensors()
    read_spill(adapter, path)
    assert (adapter.optim.kind, adapter.optim.step, adapter.optim.kind_step) == (spec.kind, 2, 2)
    assert len(adapter.optim.tensors()) == len(expected) == (6 if spec.kind == "adamw" else 3)
    assert all(torch.equal(x, y) for x, y in zip(adapter.optim.tensors(), expected))



def _steps(trainer: Trainer, model_id: str, specs: list[AdamW | SGD], schedule: LRSchedule | None = None) -> None:
    assert trainer.execute(create(model_id)).ok
    for n, spec in enumerate(specs):
        assert trainer.execute(fb(model_id, 1 + 2 * n, [[5, 6, 7, 8, 9]])).ok
        metrics, lr, step = trainer.optim_step(model_id, OptimStep(optimizer=spec, schedule=schedule))
        assert (lr, step) == (spec.learning_rate * schedule_factor(schedule, n), n + 1)
        assert "step" not in metrics and set(metrics) == {"grad_norm", "grad_clip_coef", "learning_rate"}


def test_trainer_steps_saves_and_loads_either_optimizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path / "store"))
    pool = trainer.pool
    schedule = LRSchedule(kind="linear", warmup_steps=1, total_steps=4)
    _steps(trainer, "sgd", [SPECS[1], SPECS[1]], schedule)
    _steps(trainer, "switched", [SPECS[1], SPECS[1], SPECS[0]], schedule)  # SGD, then AdamW from fresh moments
    for model_id, expected in [("sgd", ("sgd", 2, 2, 1)), ("switched", ("adamw", 3, 1, 2))]:  # buffers per param
        saved = pool.get(model_id).optim
        per_param = len(saved.tensors()) / len(pool.get(model_id).params)
        assert (saved.kind, saved.step, saved.kind_step, per_param) == expected
        pool.save(pool.get(model_id), tmp_path / model_id, with_optimizer=True)
        loaded = pool.load(f"{model_id}-copy", tmp_path / model_id, with_optimizer=True, create=True).optim
        assert (loaded.kind, loaded.step, loaded.kind_step) == expected[:3]
        assert all(torch.equal(x, y) for x, y in zip(loaded.tensors(), saved.tensors(), strict=True))
    _steps(trainer, "adamw", [SPECS[0], SPECS[0]])  # a checkpoint as saved before SGD existed: no metadata
    pool.save(pool.get("adamw"), tmp_path / "old", with_optimizer=False)
    save_file(pool.get("adamw").optim.state_dict(), str(tmp_path / "old" / "optimizer.safetensors"))
    loaded = pool.load("old", tmp_path / "old", with_optimizer=True, create=True).optim
    assert (loaded.kind, loaded.step, loaded.kind_step) == ("adamw", 2, 2)
    assert all(torch.equal(x, y) for x, y in zip(loaded.tensors(), pool.get("adamw").optim.tensors()))
