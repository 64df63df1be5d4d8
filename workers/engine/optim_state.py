"""One adapter's optimizer state (AdamW moments or an SGD momentum buffer) and its saved format.

The state belongs to the model, not to one optimizer: `step` counts every optimizer step the model took (the LR
schedule's position, OptimStepResult.step), `kind` says whose buffers it holds. A step of another kind than the
state's starts that kind's buffers fresh (as constructing a new torch optimizer would, and as twinkle's
set_optimizer does) while `step` goes on counting; `kind_step` counts the steps the current buffers have seen
(AdamW's bias correction), equal to `step` unless the model changed optimizer.

Saved format (optimizer.safetensors, also the paging spill's optimizer part): tensors "step" (int64 scalar),
then AdamW "exp_avg.{i}" / "exp_avg_sq.{i}" or SGD "momentum_buffer.{i}", and safetensors metadata
{"optimizer": "adamw" | "sgd", "kind_step": "<int>"}. A file without that metadata is a checkpoint saved before
SGD existed: an AdamW state whose kind_step is its step, so those checkpoints load unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["ADAMW", "SGD", "AdamState", "OptimState"]

ADAMW, SGD = "adamw", "sgd"
_BUFFERS = {ADAMW: ("exp_avg", "exp_avg_sq"), SGD: ("momentum_buffer",)}


@dataclass
class OptimState:
    """Buffers are created lazily, shaped like the params, by the first step that needs them."""

    step: int = 0
    kind: str | None = None  # ADAMW | SGD once a step ran; None before
    kind_step: int = 0
    exp_avg: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sq: list[torch.Tensor] = field(default_factory=list)
    momentum_buffer: list[torch.Tensor] = field(default_factory=list)  # empty while every SGD step had momentum 0

    def switch_to(self, kind: str) -> None:
        """Make this state the `kind` optimizer's: another kind's buffers are dropped, the model's step stays."""
        if self.kind == kind:
            return
        self.kind, self.kind_step = kind, 0
        self.drop_buffers()

    def drop_buffers(self) -> None:
        """Free the buffers (paging wrote them elsewhere); load_state_dict brings them back."""
        self.exp_avg, self.exp_avg_sq, self.momentum_buffer = [], [], []

    def buffer_sets(self) -> int:
        """How many sets of buffers (each one tensor per parameter) the state holds now."""
        return sum(1 for buffers in (self.exp_avg, self.exp_avg_sq, self.momentum_buffer) if buffers)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.exp_avg, *self.exp_avg_sq, *self.momentum_buffer]

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every buffer by fn(buffer) (paging moves the state with it)."""
        self.exp_avg = [fn(t) for t in self.exp_avg]
        self.exp_avg_sq = [fn(t) for t in self.exp_avg_sq]
        self.momentum_buffer = [fn(t) for t in self.momentum_buffer]

    def metadata(self) -> dict[str, str]:
        return {"optimizer": self.kind or ADAMW, "kind_step": str(self.kind_step)}

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The saved format's tensors, without copies (the caller must not let them change before use)."""
        out = {"step": torch.tensor(self.step, dtype=torch.int64)}
        for name in _BUFFERS[self.kind or ADAMW]:
            out |= {f"{name}.{i}": t.detach() for i, t in enumerate(getattr(self, name))}
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor map (contiguous CPU copies), ready for safetensors.save_file with `metadata()`."""
        return {k: v.to("cpu", copy=True).contiguous() for k, v in self.named_tensors().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                        *, clone: bool = True) -> None:
        """Inverse of state_dict (+ metadata; None: a file saved before SGD existed, an AdamW state).

        Raises ValueError, changing nothing, for a state that is not one; shapes are checked at the next step."""
        meta = metadata or {}
        kind = meta.get("optimizer", ADAMW)
        if kind not in _BUFFERS:
            raise ValueError(f"optimizer state is of unknown optimizer {kind!r}")
        if "step" not in state:
            raise ValueError("optimizer state has no 'step'")
        names = _BUFFERS[kind]
        n = sum(1 for k in state if k.startswith(f"{names[0]}."))
        expected = {"step"} | {f"{name}.{i}" for name in names for i in range(n)}
        if set(state) != expected:
            raise ValueError(f"optimizer state keys are not a saved {kind} state: {sorted(set(state) ^ expected)}")
        step = int(state["step"].item())
        kind_step = int(meta.get("kind_step", step))
        if step < 0 or not 0 <= kind_step <= step:
            raise ValueError(f"optimizer state is inconsistent: step {step}, {kind} step {kind_step}")
        if kind == ADAMW and (kind_step == 0) != (n == 0):
            raise ValueError(f"optimizer state is inconsistent: step {kind_step} with {n} moment tensors")
        if kind == SGD and kind_step == 0 and n:
            raise ValueError(f"optimizer state is inconsistent: no SGD step with {n} momentum buffers")
        self.step, self.kind_step = step, kind_step
        self.kind = kind if step > 0 else None
        copy = (lambda t: t.detach().clone()) if clone else (lambda t: t)
        self.exp_avg, self.exp_avg_sq, self.momentum_buffer = [], [], []
        for name in names:
            setattr(self, name, [copy(state[f"{name}.{i}"]) for i in range(n)])

    def save(self, path: Path) -> None:
        save_file(self.state_dict(), str(path), metadata=self.metadata())

    @classmethod
    def load(cls, path: Path) -> OptimState:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iteration
        state = cls()
        state.load_state_dict(tensors, metadata or None, clone=False)
        return state


AdamState = OptimState  # the name before SGD existed: an OptimState is an AdamState until an SGD step runs
