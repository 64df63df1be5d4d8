"""Per-adapter optimizer steps: AdamW equal to `torch.optim.AdamW`, SGD equal to `torch.optim.SGD`, each after
global grad-norm clipping equal to `torch.nn.utils.clip_grad_norm_`, and the job's LR schedule.

Each tenant's adapter owns one OptimState (workers/engine/optim_state.py: the model's step count and its
optimizer's buffers). Hyperparameters arrive with every optim_step (the cookbook changes the learning rate each
step, and may change betas or weight decay), so they are arguments, not state. Clipping covers this adapter's
parameters only. `optimizer_step` is the engine's entry point; `adam_step` is the AdamW step alone.

A step of another optimizer than the one whose buffers the state holds (a loaded AdamW checkpoint stepped with
SGD, say) starts that optimizer's buffers fresh, as a newly constructed torch optimizer would; the model's step
count, and with it the schedule, goes on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from api_schemas.training import SGD, Adam, AdamW, LRSchedule
from workers.engine.optim_state import ADAMW as _ADAMW
from workers.engine.optim_state import SGD as _SGD
from workers.engine.optim_state import AdamState, OptimState

__all__ = [
    "AdamHyper", "AdamState", "InvalidAdamParamsError", "InvalidOptimizerParamsError", "NonFiniteGradError",
    "OptimState", "SGDHyper", "adam_step", "gradient_norm", "optimizer_step", "schedule_factor",
]

# clip_grad_norm_ adds this to the norm before dividing; kept so clipping equals torch's bit for bit.
_CLIP_EPS = 1e-6


class NonFiniteGradError(ValueError):
    """The gradient norm is NaN or infinite; the step was refused and the parameters are unchanged."""


class InvalidOptimizerParamsError(ValueError):
    """Optimizer or schedule parameters that torch would refuse (a user error); nothing was changed."""


InvalidAdamParamsError = InvalidOptimizerParamsError  # its name before SGD and schedules existed


def _check(hp: object, values: tuple[float, ...], checks: list[tuple[bool, str]]) -> None:
    if not all(math.isfinite(v) for v in values):
        raise InvalidOptimizerParamsError(f"{type(hp).__name__} hyperparameters must be finite numbers: {hp}")
    for ok, message in checks:
        if not ok:
            raise InvalidOptimizerParamsError(f"{message}: {hp}")


@dataclass(frozen=True)
class AdamHyper:
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float  # <= 0 disables clipping (AdamParams: "0.0 means no clipping")
    l2: bool = False  # torch.optim.Adam: weight decay added to the gradient; False: AdamW's decoupled decay

    def validate(self) -> None:
        """Raise InvalidAdamParamsError for values torch.optim.AdamW would refuse (or that would divide by zero)."""
        _check(self, (self.learning_rate, self.beta1, self.beta2, self.eps, self.weight_decay, self.grad_clip_norm), [
            (self.learning_rate >= 0, "learning_rate must be >= 0"),
            (0 <= self.beta1 < 1, "beta1 must be in [0, 1)"),
            (0 <= self.beta2 < 1, "beta2 must be in [0, 1)"),
            (self.eps >= 0, "eps must be >= 0"),
            (self.weight_decay >= 0, "weight_decay must be >= 0"),
        ])


@dataclass(frozen=True)
class SGDHyper:
    learning_rate: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0  # L2: weight_decay * param added to the (clipped) gradient, as torch.optim.SGD
    grad_clip_norm: float = 0.0

    def validate(self) -> None:
        """Raise InvalidOptimizerParamsError for values torch.optim.SGD would refuse (dampening is always 0)."""
        _check(self, (self.learning_rate, self.momentum, self.weight_decay, self.grad_clip_norm), [
            (self.learning_rate >= 0, "learning_rate must be >= 0"),
            (self.momentum >= 0, "momentum must be >= 0"),
            (self.weight_decay >= 0, "weight_decay must be >= 0"),
            (not self.nesterov or self.momentum > 0, "nesterov needs a momentum > 0"),
        ])


def schedule_factor(schedule: LRSchedule | None, step: int) -> float:
    """The LRSchedule's factor for a model that has taken `step` optimizer steps before this one.

    step / warmup_steps during warm-up (so the first step of a warm-up has rate 0), then 1 (constant), or a
    linear decay / half cosine from 1 at warmup_steps to min_ratio at total_steps, min_ratio after it."""
    if schedule is None:
        return 1.0
    s = schedule
    total = s.total_steps
    _check(s, (s.min_ratio,), [
        (s.warmup_steps >= 0, "warmup_steps must be >= 0"),
        (0 <= s.min_ratio <= 1, "min_ratio must be in [0, 1]"),
        (0 <= s.start_ratio <= 1, "start_ratio must be in [0, 1]"),
        (total is None or total >= 1, "total_steps must be >= 1"),
        (s.kind == "constant" or total is not None, f"a {s.kind} schedule needs total_steps"),
        (s.kind == "constant" or total is None or s.warmup_steps <= total, "warmup_steps must be <= total_steps"),
    ])
    if step < s.warmup_steps:
        return step / s.warmup_steps
    if s.kind == "constant":
        return 1.0
    assert total is not None
    span = total - s.warmup_steps
    progress = 1.0 if span <= 0 else min((step - s.warmup_steps) / span, 1.0)
    decay = 1.0 - progress if s.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return s.min_ratio + (s.start_ratio - s.min_ratio) * decay


def optimizer_step(
    params: list[torch.Tensor],
    state: OptimState,
    optimizer: AdamW | Adam | SGD,
    schedule: LRSchedule | None = None,
    *,
    grads: list[torch.Tensor | None] | None = None,
    grad_scale: float = 1.0,
) -> tuple[dict[str, float], float, int]:
    """One step of the job's optimizer at its scheduled rate, in place: (metrics, learning rate used, the model's
    optimizer steps so far, this one included). Metrics: grad_norm, grad_clip_coef, learning_rate. `grad_scale`
    multiplies the gradients first (the norm and the clipping see the scaled ones).

    Raises InvalidOptimizerParamsError or NonFiniteGradError, touching nothing."""
    fields = optimizer.model_dump(exclude={"kind"})
    hp: AdamHyper | SGDHyper
    if isinstance(optimizer, SGD):
        hp = SGDHyper(**fields)
    else:
        hp = AdamHyper(**fields, l2=isinstance(optimizer, Adam))
    hp.validate()  # the rate as sent: a negative one must not pass as -0.0 through a warm-up factor of 0
    if not (math.isfinite(grad_scale) and grad_scale > 0):
        raise InvalidOptimizerParamsError(f"grad_scale must be a finite number > 0, got {grad_scale}")
    if schedule is not None:
        hp = dataclasses.replace(hp, learning_rate=hp.learning_rate * schedule_factor(schedule, state.step))
    gs, grad_norm = _gradients(params, grads, grad_scale)
    clip_coef = _clip_coef(grad_norm, hp.grad_clip_norm)
    if isinstance(hp, AdamHyper):
        _adam_update(params, gs, state, hp, clip_coef)
    else:
        _sgd_update(params, gs, state, hp, clip_coef)
    metrics = {"grad_norm": grad_norm, "grad_clip_coef": clip_coef, "learning_rate": hp.learning_rate}
    return metrics, hp.learning_rate, state.step


def adam_step(
    params: list[torch.Tensor],
    state: OptimState,
    hp: AdamHyper,
    *,
    grads: list[torch.Tensor | None] | None = None,
) -> dict[str, float]:
    """Apply one AdamW step in place to `params` using their `.grad` (or `grads`, when the caller keeps them).

    A missing gradient counts as zero (the adapter took no loss this step), so every param advances with the
    one shared step count. Raises NonFiniteGradError, touching nothing, when the gradient norm is not finite.
    """
    hp.validate()
    gs, grad_norm = _gradients(params, grads)
    clip_coef = _clip_coef(grad_norm, hp.grad_clip_norm)
    _adam_update(params, gs, state, hp, clip_coef)
    return {"grad_norm": grad_norm, "grad_clip_coef": clip_coef, "learning_rate": hp.learning_rate}


def _gradients(params: list[torch.Tensor], grads: list[torch.Tensor | None] | None, scale: float = 1.0,
               ) -> tuple[list[torch.Tensor], float]:
    """The step's gradients (None: zero) times `scale` and their global norm; NonFiniteGradError when it is not
    finite. Scaling makes copies: the caller's gradient buffers stay as they were."""
    source = grads if grads is not None else [p.grad for p in params]
    if len(source) != len(params):
        raise ValueError(f"{len(source)} gradients for {len(params)} params")
    gs = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, source)]
    if scale != 1.0:
        gs = list(torch._foreach_mul(gs, scale))
    for i, (p, g) in enumerate(zip(params, gs)):
        if g.shape != p.shape:
            raise ValueError(f"gradient {i} has shape {tuple(g.shape)}, param {tuple(p.shape)}")
    grad_norm = _grad_norm(gs)
    if not math.isfinite(grad_norm):
        raise NonFiniteGradError(f"gradient norm is {grad_norm}; optimizer step skipped, weights unchanged")
    return gs, grad_norm


