"""Per-adapter AdamW: equal to torch.optim.AdamW (and clip_grad_norm_) with hyperparameters changing every step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers.engine.optim import AdamHyper, AdamState, InvalidAdamParamsError, NonFiniteGradError, adam_step

SHAPES = [(4, 8), (8, 3), (5,)]
# Every AdamParams field changes between steps, as a schedule or a careless client would do.
SCHEDULE = [
    AdamHyper(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0),
    AdamHyper(learning_rate=5e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.0),
    AdamHyper(learning_rate=2e-2, beta1=0.5, beta2=0.9, eps=1e-6, weight_decay=0.01, grad_clip_norm=0.0),
    AdamHyper(learning_rate=0.0, beta1=0.95, beta2=0.999, eps=1e-12, weight_decay=0.5, grad_clip_norm=0.0),
    AdamHyper(learning_rate=3e-3, beta1=0.0, beta2=0.5, eps=1e-3, weight_decay=0.2, grad_clip_norm=0.0),
    AdamHyper(learning_rate=1e-1, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.05, grad_clip_norm=0.0),
]


def _params(seed: int = 0, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]


def _grads(step: int, scale: float = 1.0, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g, dtype=dtype) * scale for s in SHAPES]


def _torch_adamw(params: list[torch.Tensor]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1.0, foreach=False)


def _torch_step(
    opt: torch.optim.AdamW, ref: list[torch.Tensor], grads: list[torch.Tensor], hp: AdamHyper
) -> float | None:
    for p, g in zip(ref, grads):
        p.grad = g.clone()
    norm = None
    if hp.grad_clip_norm > 0:
        norm = float(torch.nn.utils.clip_grad_norm_(ref, hp.grad_clip_norm))
    group = opt.param_groups[0]
    group.update(lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
    opt.step()
    return norm


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-7, atol=1e-12)


def test_changing_hyperparameters_match_torch_adamw_every_step() -> None:
    ours = [p.clone() for p in _params()]
    ref = [p.clone() for p in _params()]
    opt, state = _torch_adamw(ref), AdamState()
    for step, hp in enumerate(SCHEDULE):
        grads = _grads(step)
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        metrics = adam_step(ours, state, hp)
        _torch_step(opt, ref, grads, hp)
        _close(ours, [r.detach() for r in ref])
        assert metrics["learning_rate"] == hp.learning_rate and state.step == step + 1 and "step" not in metrics
        assert metrics["grad_norm"] == pytest.approx(math.sqrt(sum(float((g**2).sum()) for g in grads)), rel=1e-12)
    _close(state.exp_avg, [opt.state[p]["exp_avg"] for p in ref])
    _close(state.exp_avg_sq, [opt.state[p]["exp_avg_sq"] for p in ref])
    assert all(p.grad is not None for p in ours)  # the step reads gradients; zeroing them is the engine's job


def test_weights_actually_move_and_wrong_hyperparameters_would_be_caught() -> None:
    ours = [p.clone() for p in _params()]
    before = [p.clone() for p in ours]
    ref = [p.clone() for p in _params()]
    opt = _torch_adamw(ref)
    hp = SCHEDULE[1]
    grads = _grads(0)
    for p, g in zip(ours, grads):
        p.grad = g.clone()
    adam_step(ours, AdamState(), hp)
    _torch_step(opt, ref, grads, AdamHyper(**{**hp.__dict__, "weight_decay": 0.0}))
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(ours, before))
    with pytest.raises(AssertionError):  # ignoring weight decay would be detected by the comparison
        _close(ours, [r.detach() for r in ref])


def test_clipping_equals_clip_grad_norm_then_adamw() -> None:
    ours = [p.clone() for p in _params()]
    ref = [p.clone() for p in _params()]
    opt, state = _torch_adamw(ref), AdamState()
    for step, base in enumerate(SCHEDULE[:4]):
        hp = AdamHyper(**{**base.__dict__, "grad_clip_norm": 0.5 if step % 2 == 0 else 1e6})
        # A norm near 1 (~0.8) so clip_grad_norm_'s +1e-6 in the denominator is visible at rtol 1e-7.
        grads = _grads(step, scale=0.1)
        originals = [g.clone() for g in grads]
        for p, g in zip(ours, grads):
            p.grad = g
        metrics = adam_step(ours, state, hp)
        torch_norm = _torch_step(opt, ref, originals, hp)
        _close(ours, [r.detach() for r in ref])
        assert metrics["grad_norm"] == pytest.approx(torch_norm, rel=1e-12)
        assert (metrics["grad_clip_coef"] < 1.0) == (step % 2 == 0)
        _close([p.grad for p in ours], originals)  # the caller's gradient buffers are not rescaled
    # Adam is nearly scale-invariant, so check the moments too: they are linear in the clipped gradient.
    _close(state.exp_avg, [opt.state[p]["exp_avg"] for p in ref])
    _close(state.exp_avg_sq, [opt.state[p]["exp_avg_sq"] for p in ref])


def test_non_finite_gradient_raises_and_changes_nothing() -> None:
    params = _params()
    state = AdamState()
    for p, g in zip(params, _grads(0)):
        p.grad = g
    adam_step(params, state, SCHEDULE[0])
    snapshot = ([p.clone() for p in params], state.state_dict())
    for bad in (float("nan"), float("inf")):
        grads = _grads(1)
        grads[1][0, 0] = bad
        for p, g in zip(params, grads):
            p.grad = g
        with pytest.raises(NonFiniteGradError):
            adam_step(params, state, SCHEDULE[1])
        _close(params, snapshot[0])
        assert state.step == 1
        for key, value in state.state_dict().items():
            assert torch.equal(value, snapshot[1][key]), key


def test_state_round_trips_through_safetensors_and_continues_like_torch(tmp_path: Path) -> None:
    ours = [p.clone() for p in _params()]
    ref = [p.clone() for p in _params()]
    opt, state = _torch_adamw(ref), AdamState()
    for step, hp in enumerate(SCHEDULE):
        if step == 3:  # save, then continue from a fresh state loaded from disk
            save_file(state.state_dict(), str(tmp_path / "optimizer.safetensors"))
            state = AdamState()
            state.load_state_dict(load_file(str(tmp_path / "optimizer.safetensors")))
            assert state.step == 3
        grads = _grads(step)
        adam_step(ours, state, hp, grads=[g.clone() for g in grads])  # grads passed explicitly, not via .grad
        _torch_step(opt, ref, grads, hp)
    _close(ours, [r.detach() for r in ref])


def test_missing_gradient_counts_as_zero() -> None:
    ours = [p.clone() for p in _params()]
    ref = [p.clone() for p in _params()]
    opt, state = _torch_adamw(ref), AdamState()
    grads = _grads(0)
    adam_step(ours, state, SCHEDULE[1], grads=[grads[0], None, grads[2]])
    _torch_step(opt, ref, [grads[0], torch.zeros(SHAPES[1], dtype=torch.float64), grads[2]], SCHEDULE[1])
    _close(ours, [r.detach() for r in ref])


def test_float32_params_stay_float32_and_match_torch() -> None:
    ours = _params(dtype=torch.float32)
    ref = [p.clone() for p in ours]
    opt, state = _torch_adamw(ref), AdamState()
    for step, hp in enumerate(SCHEDULE[:3]):
        grads = _grads(step, dtype=torch.float32)
        adam_step(ours, state, hp, grads=grads)
        _torch_step(opt, ref, grads, hp)
    assert all(p.dtype == torch.float32 for p in ours + state.exp_avg + state.exp_avg_sq)
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x, y.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "field_value",
    [
        ("beta1", 1.0),
        ("beta2", -0.1),
        ("learning_rate", -1e-3),
        ("eps", -1.0),
        ("weight_decay", -0.1),
        ("learning_rate", float("nan")),
    ],
)
def test_invalid_hyperparameters_are_refused_before_any_change(field_value: tuple[str, float]) -> None:
    name, value = field_value
    params = _params()
    before = [p.clone() for p in params]
    state = AdamState()
    with pytest.raises(InvalidAdamParamsError, match=name if not math.isnan(value) else "finite"):
        adam_step(params, state, AdamHyper(**{**SCHEDULE[0].__dict__, name: value}), grads=_grads(0))
    _close(params, before)
    assert state.step == 0 and not state.exp_avg


def test_state_shape_mismatch_and_bad_state_dict_are_rejected() -> None:
    state = AdamState()
    adam_step(_params(), state, SCHEDULE[0], grads=_grads(0))
    with pytest.raises(ValueError, match="optimizer state has 3 tensors"):
        adam_step(_params()[:2], state, SCHEDULE[0], grads=_grads(0)[:2])
    saved = state.state_dict()
    del saved["exp_avg_sq.2"]
    with pytest.raises(ValueError, match="exp_avg_sq.2"):
        AdamState().load_state_dict(saved)
