"""Per-adapter AdamW for Tinker's optim_step: the update of `torch.optim.AdamW`, with every AdamParams field per step.

Each tenant's adapter owns one AdamState (step count and moments). Hyperparameters arrive with every
optim_step (the cookbook changes the learning rate each step, and may change betas or weight decay), so they
are arguments of `adam_step`, not state. Global grad-norm clipping covers this adapter's parameters only,
exactly like `torch.nn.utils.clip_grad_norm_` followed by AdamW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["AdamHyper", "AdamState", "InvalidAdamParamsError", "NonFiniteGradError", "adam_step"]

# clip_grad_norm_ adds this to the norm before dividing; kept so clipping equals torch's bit for bit.
_CLIP_EPS = 1e-6


class NonFiniteGradError(ValueError):
    """The gradient norm is NaN or infinite; the step was refused and the parameters are unchanged."""


class InvalidAdamParamsError(ValueError):
    """AdamParams that torch.optim.AdamW would refuse (a user error); nothing was changed."""


@dataclass(frozen=True)
class AdamHyper:
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float  # <= 0 disables clipping (AdamParams: "0.0 means no clipping")

    def validate(self) -> None:
        """Raise InvalidAdamParamsError for values torch.optim.AdamW would refuse (or that would divide by zero)."""
        checks = [
            (self.learning_rate >= 0, "learning_rate must be >= 0"),
            (0 <= self.beta1 < 1, "beta1 must be in [0, 1)"),
            (0 <= self.beta2 < 1, "beta2 must be in [0, 1)"),
            (self.eps >= 0, "eps must be >= 0"),
            (self.weight_decay >= 0, "weight_decay must be >= 0"),
        ]
        values = (self.learning_rate, self.beta1, self.beta2, self.eps, self.weight_decay, self.grad_clip_norm)
        if not all(math.isfinite(v) for v in values):
            raise InvalidAdamParamsError(f"Adam hyperparameters must be finite numbers: {self}")
        for ok, message in checks:
            if not ok:
                raise InvalidAdamParamsError(f"{message}: {self}")


@dataclass
class AdamState:
    """One adapter's optimizer state. Moments are created lazily, shaped like the params, on the first step."""

    step: int = 0
    exp_avg: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sq: list[torch.Tensor] = field(default_factory=list)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor map (contiguous CPU copies), ready for safetensors.save_file."""
        out = {"step": torch.tensor(self.step, dtype=torch.int64)}
        for i, (m, v) in enumerate(zip(self.exp_avg, self.exp_avg_sq)):
            out[f"exp_avg.{i}"] = m.detach().to("cpu", copy=True).contiguous()
            out[f"exp_avg_sq.{i}"] = v.detach().to("cpu", copy=True).contiguous()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of state_dict. Shapes are checked against the params at the next adam_step."""
        if "step" not in state:
            raise ValueError("optimizer state has no 'step'")
        n = sum(1 for k in state if k.startswith("exp_avg."))
        expected = {"step"} | {f"exp_avg.{i}" for i in range(n)} | {f"exp_avg_sq.{i}" for i in range(n)}
        if set(state) != expected:
            raise ValueError(f"optimizer state keys are not a saved AdamState: {sorted(set(state) ^ expected)}")
        step = int(state["step"].item())
        if step < 0 or (step == 0) != (n == 0):
            raise ValueError(f"optimizer state is inconsistent: step {step} with {n} moment tensors")
        self.step = step
        self.exp_avg = [state[f"exp_avg.{i}"].detach().clone() for i in range(n)]
        self.exp_avg_sq = [state[f"exp_avg_sq.{i}"].detach().clone() for i in range(n)]


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


def _ensure_state(params: list[torch.Tensor], state: AdamState) -> None:
    if not state.exp_avg and state.step == 0:
        state.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
        state.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
        return
    if len(state.exp_avg) != len(params):
        raise ValueError(f"optimizer state has {len(state.exp_avg)} tensors but the adapter has {len(params)} params")
    for i, p in enumerate(params):
        for moments in (state.exp_avg, state.exp_avg_sq):
            if moments[i].shape != p.shape:
                raise ValueError(
                    f"optimizer state tensor {i} has shape {tuple(moments[i].shape)}, param {tuple(p.shape)}"
                )
            if moments[i].device != p.device or moments[i].dtype != p.dtype:
                moments[i] = moments[i].to(device=p.device, dtype=p.dtype)