def gradient_norm(params: list[torch.Tensor], grads: list[torch.Tensor | None], scale: float = 1.0) -> float:
    """The global 2-norm of `grads` (None: zero) times `scale`, as a step would clip by (NaN or inf as they are)."""
    if not (math.isfinite(scale) and scale > 0):
        raise InvalidOptimizerParamsError(f"grad_scale must be a finite number > 0, got {scale}")
    present = [g.detach() for g in grads if g is not None]
    return _grad_norm(present) * scale if present else 0.0


def _clip_coef(grad_norm: float, max_norm: float) -> float:
    return min(max_norm / (grad_norm + _CLIP_EPS), 1.0) if max_norm > 0 else 1.0


def _grad_norm(grads: list[torch.Tensor]) -> float:
    # Like clip_grad_norm_: the 2-norm of the per-tensor 2-norms (accumulated in fp64 so mixed dtypes stack).
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads, 2)  # one call for all tensors: the same per-tensor norms
    if len({(n.device, n.dtype) for n in norms}) == 1:
        total = torch.stack(norms).to(device="cpu", dtype=torch.float64)
    else:
        total = torch.stack([n.to(device="cpu", dtype=torch.float64) for n in norms])
    return float(torch.linalg.vector_norm(total, 2))


def _ensure_buffers(params: list[torch.Tensor], buffers: list[list[torch.Tensor]]) -> None:
    """Existing buffers match the params (count, shape) and follow their device and dtype."""
    for tensors in buffers:
        if len(tensors) != len(params):
            raise ValueError(f"optimizer state has {len(tensors)} tensors but the adapter has {len(params)} params")
        for i, p in enumerate(params):
            if tensors[i].shape != p.shape:
                raise ValueError(f"optimizer state tensor {i} has shape {tuple(tensors[i].shape)}, "
                                 f"param {tuple(p.shape)}")
            if tensors[i].device != p.device or tensors[i].dtype != p.dtype:
                tensors[i] = tensors[i].to(device=p.device, dtype=p.dtype)


