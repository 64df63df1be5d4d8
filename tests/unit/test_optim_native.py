"""What the native protocol's optimizer settings need from the engine: Adam equal to torch.optim.Adam (L2 weight
decay), a gradient scale applied before clipping (gradient accumulation over a window of backwards), and a linear
schedule starting below 1 (torch's LinearLR)."""

from __future__ import annotations

import pytest
import torch

from api_schemas.training import Adam, AdamW, LRSchedule
from tests.unit.test_optim import _grads, _params
from workers.engine.optim import InvalidOptimizerParamsError, OptimState, optimizer_step, schedule_factor


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("weight_decay,clip", [(0.0, 0.0), (0.01, 0.0), (0.1, 0.5)])
def test_adam_equals_torch_adam(weight_decay: float, clip: float, dtype: torch.dtype) -> None:
    ours = [p.to(dtype) for p in _params()]
    ref = [p.clone().requires_grad_(True) for p in ours]
    opt = torch.optim.Adam(ref, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, foreach=False)
    state = OptimState()
    spec = Adam(learning_rate=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=weight_decay, grad_clip_norm=clip)
    for step in range(4):
        grads = [g.to(dtype) for g in _grads(step)]
        optimizer_step(ours, state, spec, grads=list(grads))
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(ref, clip)
        opt.step()
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-2, "atol": 2e-2}
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x, y.detach(), **tol)


def test_grad_scale_is_the_scaled_gradients_step() -> None:
    """Scaling by 1/n before clipping equals stepping on gradients already divided by n (the norm included)."""
    a, b = _params(), _params()
    sa, sb = OptimState(), OptimState()
    spec = AdamW(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=0.3)
    for step in range(3):
        grads = _grads(step, scale=7.0)
        ma, _, _ = optimizer_step(a, sa, spec, grads=list(grads), grad_scale=1 / 7)
        mb, _, _ = optimizer_step(b, sb, spec, grads=[g / 7 for g in grads])
        assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-12)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    for g, fresh in zip(grads, _grads(2, scale=7.0)):  # the caller's buffers are untouched
        assert torch.equal(g, fresh)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_grad_scale_must_be_positive_and_finite(scale: float) -> None:
    params = _params()
    before = [p.clone() for p in params]
    with pytest.raises(InvalidOptimizerParamsError, match="grad_scale"):
        optimizer_step(params, OptimState(), AdamW(learning_rate=1e-2), grads=_grads(0), grad_scale=scale)
    assert all(torch.equal(x, y) for x, y in zip(params, before))


def test_linear_schedule_from_start_ratio_equals_torch_linear_lr() -> None:
    """LinearLR(start_factor=1/3, end_factor=1, total_iters=5): the factor of each step's rate."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / 3, end_factor=1.0, total_iters=5)
    ours = LRSchedule(kind="linear", total_steps=5, start_ratio=1 / 3, min_ratio=1.0)
    for step in range(8):
        assert schedule_factor(ours, step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12)
        opt.step()
        sched.step()