def adam_step(
    params: list[torch.Tensor],
    state: AdamState,
    hp: AdamHyper,
    *,
    grads: list[torch.Tensor | None] | None = None,
) -> dict[str, float]:
    """Apply one AdamW step in place to `params` using their `.grad` (or `grads`, when the caller keeps them).

    A missing gradient counts as zero (the adapter took no loss this step), so every param advances with the
    one shared step count. Raises NonFiniteGradError, touching nothing, when the gradient norm is not finite.
    """
    hp.validate()
    source = grads if grads is not None else [p.grad for p in params]
    if len(source) != len(params):
        raise ValueError(f"{len(source)} gradients for {len(params)} params")
    gs = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, source)]
    for i, (p, g) in enumerate(zip(params, gs)):
        if g.shape != p.shape:
            raise ValueError(f"gradient {i} has shape {tuple(g.shape)}, param {tuple(p.shape)}")

    grad_norm = _grad_norm(gs)
    if not math.isfinite(grad_norm):
        raise NonFiniteGradError(f"gradient norm is {grad_norm}; optimizer step skipped, weights unchanged")
    _ensure_state(params, state)

    clip_coef = 1.0
    if hp.grad_clip_norm > 0:
        clip_coef = min(hp.grad_clip_norm / (grad_norm + _CLIP_EPS), 1.0)

    state.step += 1
    step = state.step
    lr, beta1, beta2 = hp.learning_rate, hp.beta1, hp.beta2
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    step_size = lr / bias_correction1
    with torch.no_grad():
        if all(p.dtype in _FOREACH_DTYPES for p in params):
            _update_foreach(params, gs, state, hp, clip_coef, step_size, bias_correction2_sqrt)
        else:
            _update_each(params, gs, state, hp, clip_coef, step_size, bias_correction2_sqrt)
    return {
        "grad_norm": grad_norm,
        "grad_clip_coef": clip_coef,
        "learning_rate": lr,
        "step": float(step),
    }


# _foreach ops turn a Python scalar into the tensor's dtype, the single-tensor ops compute with it in float32 or
# better: equal for float32/float64 tensors (bit for bit on CPU), not for bfloat16/float16 ones.
_FOREACH_DTYPES = (torch.float32, torch.float64)


def _update_foreach(params: list[torch.Tensor], gs: list[torch.Tensor], state: AdamState, hp: AdamHyper,  # noqa: PLR0913
                    clip_coef: float, step_size: float, bias_correction2_sqrt: float) -> None:
    """The update of `_update_each`, each op applied to every tensor in one _foreach call: per element the same
    arithmetic, a handful of dispatches instead of ~8 per tensor (what an optim_step of a small adapter costs)."""
    gs = [g.to(dtype=p.dtype) for p, g in zip(params, gs)]
    if clip_coef != 1.0:
        gs = torch._foreach_mul(gs, clip_coef)  # clip copies: the caller's gradient buffers stay as they were
    ms, vs = state.exp_avg, state.exp_avg_sq
    torch._foreach_mul_(params, 1 - hp.learning_rate * hp.weight_decay)
    torch._foreach_lerp_(ms, gs, 1 - hp.beta1)
    torch._foreach_mul_(vs, hp.beta2)
    torch._foreach_addcmul_(vs, gs, gs, value=1 - hp.beta2)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, hp.eps)
    torch._foreach_addcdiv_(params, ms, denom, value=-step_size)


def _update_each(params: list[torch.Tensor], gs: list[torch.Tensor], state: AdamState, hp: AdamHyper,  # noqa: PLR0913
                 clip_coef: float, step_size: float, bias_correction2_sqrt: float) -> None:
    lr, beta1, beta2 = hp.learning_rate, hp.beta1, hp.beta2
    for p, g, m, v in zip(params, gs, state.exp_avg, state.exp_avg_sq):
        g = g.to(dtype=p.dtype)
        if clip_coef != 1.0:
            g = g * clip_coef  # clip a copy: the caller's gradient buffers stay as they were
        # The order of operations mirrors torch.optim.adamw's single-tensor path.
        p.mul_(1 - lr * hp.weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(hp.eps)
        p.addcdiv_(m, denom, value=-step_size)
