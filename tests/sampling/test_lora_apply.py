"""The torch sampler's routing through a FrozenAdapters set: each row gets exactly its own adapter's term, whichever way a layer adds it
(grouped batched matmuls or one matmul per row range), with adapters of different ranks and target layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.engine.multi_lora import FrozenAdapters, LoraLinear, routes_for

IN = 8
OUT = {"q": 6, "up": 10}
# slot -> (rank, scale, layers it targets)
ADAPTERS = {"a": (2, 0.5, ("q", "up")), "b": (4, 2.0, ("q", "up")), "c": (3, 1.5, ("up",))}


@pytest.fixture
def rig() -> tuple[dict[str, LoraLinear], FrozenAdapters, dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    layers = {}
    for name, out in OUT.items():
        base = nn.Linear(IN, out, dtype=torch.float64)
        with torch.no_grad():
            base.weight.copy_(torch.randn(out, IN, generator=gen, dtype=torch.float64))
        layers[name] = LoraLinear(base)
    lora = FrozenAdapters(layers)
    weights = {}
    for slot, (rank, scale, targets) in ADAPTERS.items():
        for name in targets:
            a = torch.randn(rank, IN, generator=gen, dtype=torch.float64)
            b = torch.randn(OUT[name], rank, generator=gen, dtype=torch.float64)
            lora.put(slot, name, a, b, scale)
            weights[(slot, name)] = (a, b)
    return layers, lora, weights


# (each row's slot, tokens per row, whether the "up" layer should take the grouped path)
CASES = [
    (["a", "a", "b", "b", "c", "c"], 1, True),  # "up": rows already grouped; "q": c's rows skipped
    ([None, "a", "b", "b", "b", "c"], 1, True),  # base rows and uneven groups: padded layout
    (["a", "b", "c"], 5, True),  # a prefill of even groups
    (["a", "a", "a", "a", "a", "b", "c"], 5, False),  # a prefill padding would more than double: per range
    ([None, "b", "b"], 1, False),  # one adapter: per range
]


@pytest.mark.parametrize(("slots", "tokens", "grouped"), CASES)
def test_each_row_gets_its_own_adapter(rig, slots: list[str | None], tokens: int, grouped: bool) -> None:  # type: ignore[no-untyped-def]
    layers, lora, weights = rig
    x = torch.randn(len(slots), tokens, IN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        for name, layer in layers.items():
            with lora.plan(routes_for(slots)):
                got = layer(x)
            want = layer.base(x)
            for row, slot in enumerate(slots):
                if (slot, name) in weights:
                    a, b = weights[(slot, name)]
                    want[row] += ADAPTERS[slot][1] * (x[row] @ a.t() @ b.t())
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            assert torch.equal(layer(x), layer.base(x))  # no plan, no adapter
    assert (layers["up"] in lora.stacks) == grouped