# _foreach ops turn a Python scalar into the tensor's dtype, the single-tensor ops compute with it in float32 or
# better: equal for float32/float64 tensors (bit for bit on CPU), not for bfloat16/float16 ones.
_FOREACH_DTYPES = (torch.float32, torch.float64)


def _adam_update(params: list[torch.Tensor], gs: list[torch.Tensor], state: OptimState, hp: AdamHyper,
                 clip_coef: float) -> None:
    if state.kind == _ADAMW and state.kind_step > 0:
        _ensure_buffers(params, [state.exp_avg, state.exp_avg_sq])
    state.switch_to(_ADAMW)
    if state.kind_step == 0:
        state.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
        state.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
    state.step += 1
    state.kind_step += 1
    step = state.kind_step  # the bias correction counts the moments' own steps
    bias_correction1 = 1 - hp.beta1**step
    bias_correction2_sqrt = math.sqrt(1 - hp.beta2**step)
    step_size = hp.learning_rate / bias_correction1
    with torch.no_grad():
        if all(p.dtype in _FOREACH_DTYPES for p in params):
            _adam_foreach(params, gs, state, hp, clip_coef, step_size, bias_correction2_sqrt)
        else:
            _adam_each(params, gs, state, hp, clip_coef, step_size, bias_correction2_sqrt)


