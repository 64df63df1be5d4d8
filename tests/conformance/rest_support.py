"""Helpers shared by the RestClient conformance tests (test_rest_*.py): data, a short training run, error codes."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import tinker
from tinker import types


def batch(seed: int = 0, n: int = 3) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(5, 200, size=10).tolist()
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        ))
    return out


def trained_client(sc: tinker.ServiceClient, base_model: str, steps: int = 2, seed: int = 3, **kw: Any) -> Any:
    """A LoRA training client moved away from its initialisation, so its weights matter."""
    tc = sc.create_lora_training_client(base_model=base_model, rank=4, seed=seed, **kw).result()
    data = batch(seed)
    for _ in range(steps):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return tc


def rest(server: Any, key: str = "a") -> tinker.RestClient:
    """A RestClient of tenant `key` ("a" or "b" of the conformance server fixture)."""
    return tinker.RestClient(base_url=server.base_url, api_key=getattr(server, f"api_key_{key}"))


def session_of(model_id: str) -> str:
    return model_id.split(":train:")[0]


def status_of(call: Callable[[], Any]) -> int:
    """The HTTP status an SDK call fails with (the SDK raises tinker.APIStatusError subclasses)."""
    with pytest.raises(tinker.APIStatusError) as info:
        call()
    return int(info.value.status_code)
