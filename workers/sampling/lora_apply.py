"""How the torch sampler applies its adapters: forward hooks on the shared LoraLinear layers.

The sampler's adapters never enter the trainer's LoraLinear dicts. Each layer gets one forward hook that, only on
the sampler's own engine thread and only while a *plan* is set, adds every row's LoRA delta to the layer's output in
place. Other threads (the trainer's) see the hook return at once. Weights are stored pre-transposed per layer and slot.

Two ways to add the deltas; each row only ever meets its own adapter's weights:
- grouped (several adapters in the batch): the layer's adapters are stacked, A (n, r, in) and B^T (n, r, out),
  ranks zero-padded to the largest; the rows are laid out as (n adapters, g rows each), a group shorter than g padded
  with rows whose scale is 0, so the whole layer costs two batched matmuls (`torch.bmm`) whatever the number of
  adapters: `h = x_grouped @ A^T`, `h *= scale per row`, `y[rows] += h @ B^T`. Padding adds exact zeros. A small
  decode step is bound by per-op overhead, not arithmetic, so this is what keeps many adapters per batch nearly as
  cheap as one. The stacks are cached per layer for the current set of adapters (one extra copy of their weights,
  rebuilt when the set changes); the row layout is built once per plan and shared by the layers with the same set.
- per range (one adapter, or a prefill whose groups are so uneven that padding would more than double the LoRA
  arithmetic): `y[rows] += (x[rows] @ A^T) @ B^T * scale`, one addmm per row range.
Rows of the base model, and rows whose adapter does not target a layer, get nothing in that layer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from workers.engine.multi_lora import LoraLinear, pad_rows


@dataclass(frozen=True)
class Segment:
    slot: str | None  # None: base model rows
    start: int
    stop: int


def segments_for(slots: list[str | None]) -> list[Segment]:
    """Contiguous row ranges per slot (rows of one slot should be adjacent, so the ranges are few)."""
    out: list[Segment] = []
    for i, slot in enumerate(slots):
        if out and out[-1].slot == slot:
            out[-1] = Segment(slot, out[-1].start, i + 1)
        else:
            out.append(Segment(slot, i, i + 1))
    return out


LayerWeights = dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # slot -> (A^T (in, r), B^T (r, out), scale)


@dataclass(frozen=True)
class _Groups:
    """Rows laid out as (adapters, rows per adapter): `index` (n*g,) the batch row of each place (None: the batch
    rows are already exactly this layout), `scale` (n, 1, g, 1) each place's adapter scale, 0 on padding."""

    n: int
    g: int
    index: torch.Tensor | None
    scale: torch.Tensor
    covered: int  # real rows in the layout


class SamplerLora:
    def __init__(self, layers: dict[str, LoraLinear]) -> None:
        self.layers = layers
        self.weights: dict[str, LayerWeights] = {n: {} for n in layers}
        # per layer: the slots of its last grouped pass and their stacked A^T and B^T
        self._stacks: dict[str, tuple[tuple[str, ...], torch.Tensor, torch.Tensor]] = {}
        self._local = threading.local()
        self._handles = [layer.register_forward_hook(self._hook(name)) for name, layer in layers.items()]

    def put(self, slot: str, name: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """A (rank, in) and B (out, rank) of one layer, in PEFT layout; stored transposed for the hook."""
        w = self.layers[name].base.weight
        at = a.to(device=w.device, dtype=w.dtype).t().contiguous()
        bt = b.to(device=w.device, dtype=w.dtype).t().contiguous()
        self.weights[name][slot] = (at, bt, scale)
        self._forget(slot)

    def drop(self, slot: str) -> None:
        for per_layer in self.weights.values():
            per_layer.pop(slot, None)
        self._forget(slot)

    def _forget(self, slot: str) -> None:
        for name in [n for n, (slots, _, _) in self._stacks.items() if slot in slots]:
            del self._stacks[name]

    @contextlib.contextmanager
    def plan(self, segments: list[Segment]) -> Iterator[None]:
        """Apply these row ranges' adapters to forward passes run by the calling thread inside the block."""
        active = [s for s in segments if s.slot is not None]
        self._local.segments = active or None
        self._local.groups = {}
        try:
            yield
        finally:
            self._local.segments = None
            self._local.groups = {}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stacks.clear()

    def _hook(self, name: str):  # type: ignore[no-untyped-def]
        per_layer = self.weights[name]

        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor | None:
            segments: list[Segment] | None = getattr(self._local, "segments", None)
            if segments is None:
                return None
            present = [s for s in segments if s.slot in per_layer]
            if not present:
                return y
            x = inputs[0]
            rows = y.shape[0]
            per_row = y.numel() // (rows * y.shape[-1])  # tokens per row
            slots = tuple(dict.fromkeys(s.slot for s in present))  # type: ignore[misc]
            if len(slots) > 1:
                groups = self._groups(per_layer, slots, present, y)
                if per_row == 1 or groups.n * groups.g <= 2 * groups.covered:
                    self._grouped(name, slots, groups, x, y, per_row)
                    return y
            flat = y.view(-1, y.shape[-1])
            for s in present:
                at, bt, scale = per_layer[s.slot]  # type: ignore[index]
                xs = x[s.start : s.stop].reshape(-1, x.shape[-1])
                flat[s.start * per_row : s.stop * per_row].addmm_(xs @ at, bt, alpha=scale)
            return y

        return hook

    def _grouped(self, name: str, slots: tuple[str, ...], groups: _Groups, x: torch.Tensor, y: torch.Tensor,
                 per_row: int) -> None:
        a, b = self._stacked(name, slots)
        n, g, width, out = groups.n, groups.g, x.shape[-1], y.shape[-1]
        if groups.index is None:
            xg = x.reshape(n, g * per_row, width)
        else:
            xg = x.reshape(y.shape[0], -1).index_select(0, groups.index).view(n, g * per_row, width)
        h = torch.bmm(a, xg.transpose(1, 2))  # (n, r, g * per_row): A (r, in) streams faster than A^T here
        h.view(n, -1, g, per_row).mul_(groups.scale)
        h = h.transpose(1, 2)
        if groups.index is None:
            y.view(n, g * per_row, out).baddbmm_(h, b)
        else:  # padding places point at a real row and add exact zeros to it
            y.view(y.shape[0], -1).index_add_(0, groups.index, torch.bmm(h, b).view(n * g, per_row * out))

    def _stacked(self, name: str, slots: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's A (n, r, in) and B^T (n, r, out) of `slots`, ranks zero-padded to the largest (cached for
        the layer's last set of slots)."""
        cached = self._stacks.get(name)
        if cached is not None and cached[0] == slots:
            return cached[1], cached[2]
        per_layer = self.weights[name]
        rank = max(per_layer[s][0].shape[1] for s in slots)
        a = torch.stack([pad_rows(per_layer[s][0].t(), rank) for s in slots])
        b = torch.stack([pad_rows(per_layer[s][1], rank) for s in slots])
        self._stacks[name] = (slots, a, b)
        return a, b

    def _groups(self, per_layer: LayerWeights, slots: tuple[str, ...], present: list[Segment],
                y: torch.Tensor) -> _Groups:
        """The plan's row layout for this set of slots (and scales), built once and shared by every such layer."""
        scales = tuple(per_layer[s][2] for s in slots)
        cache: dict[tuple[tuple[str, ...], tuple[float, ...]], _Groups] = self._local.groups
        hit = cache.get((slots, scales))
        if hit is not None:
            return hit
        members: dict[str, list[int]] = {s: [] for s in slots}
        for seg in present:
            members[seg.slot].extend(range(seg.start, seg.stop))  # type: ignore[index]
        g = max(len(m) for m in members.values())
        index = [row for s in slots for row in members[s] + [members[s][0]] * (g - len(members[s]))]
        scale = [[sc] * len(members[s]) + [0.0] * (g - len(members[s])) for s, sc in zip(slots, scales)]
        hit = cache[(slots, scales)] = _Groups(
            n=len(slots), g=g,
            index=None if index == list(range(y.shape[0])) else torch.tensor(index, device=y.device),
            scale=torch.tensor(scale, dtype=y.dtype).view(len(slots), 1, g, 1).to(y.device),
            covered=sum(len(m) for m in members.values()))
        return hit
