"""How the torch sampler applies its adapters: forward hooks on the shared LoraLinear layers.

The sampler's adapters never enter the trainer's LoraLinear dicts. Each layer gets one forward hook that, only on
the sampler's own engine thread and only while a *plan* is set, adds every row range's LoRA delta to the layer's
output in place (`y[rows] += (x[rows] @ A^T) @ B^T * scale`, one addmm per range). Other threads (the trainer's)
see the hook return at once. Weights are stored pre-transposed per layer and slot, so a decode step costs two
small matmuls per (layer, adapter present in the batch) and no copies.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from workers.engine.multi_lora import LoraLinear


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


class SamplerLora:
    def __init__(self, layers: dict[str, LoraLinear]) -> None:
        self.layers = layers
        self.weights: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = {n: {} for n in layers}
        self._local = threading.local()
        self._handles = [layer.register_forward_hook(self._hook(name)) for name, layer in layers.items()]

    def put(self, slot: str, name: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """A (rank, in) and B (out, rank) of one layer, in PEFT layout; stored transposed for the hook."""
        w = self.layers[name].base.weight
        at = a.to(device=w.device, dtype=w.dtype).t().contiguous()
        bt = b.to(device=w.device, dtype=w.dtype).t().contiguous()
        self.weights[name][slot] = (at, bt, scale)

    def drop(self, slot: str) -> None:
        for per_layer in self.weights.values():
            per_layer.pop(slot, None)

    @contextlib.contextmanager
    def plan(self, segments: list[Segment]) -> Iterator[None]:
        """Apply these row ranges' adapters to forward passes run by the calling thread inside the block."""
        active = [s for s in segments if s.slot is not None]
        self._local.segments = active or None
        try:
            yield
        finally:
            self._local.segments = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, name: str):  # type: ignore[no-untyped-def]
        per_layer = self.weights[name]

        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor | None:
            segments: list[Segment] | None = getattr(self._local, "segments", None)
            if segments is None:
                return None
            x = inputs[0]
            flat = y.view(-1, y.shape[-1])
            per_row = flat.shape[0] // y.shape[0]
            for s in segments:
                w = per_layer.get(s.slot)  # type: ignore[arg-type]
                if w is not None:
                    at, bt, scale = w
                    xs = x[s.start : s.stop].reshape(-1, x.shape[-1])
                    flat[s.start * per_row : s.stop * per_row].addmm_(xs @ at, bt, alpha=scale)
            return y

        return hook
