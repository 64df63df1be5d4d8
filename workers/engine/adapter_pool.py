"""Per-model LoRA adapters on the shared base: weights, gradient buffers, optimizer state, and PEFT-format I/O.

Adapters page between the device, host memory and disk under the pool's PagingConfig (workers/engine/paging.py);
`get` and `pinned` bring an adapter back before it is used.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from api_schemas.training import LoraSpec
from workers.engine.base_model import BaseModel
from workers.engine.multi_lora import lora_scale, target_module_names
from workers.engine.optim_state import OptimState
from workers.engine.paging import DEVICE, Pager, PagingConfig

LORA_ALPHA = 32.0
_STATE_FILE = "twinkle_state.json"
_OPTIM_FILE = "optimizer.safetensors"


def accumulate_grads(held: list[torch.Tensor | None], grads: tuple[torch.Tensor, ...]) -> None:
    """Add a pass's gradients (fresh tensors the caller hands over) to the accumulated ones, in place."""
    present = [i for i, g in enumerate(held) if g is not None]
    if present:  # one fused add for every buffer that already holds a gradient
        torch._foreach_add_([held[i] for i in present], [grads[i].detach() for i in present])  # type: ignore[misc]
    for i, g in enumerate(grads):
        if held[i] is None:
            held[i] = g.detach()


class AdapterError(ValueError):
    """A user-caused adapter problem (unknown model, incompatible checkpoint)."""


@dataclass
class Adapter:
    model_id: str
    spec: LoraSpec
    alpha: float
    modules: list[str]  # qualified names of the wrapped layers this adapter targets, sorted
    params: list[torch.Tensor]  # A then B per module, in `modules` order
    grads: list[torch.Tensor | None]
    optim: OptimState = field(default_factory=OptimState)
    tenant_id: str = ""
    tier: str = DEVICE  # device | host | disk (paging.py)
    last_used: int = 0
    pins: int = 0  # > 0 while a step uses it: it never pages out then
    spill_path: Path | None = None
    _param_bytes: int = 0

    @property
    def param_bytes(self) -> int:
        """Bytes of the adapter's weights (their shapes never change: computed once)."""
        if not self._param_bytes:
            self._param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        return self._param_bytes

    @property
    def route_id(self) -> str:
        """The name the multi-LoRA routing knows this adapter by."""
        return self.model_id

    @property
    def dropout(self) -> float:
        return self.spec.dropout

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, name in enumerate(self.modules):
            out[f"base_model.model.{name}.lora_A.weight"] = self.params[2 * i].detach().contiguous()
            out[f"base_model.model.{name}.lora_B.weight"] = self.params[2 * i + 1].detach().contiguous()
        return out


