"""The SFT loop the end-to-end fault tests drive through the stock SDK: a fixed batch per step, so two runs over
the same steps (one of them interrupted) must end with the same adapter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def batch(step: int) -> list[Any]:
    """Three datums of 9 target tokens each, the same for the same `step`."""
    from tinker import types

    rng = np.random.default_rng(1000 + step)
    out = []
    for _ in range(3):
        tokens = rng.integers(5, 200, size=10).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 9}))
    return out


def sft(tc: Any, steps: int, during: Callable[[int], None] = lambda _: None, same_batch: bool = False,
        custom_loss: Any = None) -> list[float]:
    """`steps` x (forward_backward + optim_step at lr 2e-2), both submitted before either is awaited; `during(step)`
    runs between submitting and awaiting (e.g. to kill a process). With `custom_loss` (a callable or a handle from
    create_custom_loss) the step is forward_backward_custom, else cross_entropy. Returns the losses."""
    from tinker import types

    losses = []
    for step in range(steps):
        data = batch(0 if same_batch else step)
        fb = tc.forward_backward_custom(data, custom_loss) if custom_loss is not None else tc.forward_backward(
            data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        during(step)
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses
