"""Adapter paging: idle adapters leave the accelerator for host memory, then for disk, and come back on use.

An adapter's state is its LoRA weights, its accumulated gradients and its optimizer state. Three tiers:
- `device`: attached to the base model's LoraLinear layers, on the base model's device (trainable now);
- `host`: detached from the layers, tensors in CPU memory;
- `disk`: written to one safetensors file under `spill_dir`, tensors freed.
Moving between tiers is exact (tensors are copied, never re-computed or re-cast), so a paged adapter trains on
exactly as if it had stayed. Nothing is ever refused or deleted: when every adapter is in use the budget is
exceeded rather than a job failed, and only AdapterPool.drop removes an adapter.

Policy (least recently used first): the `device` tier holds at most `device_budget_bytes`, and each tenant at
most `tenant_resident_limit(tenant)` adapters there; the `host` tier holds at most `host_budget_bytes` (only
enforced with a `spill_dir`). Pinned adapters (those of the step being run) never move.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from workers import metrics
from workers.engine.multi_lora import lora_scale

if TYPE_CHECKING:
    from workers.engine.adapter_pool import Adapter
    from workers.engine.multi_lora import LoraLinear

log = logging.getLogger(__name__)

DEVICE, HOST, DISK = "device", "host", "disk"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class PagingConfig:
    device_budget_bytes: int | None = None  # None: unlimited
    host_budget_bytes: int | None = None  # None: unlimited; needs spill_dir to be enforced
    spill_dir: Path | None = None
    tenant_resident_limit: Callable[[str], int | None] | None = None  # adapters of one tenant on the device


def state_bytes(adapter: Adapter) -> int:
    """The adapter's state in memory: its weights, plus its gradients and optimizer buffers, each a set shaped like
    the weights and present for all of them or none; counted from the weights' (cached) size, in O(1), so paging
    decisions cost nothing per idle adapter's tensors."""
    if not adapter.params:
        return 0  # spilled to disk
    grads = 1 if adapter.grads and adapter.grads[0] is not None else 0
    return adapter.param_bytes * (1 + grads + adapter.optim.buffer_sets())


def detach_from_layers(adapter: Adapter, layers: dict[str, LoraLinear]) -> None:
    for name in adapter.modules:
        layers[name].remove_adapter(adapter.model_id)


def attach_to_layers(adapter: Adapter, layers: dict[str, LoraLinear]) -> None:
    scale = lora_scale(adapter.alpha, adapter.spec.rank, adapter.spec.rslora)
    for i, name in enumerate(adapter.modules):
        layer = layers[name]
        layer.lora_A[adapter.model_id] = adapter.params[2 * i]
        layer.lora_B[adapter.model_id] = adapter.params[2 * i + 1]
        layer.scale[adapter.model_id] = scale


def move(adapter: Adapter, device: torch.device) -> None:
    """Every tensor of the adapter to `device` (weights stay leaf tensors that require grad)."""

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device, copy=t.device != device)

    adapter.params = [to(p).requires_grad_(True) for p in adapter.params]
    adapter.grads = [None if g is None else to(g) for g in adapter.grads]
    adapter.optim.map_tensors(to)


def write_spill(adapter: Adapter, spill_dir: Path) -> Path:
    spill_dir.mkdir(parents=True, exist_ok=True)
    path = spill_dir / f"{_UNSAFE.sub('_', adapter.model_id)}-{uuid.uuid4().hex[:8]}.safetensors"
    tensors = {f"p.{i}": p.detach().cpu().contiguous() for i, p in enumerate(adapter.params)}
    tensors |= {f"g.{i}": g.detach().cpu().contiguous() for i, g in enumerate(adapter.grads) if g is not None}
    tensors |= {f"o.{k}": t.cpu().contiguous() for k, t in adapter.optim.named_tensors().items()}
    meta = {"n_params": len(adapter.params), "optim": adapter.optim.metadata()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"twinkle": json.dumps(meta)})
    os.replace(tmp, path)
    adapter.params, adapter.grads = [], []
    adapter.optim.drop_buffers()
    return path


