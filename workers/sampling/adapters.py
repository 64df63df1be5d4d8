"""The torch sampler's adapter slots: PEFT adapter folders loaded as the sampler's own adapters (a multi_lora
FrozenAdapters set), one slot per immutable weight version.

A slot's id is `sampler:<version>`; its tensors are the sampler's own copies, so a sampler keeps the exact weights
it loaded while the trainer goes on updating its adapter. Slots in use by a running request are pinned; when more than
`capacity` versions are loaded, the least recently used unpinned one is dropped (it reloads on its next use).
Only the sampler's engine thread calls into this class.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file

from api_schemas.jobs import WeightsRef
from workers.checkpoints.store import CheckpointStore
from workers.engine.multi_lora import FrozenAdapters, LoraLinear
from workers.sampling.base import SamplerUserError

_PREFIX = "base_model.model."


def slot_id(version: str) -> str:
    return f"sampler:{version}"


LoraPairs = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer name -> (A, B) in PEFT layout


def read_peft_folder(folder: Path, layers: dict[str, LoraLinear]) -> tuple[LoraPairs, float]:
    """{layer name: (A, B)} and the scale of a PEFT LoRA folder, checked against the base model's layers."""
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as e:
        raise SamplerUserError(f"the sampler weights are not a readable PEFT adapter folder ({e})") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise SamplerUserError(f"unsupported adapter type {config.get('peft_type')!r}; only LoRA is served")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: LoraPairs = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key[len(_PREFIX) : -len(".lora_A.weight")] if key.startswith(_PREFIX) else key[: -len(".lora_A.weight")]
        b = tensors.get(key.replace(".lora_A.weight", ".lora_B.weight"))
        layer = layers.get(name)
        if layer is None or b is None:
            raise SamplerUserError(f"adapter tensor {key} does not match a layer of this base model")
        if a.shape != (rank, layer.base.in_features) or b.shape != (layer.base.out_features, rank):
            raise SamplerUserError(f"adapter tensor {key} has the wrong shape for this base model")
        pairs[name] = (a, b)
    if not pairs:
        raise SamplerUserError("the adapter folder holds no LoRA tensors")
    return pairs, scale


class AdapterSlots:
    def __init__(self, lora: FrozenAdapters, store: CheckpointStore, capacity: int) -> None:
        self.lora = lora
        self.layers = lora.layers
        self.store = store
        self.capacity = capacity
        self._loaded: OrderedDict[str, list[str]] = OrderedDict()  # version -> layer names holding it (LRU order)
        self._pins: dict[str, int] = {}

    def acquire(self, weights: WeightsRef | None) -> str | None:
        """The slot id serving `weights` (None: the base model), loading it if needed, pinned until `release`."""
        if weights is None:
            return None
        if weights.version not in self._loaded:
            self._load(weights)
        self._loaded.move_to_end(weights.version)
        self._pins[weights.version] = self._pins.get(weights.version, 0) + 1
        self._evict()
        return slot_id(weights.version)

    def release(self, weights: WeightsRef | None) -> None:
        if weights is None:
            return
        left = self._pins.get(weights.version, 0) - 1
        if left > 0:
            self._pins[weights.version] = left
        else:
            self._pins.pop(weights.version, None)
        self._evict()

    def loaded(self) -> list[str]:
        return list(self._loaded)

    def _load(self, weights: WeightsRef) -> None:
        try:
            folder = self.store.existing(weights.storage_key)
        except ValueError as e:
            raise SamplerUserError(str(e)) from e
        if folder is None:
            raise SamplerUserError("the sampler weights are gone (deleted or expired)")
        pairs, scale = read_peft_folder(folder, self.layers)
        sid = slot_id(weights.version)
        for name, (a, b) in pairs.items():
            self.lora.put(sid, name, a, b, scale)
        self._loaded[weights.version] = list(pairs)

    def _evict(self) -> None:
        for version in list(self._loaded):
            if len(self._loaded) <= self.capacity:
                return
            if version in self._pins:
                continue
            del self._loaded[version]
            self.lora.drop(slot_id(version))
