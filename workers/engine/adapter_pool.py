"""Per-model LoRA adapters on the shared base: weights, gradient buffers, optimizer state, and PEFT-format I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from api_schemas.jobs import LoraSpec
from workers.engine.base_model import BaseModel
from workers.engine.multi_lora import target_module_names
from workers.engine.optim import AdamState

LORA_ALPHA = 32.0
_STATE_FILE = "twinkle_state.json"
_OPTIM_FILE = "optimizer.safetensors"


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
    optim: AdamState = field(default_factory=AdamState)

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, name in enumerate(self.modules):
            out[f"base_model.model.{name}.lora_A.weight"] = self.params[2 * i].detach().contiguous()
            out[f"base_model.model.{name}.lora_B.weight"] = self.params[2 * i + 1].detach().contiguous()
        return out


class AdapterPool:
    def __init__(self, base: BaseModel) -> None:
        self.base = base
        self.adapters: dict[str, Adapter] = {}

    def get(self, model_id: str) -> Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise AdapterError(f"model {model_id} is not loaded on this worker")
        return adapter

    def create(self, model_id: str, spec: LoraSpec, alpha: float = LORA_ALPHA) -> Adapter:
        self.drop(model_id)
        modules = self.create_modules(spec)
        if not modules:
            raise AdapterError("the LoRA config targets no layer of this base model")
        gen = torch.Generator().manual_seed(spec.seed if spec.seed is not None else 0)
        params: list[torch.Tensor] = []
        for name in modules:
            layer = self.base.layers[name]
            layer.add_adapter(model_id, spec.rank, alpha, gen)
            params += [layer.lora_A[model_id], layer.lora_B[model_id]]
        adapter = Adapter(model_id, spec, alpha, modules, params, [None] * len(params))
        self.adapters[model_id] = adapter
        return adapter

    def drop(self, model_id: str) -> None:
        if self.adapters.pop(model_id, None) is not None:
            for layer in self.base.layers.values():
                layer.remove_adapter(model_id)

    def accumulate(self, adapter: Adapter, grads: tuple[torch.Tensor, ...]) -> None:
        for i, g in enumerate(grads):
            adapter.grads[i] = g.detach().clone() if adapter.grads[i] is None else adapter.grads[i] + g

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
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "target_modules": suffixes,
            "inference_mode": True,
        }
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
        meta = {"lora": adapter.spec.model_dump(), "alpha": adapter.alpha, "base_model": self.base.name}
        (folder / _STATE_FILE).write_text(json.dumps(meta, indent=2))
        if with_optimizer:
            save_file(adapter.optim.state_dict(), str(folder / _OPTIM_FILE))

    def load(self, model_id: str, folder: Path, with_optimizer: bool, create: bool) -> Adapter:
        meta_path = folder / _STATE_FILE
        if not meta_path.exists():
            raise AdapterError("checkpoint has no twinkle metadata")
        meta = json.loads(meta_path.read_text())
        if meta.get("base_model") != self.base.name:
            raise AdapterError(f"checkpoint was trained on {meta.get('base_model')}, not {self.base.name}")
        spec = LoraSpec(**meta["lora"])
        if create or model_id not in self.adapters:
            adapter = self.create(model_id, spec, float(meta["alpha"]))
        else:
            adapter = self.get(model_id)
            if adapter.spec.rank != spec.rank or adapter.modules != self.create_modules(spec):
                raise AdapterError("checkpoint LoRA shape differs from this model's (rank or target modules)")
        weights = load_file(str(folder / "adapter_model.safetensors"))
        with torch.no_grad():
            for key, value in adapter.peft_state_dict().items():
                if key not in weights or weights[key].shape != value.shape:
                    raise AdapterError(f"checkpoint tensor {key} is missing or has the wrong shape")
            for i, name in enumerate(adapter.modules):
                adapter.params[2 * i].copy_(weights[f"base_model.model.{name}.lora_A.weight"])
                adapter.params[2 * i + 1].copy_(weights[f"base_model.model.{name}.lora_B.weight"])
        adapter.grads = [None] * len(adapter.params)
        adapter.optim = AdamState()
        if with_optimizer:
            optim_path = folder / _OPTIM_FILE
            if not optim_path.exists():
                raise AdapterError("checkpoint has no optimizer state (load a weights/ training checkpoint)")
            adapter.optim.load_state_dict(load_file(str(optim_path)))
        return adapter

    def create_modules(self, spec: LoraSpec) -> list[str]:
        suffixes = set(target_module_names(spec.train_attn, spec.train_mlp, spec.train_unembed))
        return sorted(n for n in self.base.layers if n.rsplit(".", 1)[-1] in suffixes)