def read_spill(adapter: Adapter, path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})["twinkle"])
    t = load_file(str(path))
    n = int(meta["n_params"])
    adapter.params = [t[f"p.{i}"] for i in range(n)]
    adapter.grads = [t.get(f"g.{i}") for i in range(n)]
    adapter.optim.load_state_dict({k[2:]: v for k, v in t.items() if k.startswith("o.")}, meta["optim"], clone=False)
    path.unlink(missing_ok=True)


class Pager:
    """Moves adapters between tiers under the budgets of a PagingConfig; the pool calls it on every use."""

    def __init__(self, config: PagingConfig, layers: dict[str, LoraLinear], device: torch.device,
                 model: str = "") -> None:
        self.config = config
        self.model = model  # the base model's name, for the paging metrics (workers/metrics.py)
        self.layers = layers
        self.device = device
        self._clock = 0
        self._own_dir: Path | None = None

    def touch(self, adapter: Adapter) -> None:
        self._clock += 1
        adapter.last_used = self._clock

    def bring_in(self, adapter: Adapter) -> None:
        """Make the adapter trainable: back from disk and/or host memory, attached to the layers."""
        if adapter.tier == DISK:
            assert adapter.spill_path is not None
            read_spill(adapter, adapter.spill_path)
            adapter.spill_path, adapter.tier = None, HOST
            metrics.paged(self.model, DISK, HOST, state_bytes(adapter))
        if adapter.tier == HOST:
            move(adapter, self.device)
            attach_to_layers(adapter, self.layers)
            adapter.tier = DEVICE
            metrics.paged(self.model, HOST, DEVICE, state_bytes(adapter))
        self.touch(adapter)

    def to_host(self, adapter: Adapter) -> None:
        detach_from_layers(adapter, self.layers)
        move(adapter, torch.device("cpu"))
        adapter.tier = HOST
        metrics.paged(self.model, DEVICE, HOST, state_bytes(adapter))

    def to_disk(self, adapter: Adapter) -> None:
        size = state_bytes(adapter)  # before the spill frees the tensors (then it is 0)
        adapter.spill_path = write_spill(adapter, self._spill_dir())
        adapter.tier = DISK
        metrics.paged(self.model, HOST, DISK, size)

    def _spill_dir(self) -> Path:
        """This process's own folder under spill_dir (removed when the pager goes): spills never outlive it."""
        if self._own_dir is None:
            assert self.config.spill_dir is not None
            self.config.spill_dir.mkdir(parents=True, exist_ok=True)
            self._own_dir = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=self.config.spill_dir))
            weakref.finalize(self, shutil.rmtree, self._own_dir, True)
        return self._own_dir

    def enforce(self, adapters: Iterable[Adapter]) -> None:
        """Page out least recently used unpinned adapters until every budget holds (or nothing can move)."""
        every = sorted(adapters, key=lambda a: a.last_used)
        limit_of = self.config.tenant_resident_limit
        if limit_of is not None:
            for tenant in sorted({a.tenant_id for a in every if a.tier == DEVICE}):
                limit = limit_of(tenant)
                if limit is None:
                    continue
                mine = [a for a in every if a.tenant_id == tenant and a.tier == DEVICE]
                excess = len(mine) - max(limit, 0)
                if excess > 0:
                    for a in [a for a in mine if not a.pins][:excess]:
                        self.to_host(a)
        budget = self.config.device_budget_bytes
        if budget is not None:
            used = sum(state_bytes(a) for a in every if a.tier == DEVICE)
            for a in [a for a in every if a.tier == DEVICE and not a.pins]:
                if used <= budget:
                    break
                used -= state_bytes(a)
                self.to_host(a)
        host_budget = self.config.host_budget_bytes
        if host_budget is not None and self.config.spill_dir is not None:
            used = sum(state_bytes(a) for a in every if a.tier == HOST)
            for a in [a for a in every if a.tier == HOST and not a.pins]:
                if used <= host_budget:
                    break
                used -= state_bytes(a)
                self.to_disk(a)

    def forget(self, adapter: Adapter) -> None:
        if adapter.spill_path is not None:
            adapter.spill_path.unlink(missing_ok=True)
            adapter.spill_path = None
