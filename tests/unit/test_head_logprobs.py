"""The chunked head (workers/engine/head_logprobs.py) gives the log-probs and gradients of log_softmax + gather over
full logits: the Function alone, and a whole routed pass of the tiny model (two adapters, one training the head,
base rows, padding, dropout), in float64 to 1e-9."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.tiny_model import build_tiny_model
from workers.engine import head_logprobs
from workers.engine.base_model import BaseModel
from workers.engine.head_logprobs import _TargetLogprobs, plain_head, target_logprobs
from workers.engine.multi_lora import Route, routed


def _reference(hidden, weight, low, up, targets):  # type: ignore[no-untyped-def]
    logits = hidden @ weight.t() + (0 if low is None else low @ up.t())
    return torch.log_softmax(logits, dim=-1).gather(1, targets)


@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep"])
@pytest.mark.parametrize("with_lora", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_function_matches_log_softmax(with_lora: bool, chunk: int, keep: bool) -> None:
    g = torch.Generator().manual_seed(0)
    n, h, v, r, k = 11, 8, 50, 3, 2

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)

    hidden, weight = rand(n, h), rand(v, h)
    low, up = (rand(n, r), rand(v, r)) if with_lora else (None, None)
    targets = torch.randint(0, v, (n, k), generator=g)
    upstream = torch.randn(n, k, generator=g, dtype=torch.float64)
    upstream[[1, 4, 5]] = 0  # positions without weight (prompt tokens): skipped by backward, their gradient zero
    inputs = [t for t in (hidden, weight, low, up) if t is not None]
    got = _TargetLogprobs.apply(hidden, weight, low, up, targets, chunk, keep)
    want = _reference(hidden, weight, low, up, targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    got_grads = torch.autograd.grad((got * upstream).sum(), inputs)
    want_grads = torch.autograd.grad((want * upstream).sum(), inputs)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> BaseModel:
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    base = BaseModel("tiny", Path(folder), dtype="float64")
    g = torch.Generator().manual_seed(1)
    for i, (name, layer) in enumerate(sorted(base.layers.items())):
        for adapter in ("a", "b"):
            if adapter == "b" and name == "lm_head":
                continue  # "b" leaves the head alone, "a" trains it
            layer.add_adapter(adapter, 4, 2.0, g)
            layer.lora_B[adapter] = (torch.randn(layer.lora_B[adapter].shape, generator=g, dtype=torch.float64)
                                     * 0.1).requires_grad_(True)
    return base


def _pass(base: BaseModel, chunked: bool, monkeypatch: pytest.MonkeyPatch,
          keep_floats: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    monkeypatch.setattr(head_logprobs, "PLAIN_HEAD_TYPES", head_logprobs.PLAIN_HEAD_TYPES if chunked else frozenset())
    monkeypatch.setattr(head_logprobs, "KEEP_FLOATS", keep_floats)
    monkeypatch.setattr(head_logprobs, "KEEP_MIN_HIDDEN", 0)  # the tiny model's hidden size is 64
    monkeypatch.setattr(head_logprobs, "CHUNK_FLOATS", 2 * base.vocab_size + 1)  # chunks of 2 positions
    monkeypatch.setattr(head_logprobs, "FULL_FLOATS", 0)  # the tiny pass would compute its logits whole
    lengths = [7, 3, 5, 7, 2, 6]
    g = torch.Generator().manual_seed(2)
    ids = torch.zeros(len(lengths), 7, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, base.vocab_size, (n,), generator=g)
        mask[i, :n] = 1
    targets = torch.randint(0, base.vocab_size, (len(lengths), 7, 2), generator=g)
    routes = [Route("a", 0, 2), Route(None, 2, 3), Route("b", 3, 5), Route("a", 5, 6)]
    dropout = {m: (0.3, torch.Generator().manual_seed(7 + i)) for i, m in enumerate("ab")}
    with routed(base.layers, routes, dropout=dropout):
        out = target_logprobs(base.model, ids, mask, targets)
    params = [t for layer in base.layers.values() for d in (layer.lora_A, layer.lora_B) for t in d.values()]
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * upstream).sum(), params, allow_unused=True)
    return out, [torch.zeros_like(p) if gr is None else gr for gr, p in zip(grads, params)]


@pytest.mark.parametrize("keep_segments", [0, 2, 99], ids=["recompute", "some-kept", "all-kept"])
def test_routed_pass_matches_full_logits(base: BaseModel, monkeypatch: pytest.MonkeyPatch, keep_segments: int) -> None:
    assert plain_head(base.model)
    got, got_grads = _pass(base, True, monkeypatch, keep_floats=keep_segments * 10 * base.vocab_size)
    want, want_grads = _pass(base, False, monkeypatch)
    assert got.shape == (7 + 3 + 5 + 7 + 2 + 6, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    assert any(g.abs().sum() > 0 for g in got_grads)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


def test_trained_head_weight_gets_its_gradient(base: BaseModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full-parameter run trains the head's weight itself: its gradient equals autograd's over full logits."""
    monkeypatch.setattr(head_logprobs, "FULL_FLOATS", 0)
    weight = base.model.lm_head.base.weight
    ids = torch.tensor([[5, 9, 11, 4]])
    mask = torch.ones_like(ids)
    targets = torch.tensor([[[9], [11], [4], [6]]])
    weight.requires_grad_(True)
    try:
        got = torch.autograd.grad(target_logprobs(base.model, ids, mask, targets).sum(), weight)[0]
        logits = base.model(input_ids=ids, attention_mask=mask).logits
        want = torch.autograd.grad(torch.log_softmax(logits, -1).gather(-1, targets).sum(), weight)[0]
    finally:
        weight.requires_grad_(False)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


@pytest.mark.parametrize("full_floats, chunked", [(0, True), (4 * 384, True), (5 * 384, False)])
def test_only_a_pass_with_many_logits_is_chunked(base: BaseModel, monkeypatch: pytest.MonkeyPatch,
                                                 full_floats: int, chunked: bool) -> None:
    """A pass of at most FULL_FLOATS logits floats (rows x width x vocab) computes them whole: the same log-probs."""
    assert base.vocab_size == 384
    monkeypatch.setattr(head_logprobs, "FULL_FLOATS", full_floats)
    calls = []
    apply = head_logprobs._TargetLogprobs.apply
    monkeypatch.setattr(head_logprobs._TargetLogprobs, "apply", lambda *a: calls.append(1) or apply(*a))
    ids = torch.tensor([[5, 9, 11, 4, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    targets = torch.tensor([[[9], [11], [4], [6], [0]]])
    with torch.no_grad():
        got = target_logprobs(base.model, ids, mask, targets)
        want = torch.log_softmax(base.model(input_ids=ids, attention_mask=mask).logits, -1).gather(-1, targets)
    assert bool(calls) is chunked
    torch.testing.assert_close(got, want[mask.bool()], rtol=0, atol=1e-9)
