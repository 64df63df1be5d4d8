"""lora_dropout as PEFT applies it: the adapter's input rows dropped out (kept ones scaled by 1 / (1 - p)) in
training forwards only, from the pass's own generator (a replay draws the same masks), other adapters' rows and the
base layer untouched."""

from __future__ import annotations

import torch

from workers.engine.multi_lora import LoraLinear, Route, routed


def _layer() -> LoraLinear:
    torch.manual_seed(0)
    layer = LoraLinear(torch.nn.Linear(6, 5, dtype=torch.float64))
    gen = torch.Generator().manual_seed(1)
    for name in ("drop", "plain"):
        layer.add_adapter(name, 3, scale=2.0, generator=gen)
        with torch.no_grad():
            layer.lora_B[name].normal_(generator=gen)
    return layer


def _run(layer: LoraLinear, x: torch.Tensor, p: float, seed: int, grad: bool = True) -> torch.Tensor:
    routes = [Route("drop", 0, 2), Route("plain", 2, 4)]
    dropout = {"drop": (p, torch.Generator().manual_seed(seed))}
    with torch.set_grad_enabled(grad), routed({}, routes, dropout=dropout):
        return layer(x)


def test_dropout_equals_peft_formula_on_its_rows_only() -> None:
    layer = _layer()
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    y = _run(layer, x, 0.3, seed=7)
    keep = torch.empty(2, 3, 6, dtype=torch.float64).bernoulli_(0.7, generator=torch.Generator().manual_seed(7))
    a, b = layer.lora_A["drop"], layer.lora_B["drop"]
    expect = layer.base(x[:2]) + ((x[:2] * keep / 0.7) @ a.t() * 2.0) @ b.t()
    torch.testing.assert_close(y[:2], expect, rtol=1e-12, atol=1e-12)
    with torch.no_grad(), routed({}, [Route("plain", 2, 4)]):
        plain = layer(x)[2:]
    torch.testing.assert_close(y[2:], plain, rtol=1e-12, atol=1e-12)


def test_same_generator_same_masks_and_no_dropout_without_grad() -> None:
    layer = _layer()
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    torch.testing.assert_close(_run(layer, x, 0.5, seed=3), _run(layer, x, 0.5, seed=3), rtol=0, atol=0)
    assert not torch.equal(_run(layer, x, 0.5, seed=3), _run(layer, x, 0.5, seed=4))
    with torch.no_grad(), routed({}, [Route("drop", 0, 2), Route("plain", 2, 4)]):
        undropped = layer(x)
    torch.testing.assert_close(_run(layer, x, 0.5, seed=3, grad=False), undropped, rtol=0, atol=0)
    torch.testing.assert_close(_run(layer, x, 0.0, seed=3), undropped, rtol=1e-12, atol=1e-12)
