"""The rows a torch sampler decodes together: one KV cache, left-padded to a common length, and per-row routing.

Requests that arrive together are prefilled together, right-padded (causal attention never lets a real position see
the padding after it, so each prompt's logits are a training forward's); each prompt's cache is cut out, repeated for
its samples, then merged into the running batch by left-padding the shorter cache; each decode step feeds one token
per row with explicit position ids and the padding masked out. Rows are kept grouped by
adapter so each adapter serves one contiguous row range (the sampler's routing, multi_lora.py) in the shared
forward pass.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache

from workers.engine.multi_lora import FrozenAdapters, Route, routes_for


def _kv(cache: DynamicCache) -> list[Any]:
    """The cache's per-layer entries (full-attention DynamicLayers: `.keys` / `.values` of shape (B, H, L, D))."""
    return list(cache.layers)


def _cache_kwarg(model: torch.nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class KVBatch:
    def __init__(self, model: torch.nn.Module, lora: FrozenAdapters) -> None:
        self.model = model
        self.lora = lora
        self._cache_kw = _cache_kwarg(model)
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # (B, L) long, 0 on left padding
        self.lengths: list[int] = []  # real tokens per row in the cache
        self.slots: list[str | None] = []

    @staticmethod
    def slot_key(slot: str | None) -> tuple[bool, str]:
        """Row order in a batch: base-model rows first, then grouped by adapter slot."""
        return (slot is not None, slot or "")

    @property
    def rows(self) -> int:
        return len(self.slots)

    def _forward(self, **kwargs: Any) -> torch.Tensor:
        cache = kwargs.pop("cache")
        out = self.model(**kwargs, **{self._cache_kw: cache}, use_cache=True)
        return out.logits

    def prefill(self, prompt: list[int], slot: str | None, all_logits: bool) -> tuple[DynamicCache, torch.Tensor]:
        """Run one prompt; returns its cache and the logits (T, V) if all_logits, else (1, V) of the last position."""
        device = next(self.model.parameters()).device
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        cache = DynamicCache()
        with self.lora.plan([Route(slot, 0, 1)]):
            logits = self._forward(input_ids=ids, cache=cache, logits_to_keep=0 if all_logits else 1)
        return cache, logits[0]

    def prefill_many(self, prompts: list[list[int]], slots: list[str | None],
                     all_logits: bool) -> list[tuple[DynamicCache, torch.Tensor]]:
        """Prefill several prompts in one forward pass; per prompt, its own cache and logits (len(prompt), V)
        (one prompt alone: only the last position's unless all_logits)."""
        if len(prompts) == 1:
            return [self.prefill(prompts[0], slots[0], all_logits)]
        device = next(self.model.parameters()).device
        order = sorted(range(len(prompts)), key=lambda i: self.slot_key(slots[i]))
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, i in enumerate(order):
            ids[row, : len(prompts[i])] = torch.tensor(prompts[i])
            mask[row, : len(prompts[i])] = 1
        cache = DynamicCache()
        with self.lora.plan(routes_for([slots[i] for i in order])):
            logits = self._forward(input_ids=ids.to(device), attention_mask=mask.to(device), cache=cache,
                                   logits_to_keep=0)
        out: list[tuple[DynamicCache, torch.Tensor]] = [None] * len(prompts)  # type: ignore[list-item]
        for row, i in enumerate(order):
            n = len(prompts[i])
            own = DynamicCache()
            for index, layer in enumerate(_kv(cache)):
                own.update(layer.keys[row : row + 1, :, :n].clone(), layer.values[row : row + 1, :, :n].clone(), index)
            out[i] = (own, logits[row, :n])
        return out

    def merge(self, cache: DynamicCache, length: int, slots: list[str | None]) -> None:
        """Add rows whose cache (len(slots) rows, `length` tokens each) came from `prefill` (+ repetition)."""
        n = len(slots)
        device = _kv(cache)[0].keys.device
        if self.cache is None or self.mask is None:
            self.cache, self.mask = cache, torch.ones(n, length, dtype=torch.long, device=device)
            self.lengths, self.slots = [length] * n, list(slots)
        else:
            width = max(self.mask.shape[1], length)
            _pad_left(self.cache, width - self.mask.shape[1])
            _pad_left(cache, width - length)
            for mine, theirs in zip(_kv(self.cache), _kv(cache)):
                mine.keys = torch.cat([mine.keys, theirs.keys])
                mine.values = torch.cat([mine.values, theirs.values])
            new_mask = torch.zeros(n, width, dtype=torch.long, device=device)
            new_mask[:, width - length :] = 1
            old = torch.nn.functional.pad(self.mask, (width - self.mask.shape[1], 0))
            self.mask = torch.cat([old, new_mask])
            self.lengths += [length] * n
            self.slots += list(slots)
        order = sorted(range(self.rows), key=lambda i: self.slot_key(self.slots[i]))
        if order != list(range(self.rows)):
            self.select(order)

    def select(self, keep: list[int]) -> None:
        """Keep (and reorder to) these rows; trims left padding no row needs any more."""
        if not keep:
            self.cache, self.mask, self.lengths, self.slots = None, None, [], []
            return
        assert self.cache is not None and self.mask is not None
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask.index_select(0, index)
        self.lengths = [self.lengths[i] for i in keep]
        self.slots = [self.slots[i] for i in keep]
        trim = self.mask.shape[1] - max(self.lengths)
        if trim > 0:
            self.mask = self.mask[:, trim:]
            for layer in _kv(self.cache):
                layer.keys, layer.values = layer.keys[:, :, trim:], layer.values[:, :, trim:]

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """Feed one token per row (in row order); returns the next-token logits (B, V)."""
        assert self.cache is not None and self.mask is not None
        device = self.mask.device
        ids = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
        positions = torch.tensor(self.lengths, dtype=torch.long, device=device)[:, None]
        self.mask = torch.cat([self.mask, torch.ones(self.rows, 1, dtype=torch.long, device=device)], dim=1)
        with self.lora.plan(routes_for(self.slots)):
            logits = self._forward(input_ids=ids, attention_mask=self.mask, position_ids=positions, cache=self.cache,
                                   logits_to_keep=1)
        self.lengths = [n + 1 for n in self.lengths]
        return logits[:, -1]


def _pad_left(cache: DynamicCache, n: int) -> None:
    if n <= 0:
        return
    for layer in _kv(cache):
        shape = (*layer.keys.shape[:2], n, layer.keys.shape[-1])
        layer.keys = torch.cat([layer.keys.new_zeros(shape), layer.keys], dim=2)
        vshape = (*layer.values.shape[:2], n, layer.values.shape[-1])
        layer.values = torch.cat([layer.values.new_zeros(vshape), layer.values], dim=2)
