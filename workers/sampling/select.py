"""Choosing the next token of many rows at once, and deciding when a row stops.

Every row brings its own temperature, top-k, top-p and one uniform draw from its own generator, so a seeded
request samples the same tokens whatever else shares its batch. Token choice is inverse-CDF sampling over the
filtered distribution (top-k first, then top-p on what top-k kept, as vLLM does); temperature 0 is argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


def choose_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """logits (B, V) float; per-row temperature (<= 0: greedy), top_k (<= 0: off), top_p, uniforms in [0, 1)."""
    greedy_tokens = logits.argmax(-1)
    greedy = temperature <= 0
    if bool(greedy.all()):
        return greedy_tokens
    vocab = logits.shape[-1]
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    k_on = (top_k > 0) & (top_k < vocab)
    filtering = bool((k_on | (top_p < 1.0)).any())
    if filtering:
        scaled, order = scaled.sort(-1, descending=True)
    probs = torch.softmax(scaled, dim=-1)
    if filtering:
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        probs = probs * (~k_on[:, None] | (ranks < top_k[:, None]))
        probs = probs / probs.sum(-1, keepdim=True)
        before = probs.cumsum(-1) - probs  # mass strictly before each token: the top one is always kept
        probs = probs * (before < top_p[:, None])
    cdf = probs.cumsum(-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    tokens = order.gather(1, picked)[:, 0] if filtering else picked[:, 0]
    return torch.where(greedy, greedy_tokens, tokens)


class Detokenizer:
    """Decodes token ids for stop-string matching (the model folder's tokenizer.json, via `tokenizers`)."""

    def __init__(self, model_folder: Path) -> None:
        self._tok = None
        path = model_folder / "tokenizer.json"
        if path.exists():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(path))

    @property
    def available(self) -> bool:
        return self._tok is not None

    def decode(self, ids: list[int]) -> str:
        if self._tok is None:
            raise ValueError("this model has no tokenizer.json; stop strings cannot be matched")
        return str(self._tok.decode(ids, skip_special_tokens=False))


@dataclass
class StopRule:
    """When one row stops: a stop token (kept in the output), a stop string (its tokens kept), or its length."""

    token_ids: frozenset[int]
    strings: tuple[str, ...]
    max_tokens: int
    _window: int = field(init=False)

    def __post_init__(self) -> None:
        # Any token decodes to at least one character (or a byte piece of one), so a stop string that ends in the
        # newest token lies within the last 2 * len + 4 tokens.
        self._window = 2 * max((len(s) for s in self.strings), default=0) + 4

    def hit(self, tokens: list[int], detok: Detokenizer) -> bool:
        """Whether the newest token ends the row with reason "stop" (earlier positions were checked before)."""
        if tokens and tokens[-1] in self.token_ids:
            return True
        if self.strings and tokens:
            tail = detok.decode(tokens[-self._window :])
            return any(s in tail for s in self.strings)
        return False
