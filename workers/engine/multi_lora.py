"""The one multi-LoRA routing module: our LoRA layer around the base model's linear layers, able to run rows of
different adapters in one pass, for the trainer's merged passes and the torch sampler's decode steps alike.

Each wrapped layer holds the trainer's adapters, one trainable (A, B, scale) per adapter id (PEFT's layout and
names, so an adapter saves and loads as a PEFT adapter folder). Before a forward pass a thread sets a *routing*
(`routed`): contiguous row ranges of the batch (`Route`) and the adapter each range goes through (None = base model
only), read from the layers' own adapters or from a `FrozenAdapters` set (the sampler's immutable weight versions,
which never enter the layers' dicts). The routing is per thread, so the trainer and the sampler run forward passes
on the shared base model from their own threads at the same time without seeing each other's routes.

Each row only ever meets its own adapter's weights; rows of the base model, and rows whose adapter does not target a
layer, get nothing in that layer. Two ways to add the LoRA term, whoever the caller:
- grouped (several adapters in the batch): the layer's adapters are stacked, A (n, r, in) and B^T (n, r, out),
  ranks zero-padded to the largest; the rows are laid out as (n adapters, g rows each), a group shorter than g padded
  with rows whose scale is 0, so the whole layer costs two batched matmuls whatever the number of adapters:
  `h = x_grouped @ A^T`, `h *= scale per row`, `y[rows] += h @ B^T`. Padding adds exact zeros. A small decode step
  is bound by per-op overhead, not arithmetic, so this keeps many adapters per batch nearly as cheap as one. The row
  layout is built once per routing and shared by the layers with the same set of adapters.
- per range (one adapter, or a prefill or training batch whose groups are so uneven that padding would more than
  double the LoRA arithmetic): `y[rows] += (x[rows] @ A^T) @ B^T * scale`, one addmm per row range.
The one real difference between the callers: the trainer's adapters change at every optimizer step and need
gradients, so their stacks are rebuilt in each forward (inside the autograd graph); a frozen set's stacks are cached
per layer for its current set of adapters (one extra copy of their weights, rebuilt when the set changes).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from api_schemas.training import ATTN_MODULES, MLP_MODULES, UNEMBED_MODULES


# one layer's adapters: id -> A (r, in), id -> B (out, r), id -> scale
LayerAdapters = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]
Stacks = dict["LoraLinear", tuple[tuple[str, ...], torch.Tensor, torch.Tensor]]
Dropout = dict[str, tuple[float, torch.Generator]]  # adapter id -> (lora_dropout p, its generator for this pass)
_NO_ADAPTERS: LayerAdapters = ({}, {}, {})  # a layer outside a frozen set (another model's)


@dataclass(frozen=True)
class Route:
    adapter_id: str | None  # None: base model rows
    start: int
    stop: int


def routes_for(adapter_ids: list[str | None]) -> list[Route]:
    """Contiguous row ranges per adapter (rows of one adapter should be adjacent, so the ranges are few)."""
    out: list[Route] = []
    for i, adapter_id in enumerate(adapter_ids):
        if out and out[-1].adapter_id == adapter_id:
            out[-1] = Route(adapter_id, out[-1].start, i + 1)
        else:
            out.append(Route(adapter_id, i, i + 1))
    return out


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

    def add_adapter(self, adapter_id: str, rank: int, scale: float, generator: torch.Generator) -> None:
        """A new adapter of `rank` whose term is scaled by `scale` (lora_scale)."""
        w = self.base.weight
        a = torch.empty(rank, self.base.in_features, dtype=w.dtype)
        # PEFT's default init: kaiming-uniform A (a=sqrt(5)), zero B, so a new adapter is the identity.
        bound = 1.0 / math.sqrt(self.base.in_features)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A[adapter_id] = a.to(w.device).requires_grad_(True)
        self.lora_B[adapter_id] = torch.zeros(self.base.out_features, rank, dtype=w.dtype, device=w.device).requires_grad_(True)
        self.scale[adapter_id] = scale

    def remove_adapter(self, adapter_id: str) -> None:
        for d in (self.lora_A, self.lora_B, self.scale):
            d.pop(adapter_id, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # a fresh tensor nothing saves for backward: the LoRA term is added in place
        routing: _Routing | None = getattr(_local, "routing", None)
        return y if routing is None else routing.add_term(self, x, y)


class FrozenAdapters:
    """Adapters held outside the layers' own dicts, immutable once put (the torch sampler's weight versions): routed
    like the layers' own, under no_grad, with their stacked weights cached."""

    def __init__(self, layers: dict[str, LoraLinear]) -> None:
        self.layers = layers
        self.weights: dict[LoraLinear, LayerAdapters] = {layer: ({}, {}, {}) for layer in layers.values()}
        self.stacks: Stacks = {}  # per layer: the adapters of its last grouped pass and their stacks

    def put(self, adapter_id: str, name: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """A (rank, in) and B (out, rank) of one layer, in PEFT layout."""
        layer = self.layers[name]
        w = layer.base.weight
        a_per_layer, b_per_layer, scales = self.weights[layer]
        # kept transposed in memory: the per-range matmuls then read A^T and B^T contiguously
        a_per_layer[adapter_id] = a.to(device=w.device, dtype=w.dtype).t().contiguous().t()
        b_per_layer[adapter_id] = b.to(device=w.device, dtype=w.dtype).t().contiguous().t()
        scales[adapter_id] = scale
        self._forget(adapter_id)

    def drop(self, adapter_id: str) -> None:
        for per_layer in self.weights.values():
            for d in per_layer:
                d.pop(adapter_id, None)
        self._forget(adapter_id)

    def _forget(self, adapter_id: str) -> None:
        for layer in [lay for lay, (ids, _, _) in self.stacks.items() if adapter_id in ids]:
            del self.stacks[layer]

    def plan(self, routes: list[Route]) -> contextlib.AbstractContextManager[None]:
        """Route the calling thread's forwards inside the block through these adapters."""
        return routed(self.layers, routes, self)

    def close(self) -> None:
        self.stacks.clear()


@dataclass(frozen=True)
class _Layout:
    """Rows laid out as (adapters, rows per adapter): `index` (n*g,) the batch row of each place (None: the batch
    rows are already exactly this layout), `scale` (n, 1, g, 1) each place's adapter scale, 0 on padding."""

    n: int
    g: int
    index: torch.Tensor | None
    scale: torch.Tensor
    covered: int  # real rows in the layout


@dataclass
class _Routing:
    """One thread's routing for the forwards of one `routed` block."""

    routes: tuple[Route, ...]  # of an adapter only
    frozen: FrozenAdapters | None  # None: the layers' own (trainable) adapters
    dropout: Dropout = field(default_factory=dict)
    layouts: dict[tuple, _Layout] = field(default_factory=dict)

    def add_term(self, layer: LoraLinear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.frozen is None:
            a, b, scales = layer.lora_A, layer.lora_B, layer.scale
        else:
            a, b, scales = self.frozen.weights.get(layer, _NO_ADAPTERS)
        present = [r for r in self.routes if r.adapter_id in a]
        if not present:
            return y
        if self.dropout and torch.is_grad_enabled():
            x = self._dropped(x, present)
        # with autograd, no in-place op on a view of y: its backward would copy a y-sized gradient per op
        in_place = not torch.is_grad_enabled()
        rows, per_row = y.shape[0], y.numel() // (y.shape[0] * y.shape[-1])  # tokens per row
        whole = len(present) == 1 and present[0].start == 0 and present[0].stop >= rows
        ids = cast(tuple[str, ...], tuple(dict.fromkeys(r.adapter_id for r in present)))
        if len(ids) > 1 or not (in_place or whole):
            layout = self._layout(ids, tuple(scales[i] for i in ids), present, y)
            if not in_place or per_row == 1 or layout.n * layout.g <= 2 * layout.covered:
                stack_a, stack_b = self._stacked(layer, ids, a, b)
                return _grouped(stack_a, stack_b, layout, x, y, per_row, in_place)
        if not in_place:  # scaled at rank width, before B: for lm_head that is (rows, r), not (rows, vocab)
            return y.add_(((x @ a[ids[0]].t()) * scales[ids[0]]) @ b[ids[0]].t())
        flat = y.view(-1, y.shape[-1])
        for r in present:
            xs = x[r.start : r.stop].reshape(-1, x.shape[-1])
            aid: str = r.adapter_id  # type: ignore[assignment]
            flat[r.start * per_row : r.stop * per_row].addmm_(xs @ a[aid].t(), b[aid].t(), alpha=scales[aid])
        return y

    def low_rank(self, layer: LoraLinear, x: torch.Tensor) -> list[tuple[Route, torch.Tensor, torch.Tensor]]:
        """The layer's LoRA term left unexpanded, per routed range that has one: (range, dropout(x[rows]) @ A^T *
        scale, B), so a caller can add `low @ B^T` itself (the chunked head, workers/engine/head_logprobs.py)."""
        a, b, scales = (layer.lora_A, layer.lora_B, layer.scale) if self.frozen is None else \
            self.frozen.weights.get(layer, _NO_ADAPTERS)
        present = [r for r in self.routes if r.adapter_id in a]
        if self.dropout and torch.is_grad_enabled():
            x = self._dropped(x, present)
        terms = []
        for r in present:
            aid = cast(str, r.adapter_id)
            terms.append((r, (x[r.start : r.stop] @ a[aid].t()) * scales[aid], b[aid]))
        return terms

    def _dropped(self, x: torch.Tensor, present: list[Route]) -> torch.Tensor:
        """`x` with the rows of dropout adapters dropped out (kept ones scaled by 1 / (1 - p)); the base layer has
        already read the original."""
        out = None
        for r in present:
            p_gen = self.dropout.get(r.adapter_id)  # type: ignore[arg-type]
            if p_gen is None or p_gen[0] <= 0:
                continue
            p, gen = p_gen
            rows = x[r.start : r.stop]
            keep = torch.empty(rows.shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p, generator=gen)
            out = x.clone() if out is None else out
            out[r.start : r.stop] = rows * keep / (1 - p)
        return x if out is None else out

    def _stacked(self, layer: LoraLinear, ids: tuple[str, ...], a: dict[str, torch.Tensor],
                 b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's A (n, r, in) and B^T (n, r, out) of `ids`, ranks zero-padded to the largest."""
        cache = None if self.frozen is None else self.frozen.stacks
        cached = None if cache is None else cache.get(layer)
        if cached is not None and cached[0] == ids:
            return cached[1], cached[2]
        rank = max(a[i].shape[0] for i in ids)
        stack_a = torch.stack([pad_rows(a[i], rank) for i in ids])
        stack_b = torch.stack([pad_rows(b[i].t(), rank) for i in ids])
        if cache is not None:
            cache[layer] = (ids, stack_a, stack_b)
        return stack_a, stack_b

    def _layout(self, ids: tuple[str, ...], scales: tuple[float, ...], present: list[Route],
                y: torch.Tensor) -> _Layout:
        """The routing's row layout for this set of adapters (and scales), built once and shared by every such layer."""
        rows = y.shape[0]
        key = (ids, scales, rows, y.dtype)
        hit = self.layouts.get(key)
        if hit is not None:
            return hit
        members: dict[str, list[int]] = {i: [] for i in ids}
        for r in present:
            members[r.adapter_id].extend(range(r.start, min(r.stop, rows)))  # type: ignore[index]
        g = max(len(m) for m in members.values())
        index = [row for i in ids for row in members[i] + [members[i][0]] * (g - len(members[i]))]
        scale = [[sc] * len(members[i]) + [0.0] * (g - len(members[i])) for i, sc in zip(ids, scales)]
        hit = self.layouts[key] = _Layout(
            n=len(ids), g=g,
            index=None if index == list(range(rows)) else torch.tensor(index, device=y.device),
            scale=torch.tensor(scale, dtype=y.dtype).view(len(ids), 1, g, 1).to(y.device),
            covered=sum(len(m) for m in members.values()))
        return hit


def _grouped(a: torch.Tensor, b: torch.Tensor, layout: _Layout, x: torch.Tensor, y: torch.Tensor, per_row: int,
             in_place: bool) -> torch.Tensor:
    """y + every row's LoRA term, in two batched matmuls over the (adapters, rows per adapter) layout."""
    n, g, width, out = layout.n, layout.g, x.shape[-1], y.shape[-1]
    if layout.index is None:
        xg = x.reshape(n, g * per_row, width)
    else:
        xg = x.reshape(y.shape[0], -1).index_select(0, layout.index).view(n, g * per_row, width)
    if in_place:  # (n, r, g * per_row): A (r, in) streams faster than A^T here
        h = torch.bmm(a, xg.transpose(1, 2))
        h.view(n, -1, g, per_row).mul_(layout.scale)
        h = h.transpose(1, 2)
    else:  # the training orientation: x @ A^T, scaled out of place
        h = torch.bmm(xg, a.transpose(1, 2)).view(n, g, per_row, -1) * layout.scale.view(n, g, 1, 1)
        h = h.view(n, g * per_row, -1)
    if layout.index is None:
        if not in_place:
            return y.add_(torch.bmm(h, b).view_as(y))
        y.view(n, g * per_row, out).baddbmm_(h, b)
        return y
    # padding places point at a real row and add exact zeros to it
    delta = torch.bmm(h, b).view(n * g, per_row * out)
    if not in_place:
        return y.add_(delta.new_zeros(y.shape[0], per_row * out).index_add_(0, layout.index, delta).view_as(y))
    y.view(y.shape[0], -1).index_add_(0, layout.index, delta)
    return y


_local = threading.local()


def head_terms(layer: LoraLinear, x: torch.Tensor) -> list[tuple[Route, torch.Tensor, torch.Tensor]]:
    """The calling thread's routed LoRA terms of `layer` on input `x`, unexpanded (see _Routing.low_rank)."""
    routing: _Routing | None = getattr(_local, "routing", None)
    return [] if routing is None else routing.low_rank(layer, x)


def pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t` with zero rows appended up to `n` rows (a lower rank's A, or B^T, stacked beside a higher rank's)."""
    return t if t.shape[0] == n else torch.nn.functional.pad(t, (0, 0, 0, n - t.shape[0]))


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """PEFT's scaling of the adapter term: alpha / rank, or alpha / sqrt(rank) for rsLoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


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
def routed(layers: dict[str, LoraLinear], routes: list[Route], frozen: FrozenAdapters | None = None,
           dropout: Dropout | None = None) -> Iterator[None]:
    """Set the calling thread's row routing for the duration of one forward (and its backward graph build), through
    the layers' own adapters or, given `frozen`, through that set's. `dropout`: adapter id -> (p, generator) for the
    adapters whose LoRA input is dropped out in this (training) forward, as PEFT's lora_dropout.

    `layers` names the model being routed; the routing itself is thread-local, so concurrent forwards on other
    threads (the sampler's, the trainer's) keep their own."""
    del layers  # every LoraLinear reads the thread's routing; kept in the signature for the callers' clarity
    previous = getattr(_local, "routing", None)
    active = tuple(r for r in routes if r.adapter_id is not None)
    _local.routing = _Routing(active, frozen, dropout or {}) if active else None
    try:
        yield
    finally:
        _local.routing = previous