def _adam_foreach(params: list[torch.Tensor], gs: list[torch.Tensor], state: OptimState, hp: AdamHyper,
                  clip_coef: float, step_size: float, bias_correction2_sqrt: float) -> None:
    """The update of `_adam_each`, each op applied to every tensor in one _foreach call: per element the same
    arithmetic, a handful of dispatches instead of ~8 per tensor (what an optim_step of a small adapter costs)."""
    gs = [g.to(dtype=p.dtype) for p, g in zip(params, gs)]
    if clip_coef != 1.0:
        gs = torch._foreach_mul(gs, clip_coef)  # clip copies: the caller's gradient buffers stay as they were
    ms, vs = state.exp_avg, state.exp_avg_sq
    if hp.l2:  # torch.optim.Adam: grad + weight_decay * param
        if hp.weight_decay != 0:
            gs = torch._foreach_add(gs, params, alpha=hp.weight_decay)
    else:
        torch._foreach_mul_(params, 1 - hp.learning_rate * hp.weight_decay)
    torch._foreach_lerp_(ms, gs, 1 - hp.beta1)
    torch._foreach_mul_(vs, hp.beta2)
    torch._foreach_addcmul_(vs, gs, gs, value=1 - hp.beta2)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, hp.eps)
    torch._foreach_addcdiv_(params, ms, denom, value=-step_size)


def _adam_each(params: list[torch.Tensor], gs: list[torch.Tensor], state: OptimState, hp: AdamHyper,
               clip_coef: float, step_size: float, bias_correction2_sqrt: float) -> None:
    lr, beta1, beta2 = hp.learning_rate, hp.beta1, hp.beta2
    for p, g, m, v in zip(params, gs, state.exp_avg, state.exp_avg_sq):
        g = g.to(dtype=p.dtype)
        if clip_coef != 1.0:
            g = g * clip_coef  # clip a copy: the caller's gradient buffers stay as they were
        # The order of operations mirrors torch.optim.adamw's (adam's, for l2) single-tensor path.
        if hp.l2:
            if hp.weight_decay != 0:
                g = g.add(p, alpha=hp.weight_decay)
        else:
            p.mul_(1 - lr * hp.weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(hp.eps)
        p.addcdiv_(m, denom, value=-step_size)


def _sgd_update(params: list[torch.Tensor], gs: list[torch.Tensor], state: OptimState, hp: SGDHyper,
                clip_coef: float) -> None:
    """torch.optim.SGD's step (dampening 0): the momentum buffer starts as the first momentum step's gradient."""
    if state.kind == _SGD and state.momentum_buffer:
        _ensure_buffers(params, [state.momentum_buffer])
    state.switch_to(_SGD)
    state.step += 1
    state.kind_step += 1
    with torch.no_grad():
        if all(p.dtype in _FOREACH_DTYPES for p in params):
            _sgd_foreach(params, gs, state, hp, clip_coef)
        else:
            _sgd_each(params, gs, state, hp, clip_coef)


def _sgd_foreach(params: list[torch.Tensor], gs: list[torch.Tensor], state: OptimState, hp: SGDHyper,
                 clip_coef: float) -> None:
    """`_sgd_each` in _foreach calls; never in place on `gs`, which may be the caller's gradient buffers."""
    gs = [g.to(dtype=p.dtype) for p, g in zip(params, gs)]
    if clip_coef != 1.0:
        gs = list(torch._foreach_mul(gs, clip_coef))
    if hp.weight_decay != 0:
        gs = list(torch._foreach_add(gs, params, alpha=hp.weight_decay))
    if hp.momentum != 0:
        if not state.momentum_buffer:
            state.momentum_buffer = [torch.clone(g).detach() for g in gs]
        else:
            torch._foreach_mul_(state.momentum_buffer, hp.momentum)
            torch._foreach_add_(state.momentum_buffer, gs, alpha=1)
        gs = (list(torch._foreach_add(gs, state.momentum_buffer, alpha=hp.momentum)) if hp.nesterov
              else state.momentum_buffer)
    torch._foreach_add_(params, gs, alpha=-hp.learning_rate)


def _sgd_each(params: list[torch.Tensor], gs: list[torch.Tensor], state: OptimState, hp: SGDHyper,
              clip_coef: float) -> None:
    fresh = hp.momentum != 0 and not state.momentum_buffer
    for i, (p, g) in enumerate(zip(params, gs)):
        g = g.to(dtype=p.dtype)
        if clip_coef != 1.0:
            g = g * clip_coef
        # The order of operations mirrors torch.optim.sgd's single-tensor path.
        if hp.weight_decay != 0:
            g = g.add(p, alpha=hp.weight_decay)
        if hp.momentum != 0:
            if fresh:
                state.momentum_buffer.append(torch.clone(g).detach())
                buf = state.momentum_buffer[i]
            else:
                buf = state.momentum_buffer[i].mul_(hp.momentum).add_(g, alpha=1)
            g = g.add(buf, alpha=hp.momentum) if hp.nesterov else buf
        p.add_(g, alpha=-hp.learning_rate)