class AdapterPool:
    def __init__(self, base: BaseModel, paging: PagingConfig | None = None) -> None:
        self.base = base
        self.adapters: dict[str, Adapter] = {}
        self.pager = Pager(paging or PagingConfig(), base.layers, base.device, model=base.name)

    def tiers(self) -> dict[str, int]:
        """Adapters per tier (device, host, disk); safe to call from another thread (a copy is counted)."""
        tiers: dict[str, int] = {"device": 0, "host": 0, "disk": 0}
        for adapter in list(self.adapters.values()):
            tiers[adapter.tier] = tiers.get(adapter.tier, 0) + 1
        return tiers

    def get(self, model_id: str) -> Adapter:
        """The model's adapter, on the device and attached to the layers (paged in if it was out)."""
        with self.pinned([model_id]) as adapters:
            return adapters[0]

    @contextlib.contextmanager
    def pinned(self, model_ids: list[str]) -> Iterator[list[Adapter]]:
        """The adapters, paged in and kept on the device (never paged out) until the block ends."""
        missing = [m for m in model_ids if m not in self.adapters]
        if missing:
            raise AdapterError(f"model {missing[0]} is not loaded on this worker")
        adapters = [self.adapters[m] for m in model_ids]
        for a in adapters:
            a.pins += 1
        try:
            for a in adapters:
                self.pager.bring_in(a)
            self.settle()
            yield adapters
        finally:
            for a in adapters:
                a.pins -= 1
            self.settle()

    def create(self, model_id: str, spec: LoraSpec, alpha: float | None = None, tenant_id: str = "") -> Adapter:
        """A new adapter; its alpha is `alpha` (a checkpoint's), else the spec's, else LORA_ALPHA."""
        alpha = alpha if alpha is not None else spec.alpha if spec.alpha is not None else LORA_ALPHA
        self.drop(model_id)
        modules = self.create_modules(spec)
        if not modules:
            raise AdapterError("the LoRA config targets no layer of this base model")
        gen = torch.Generator().manual_seed(spec.seed if spec.seed is not None else 0)
        params: list[torch.Tensor] = []
        for name in modules:
            layer = self.base.layers[name]
            layer.add_adapter(model_id, spec.rank, lora_scale(alpha, spec.rank, spec.rslora), gen)
            params += [layer.lora_A[model_id], layer.lora_B[model_id]]
        adapter = Adapter(model_id, spec, alpha, modules, params, [None] * len(params), tenant_id=tenant_id)
        self.adapters[model_id] = adapter
        self.pager.touch(adapter)
        adapter.pins += 1  # the new adapter stays; older idle ones make room
        try:
            self.settle()
        finally:
            adapter.pins -= 1
        return adapter

    def drop(self, model_id: str) -> None:
        adapter = self.adapters.pop(model_id, None)
        if adapter is not None:
            for layer in self.base.layers.values():
                layer.remove_adapter(model_id)
            self.pager.forget(adapter)

    def accumulate(self, adapter: Adapter, grads: tuple[torch.Tensor, ...]) -> None:
        accumulate_grads(adapter.grads, grads)

    # --- checkpoint I/O: PEFT adapter folder, plus optimizer state for training checkpoints ---

    def save(self, adapter: Adapter, folder: Path, with_optimizer: bool) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(adapter.peft_state_dict(), str(folder / "adapter_model.safetensors"))
        suffixes = sorted({m.rsplit(".", 1)[-1] for m in adapter.modules})
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base.name,
            "r": adapter.spec.rank,
            "lora_alpha": adapter.alpha,
            "lora_dropout": adapter.spec.dropout,
            "use_rslora": adapter.spec.rslora,
            "bias": "none",
            "fan_in_fan_out": False,
            "target_modules": suffixes,
            "inference_mode": True,
        }
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
        meta = {"lora": adapter.spec.model_dump(), "alpha": adapter.alpha, "base_model": self.base.name}
        (folder / _STATE_FILE).write_text(json.dumps(meta, indent=2))
        if with_optimizer:
            adapter.optim.save(folder / _OPTIM_FILE)  # records which optimizer's state it is

    def load(self, model_id: str, folder: Path, with_optimizer: bool, create: bool, tenant_id: str = "") -> Adapter:
        meta_path = folder / _STATE_FILE
        if not meta_path.exists():
            raise AdapterError("checkpoint has no twinkle metadata")
        meta = json.loads(meta_path.read_text())
        if meta.get("base_model") != self.base.name:
            raise AdapterError(f"checkpoint was trained on {meta.get('base_model')}, not {self.base.name}")
        spec = LoraSpec(**meta["lora"])
        alpha = float(meta["alpha"])
        if create or model_id not in self.adapters:
            adapter = self.create(model_id, spec, alpha, tenant_id=tenant_id)
        else:
            adapter = self.get(model_id)
            if adapter.spec.rank != spec.rank or adapter.modules != self.create_modules(spec):
                raise AdapterError("checkpoint LoRA shape differs from this model's (rank or target modules)")
            if adapter.alpha != alpha or adapter.spec.rslora != spec.rslora:
                # the checkpoint's scaling comes with its weights (as PEFT loads an adapter with its own config)
                adapter = self.create(model_id, adapter.spec.model_copy(update={"alpha": alpha, "rslora": spec.rslora}),
                                      alpha, tenant_id=tenant_id)
        weights = load_file(str(folder / "adapter_model.safetensors"))
        with torch.no_grad():
            for key, value in adapter.peft_state_dict().items():
                if key not in weights or weights[key].shape != value.shape:
                    raise AdapterError(f"checkpoint tensor {key} is missing or has the wrong shape")
            for i, name in enumerate(adapter.modules):
                adapter.params[2 * i].copy_(weights[f"base_model.model.{name}.lora_A.weight"])
                adapter.params[2 * i + 1].copy_(weights[f"base_model.model.{name}.lora_B.weight"])
        adapter.grads = [None] * len(adapter.params)
        adapter.optim = OptimState()
        if with_optimizer:
            optim_path = folder / _OPTIM_FILE
            if not optim_path.exists():
                raise AdapterError("checkpoint has no optimizer state (load a weights/ training checkpoint)")
            # AdamW or SGD state; a step of the other optimizer starts its own buffers fresh (optim_state.py)
            adapter.optim = OptimState.load(optim_path)
        self.settle()
        return adapter

    def settle(self) -> None:
        """Page out what the budgets no longer allow (after an adapter grew, e.g. by loaded optimizer state)."""
        self.pager.enforce(self.adapters.values())

    def create_modules(self, spec: LoraSpec) -> list[str]:
        suffixes = set(spec.modules if spec.modules is not None
                       else target_module_names(spec.train_attn, spec.train_mlp, spec.train_unembed))
        return sorted(n for n in self.base.layers if n.rsplit(".", 1)[-1] in suffixes)
