"""Our own LoRA layer around the base model's linear layers, able to run rows of different adapters in one pass.

Each wrapped layer holds one (A, B, scale) per adapter id. Before a forward pass the engine sets a *routing*:
a list of contiguous row ranges of the batch and the adapter each range goes through (None = base model only).
The routing is per thread, so the trainer and the sampler may run forward passes on the shared base model from
their own threads at the same time without seeing each other's routes.
Weights keep PEFT's layout and names, so an adapter saves and loads as a PEFT adapter folder.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


@dataclass(frozen=True)
class Route:
    adapter_id: str | None
    start: int
    stop: int


_routing = threading.local()


def current_routes() -> tuple[Route, ...]:
    """The routing the calling thread set with `routed` (empty: base model only)."""
    routes: tuple[Route, ...] = getattr(_routing, "routes", ())
    return routes


class LoraLinear(nn.Module):
    """A frozen nn.Linear plus any number of named low-rank adapters, selected per row range."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.lora_A: dict[str, torch.Tensor] = {}
        self.lora_B: dict[str, torch.Tensor] = {}
        self.scale: dict[str, float] = {}

    @property
    def weight(self) -> torch.Tensor:  # some HF code reads lm_head.weight (e.g. for tied embeddings)
        return self.base.weight

    def add_adapter(self, adapter_id: str, rank: int, alpha: float, generator: torch.Generator) -> None:
        w = self.base.weight
        a = torch.empty(rank, self.base.in_features, dtype=w.dtype)
        # PEFT's default init: kaiming-uniform A (a=sqrt(5)), zero B, so a new adapter is the identity.
        bound = 1.0 / math.sqrt(self.base.in_features)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A[adapter_id] = a.to(w.device).requires_grad_(True)
        self.lora_B[adapter_id] = torch.zeros(self.base.out_features, rank, dtype=w.dtype, device=w.device).requires_grad_(True)
        self.scale[adapter_id] = alpha / rank

    def remove_adapter(self, adapter_id: str) -> None:
        for d in (self.lora_A, self.lora_B, self.scale):
            d.pop(adapter_id, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # a fresh tensor nothing saves for backward: the LoRA term is added in place
        routes = current_routes()
        if not any(r.adapter_id is not None and r.adapter_id in self.lora_A for r in routes):
            return y
        if len(routes) == 1 and routes[0].start == 0 and routes[0].stop >= x.shape[0]:
            aid = routes[0].adapter_id
            # scaled at rank width, before B: for lm_head that is (rows, r), not (rows, vocab)
            return y.add_(((x @ self.lora_A[aid].t()) * self.scale[aid]) @ self.lora_B[aid].t())
        return y.add_(self._routed_delta(x, routes))

    def _routed_delta(self, x: torch.Tensor, routes: tuple[Route, ...]) -> torch.Tensor:
        """The LoRA term of every row through its route's adapter, in two batched matmuls whatever the number of
        routes: the adapters' A and B are stacked (zero-padded to the largest rank where ranks differ: padding adds
        exact zeros) and gathered per row, and each row's scale multiplies its rank-width term. Rows of no route, of
        no adapter or of an adapter that does not target this layer get zero. The per-row index and scale are
        computed once per routing and shared by every layer (no host sync per layer)."""
        adapters, index = _row_index(routes, x.shape[0], x.device)
        present = [a for a in adapters if a in self.lora_A]
        rank = max(self.lora_A[a].shape[0] for a in present)
        w = self.base.weight
        zeros_a = torch.zeros(rank, self.base.in_features, dtype=w.dtype, device=w.device)
        zeros_b = torch.zeros(self.base.out_features, rank, dtype=w.dtype, device=w.device)
        stack_a = torch.stack([zeros_a] + [
            pad_rows(self.lora_A[a], rank) if a in self.lora_A else zeros_a for a in adapters])
        stack_b = torch.stack([zeros_b] + [
            pad_cols(self.lora_B[a], rank) if a in self.lora_A else zeros_b for a in adapters])
        scale = _row_scale(adapters, index, self.scale, w.dtype)
        rows = x if x.dim() == 3 else x.unsqueeze(1)
        h = torch.bmm(rows, stack_a.index_select(0, index).transpose(1, 2)) * scale
        delta = torch.bmm(h, stack_b.index_select(0, index).transpose(1, 2))
        return delta if x.dim() == 3 else delta.squeeze(1)


def _row_scale(adapters: list[str], index: torch.Tensor, scales: dict[str, float], dtype: torch.dtype) -> torch.Tensor:
    """(rows, 1, 1): each row's adapter scale (0 for rows of no adapter), cached per routing, dtype and scales."""
    cache: dict[tuple, torch.Tensor] = getattr(_routing, "scale", {})
    values = tuple(scales.get(a, 0.0) for a in adapters)
    key = (index.shape[0], index.device, dtype, values)
    hit = cache.get(key)
    if hit is None:
        table = torch.tensor((0.0, *values), dtype=dtype, device=index.device)
        hit = cache[key] = table.index_select(0, index).view(-1, 1, 1)
    return hit


def _row_index(routes: tuple[Route, ...], n_rows: int, device: torch.device) -> tuple[list[str], torch.Tensor]:
    """The distinct adapters of the routing and, per row, 1 + the position of its adapter among them (0: none)."""
    cache: dict[tuple[int, torch.device], tuple[list[str], torch.Tensor]] = getattr(_routing, "index", {})
    hit = cache.get((n_rows, device))
    if hit is not None:
        return hit
    adapters = list(dict.fromkeys(r.adapter_id for r in routes if r.adapter_id is not None))
    slot = {a: i + 1 for i, a in enumerate(adapters)}
    per_row = [0] * n_rows
    for r in routes:
        if r.adapter_id is not None and r.start < n_rows:
            per_row[r.start : min(r.stop, n_rows)] = [slot[r.adapter_id]] * (min(r.stop, n_rows) - r.start)
    hit = cache[(n_rows, device)] = (adapters, torch.tensor(per_row, device=device))
    return hit


def pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t` with zero rows appended up to `n` rows (a lower rank's A, or B^T, stacked beside a higher rank's)."""
    return t if t.shape[0] == n else torch.nn.functional.pad(t, (0, 0, 0, n - t.shape[0]))


def pad_cols(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if t.shape[1] == n else torch.nn.functional.pad(t, (0, n - t.shape[1]))


def target_module_names(train_attn: bool, train_mlp: bool, train_unembed: bool) -> list[str]:
    names: list[str] = []
    if train_attn:
        names += ATTN_MODULES
    if train_mlp:
        names += MLP_MODULES
    if train_unembed:
        names += UNEMBED_MODULES
    return names


def wrap_linear_layers(model: nn.Module) -> dict[str, LoraLinear]:
    """Replace every targetable nn.Linear by a LoraLinear (once); returns {qualified name: layer}."""
    suffixes = set(ATTN_MODULES + MLP_MODULES + UNEMBED_MODULES)
    found: dict[str, LoraLinear] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in suffixes and isinstance(child, nn.Linear):
                wrapped = LoraLinear(child)
                setattr(module, child_name, wrapped)
                found[f"{name}.{child_name}" if name else child_name] = wrapped
    return found


@contextlib.contextmanager
def routed(layers: dict[str, LoraLinear], routes: list[Route]) -> Iterator[None]:
    """Set the calling thread's row routing for the duration of one forward (and its backward graph build).

    `layers` names the model being routed; the routing itself is thread-local, so concurrent forwards on other
    threads (the sampler's, the trainer's) keep their own."""
    del layers  # every LoraLinear reads the thread's routing; kept in the signature for the callers' clarity
    previous = current_routes(), getattr(_routing, "index", {}), getattr(_routing, "scale", {})
    _routing.routes, _routing.index, _routing.scale = tuple(routes), {}, {}
    try:
        yield
    finally:
        _routing.routes, _routing.index, _routing.scale = previous
