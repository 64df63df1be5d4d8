"""Token choice for many rows at once: greedy, top-k, top-p, and the per-row uniform draw (table-driven)."""

from __future__ import annotations

import pytest
import torch

from workers.sampling.select import choose_tokens

LOGITS = torch.log(torch.tensor([0.1, 0.4, 0.3, 0.2]))  # token 1 is the most likely, then 2, 3, 0


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "u", "expected"),
    [
        (0.0, -1, 1.0, 0.99, 1),  # greedy ignores the draw
        (1.0, -1, 1.0, 0.05, 0),  # inverse CDF in vocabulary order: [0, .1) -> 0
        (1.0, -1, 1.0, 0.45, 1),  # [.1, .5) -> 1
        (1.0, -1, 1.0, 0.85, 3),  # [.8, 1) -> 3
        (1.0, 1, 1.0, 0.99, 1),  # top-1 is greedy
        (1.0, 2, 1.0, 0.99, 2),  # top-2 keeps tokens 1 and 2 only
        (1.0, -1, 0.5, 0.99, 2),  # top-p 0.5 keeps 1 (0.4) and 2 (0.3): 0.4 < 0.5
        (1.0, -1, 0.4, 0.99, 1),  # the top token is always kept
        (1.0, 3, 0.75, 0.99, 2),  # top-k first (1, 2, 3 renormalized), then top-p: 1 and 2
    ],
)
def test_choose_tokens(temperature: float, top_k: int, top_p: float, u: float, expected: int) -> None:
    tok = choose_tokens(LOGITS[None], torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]),
                        torch.tensor([u]))
    assert tok.tolist() == [expected]


def test_rows_are_independent() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    tok = choose_tokens(logits, torch.tensor([0.0, 0.0, 1.0]), torch.tensor([-1, -1, 2]), torch.tensor([1.0, 1.0, 1.0]),
                        torch.tensor([0.5, 0.5, 0.0]))
    assert tok.tolist() == [1, 2, 1]


def test_low_temperature_sharpens() -> None:
    draws = torch.linspace(0, 0.999, 200)
    rows = LOGITS[None].expand(200, -1)
    ones = torch.ones(200)
    hot = choose_tokens(rows, ones, -ones.long(), ones, draws)
    cold = choose_tokens(rows, ones * 0.05, -ones.long(), ones, draws)
    assert (cold == 1).float().mean() > 0.9 > (hot == 1).float().mean()
