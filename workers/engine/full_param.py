"""Full-parameter runs: each a private trainable copy of the base model, on the trainer that serves the base.

A full-parameter run (Tinker `create_model` without a LoRA config, native `add_adapter_to_model(config=None)`)
gets its own copy of the base model, loaded from the base's folder (never copied from the shared model, whose
layers hold other tenants' adapters), with every parameter trainable. The shared base model is never written, so
it stays bit-identical to the files and the LoRA tenants go on training beside the copy; how many copies a model
carries at once is the gateway's lease (server/services/full_param.py), and what a copy costs (weights,
gradients, the optimizer's fp32 moments) is reserved in the process's MemoryLedger before the copy is loaded, so a
copy that does not fit is refused up front with what it needs.

`FullRuns` looks like the adapter pool to the merged pass and to the optimizer (adapters by model id, `pinned`,
`accumulate`, each run's `params` / `grads` / `optim`), so one forward/backward code path trains both; a run's
pass has its own rows only (it cannot share a pass with adapters on another copy of the weights).

Checkpoints are a Hugging Face folder: config.json, the tokenizer files, the weights as safetensors shards with
their index (the base model's parameter names), plus `twinkle_state.json` ({"full": true, "base_model": ...}) and,
for a training checkpoint, the optimizer state. Such a folder loads back into a run, and a sampler can be built
from it (workers/sampling/full_checkpoints.py).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from workers.engine.adapter_pool import accumulate_grads
from workers.engine.base_model import BaseModel
from workers.engine.optim_state import OptimState
from workers.memory import MemoryLedger, full_copy_bytes

STATE_FILE = "twinkle_state.json"
_OPTIM_FILE = "optimizer.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_SHARD_BYTES = 2 * 1024**3  # weights per shard file
_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


class FullParamError(ValueError):
    """A user-caused problem with a full-parameter run (not a full checkpoint, another base model)."""


def is_full_checkpoint(folder: Path) -> bool:
    path = folder / STATE_FILE
    return path.exists() and bool(json.loads(path.read_text()).get("full"))


@dataclass
class FullRun:
    model_id: str
    tenant_id: str
    base: BaseModel  # this run's own copy
    names: list[str]  # Hugging Face parameter names, in `params` order
    params: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    optim: OptimState = field(default_factory=OptimState)
    route_id: None = None  # the merged pass routes its rows through no adapter: the copy's own weights
    dropout: float = 0.0


def _hf_parameters(base: BaseModel) -> list[tuple[str, torch.Tensor]]:
    """(the checkpoint name, the tensor) of every distinct parameter: a wrapped layer's `X.base.weight` is the
    model's `X.weight`; tied weights (embeddings = head) appear once, as transformers saves them."""
    wrapped = set(base.layers)
    out, seen = [], set()
    for name, p in base.model.named_parameters():
        head, _, leaf = name.rpartition(".")
        if head.endswith(".base") and head[: -len(".base")] in wrapped:
            name = f"{head[: -len('.base')]}.{leaf}"
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


class FullRuns:
    """The full-parameter runs of one trainer (see the module docstring)."""

    def __init__(self, base: BaseModel, ledger: MemoryLedger | None = None) -> None:
        self.base = base
        self.ledger = ledger or MemoryLedger()
        self.adapters: dict[str, FullRun] = {}

    def __contains__(self, model_id: str) -> bool:
        return model_id in self.adapters

    def create(self, model_id: str, tenant_id: str) -> FullRun:
        """A fresh trainable copy of the base model (after reserving its memory; MemoryRefused if it does not fit)."""
        self.drop(model_id)
        dtype = str(self.base.dtype).removeprefix("torch.")
        self.ledger.reserve(f"full:{model_id}", f"a full-parameter copy of {self.base.name!r} (weights, gradients "
                            "and optimizer state)", full_copy_bytes(self.base.folder, dtype), str(self.base.device))
        try:
            copy = BaseModel(self.base.name, self.base.folder, dtype=dtype, device=str(self.base.device))
        except BaseException:
            self.ledger.release(f"full:{model_id}")
            raise
        named = _hf_parameters(copy)
        for _, p in named:
            p.requires_grad_(True)
        run = FullRun(model_id, tenant_id, copy, [n for n, _ in named], [p for _, p in named], [None] * len(named))
        self.adapters[model_id] = run
        return run

    def drop(self, model_id: str) -> None:
        if self.adapters.pop(model_id, None) is not None:
            self.ledger.release(f"full:{model_id}")

    def get(self, model_id: str) -> FullRun:
        run = self.adapters.get(model_id)
        if run is None:
            raise FullParamError(f"model {model_id} is not loaded on this worker")
        return run

    @contextlib.contextmanager
    def pinned(self, model_ids: list[str]) -> Iterator[list[FullRun]]:
        """A copy never pages out: the runs themselves."""
        yield [self.get(m) for m in model_ids]

    def accumulate(self, run: FullRun, grads: tuple[torch.Tensor, ...]) -> None:
        accumulate_grads(run.grads, grads)

    # --- checkpoints: a Hugging Face folder plus twinkle's state ---

    def save(self, run: FullRun, folder: Path, with_optimizer: bool) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for name in _MODEL_FILES:
            src = self.base.folder / name
            if src.exists():
                shutil.copyfile(src, folder / name)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, p in zip(run.names, run.params):
            nbytes = p.numel() * p.element_size()
            if shards[-1] and size + nbytes > _SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][name] = p.detach().contiguous()
            size += nbytes
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
        total = sum(p.numel() * p.element_size() for p in run.params)
        (folder / _INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
        (folder / STATE_FILE).write_text(json.dumps({"full": True, "base_model": self.base.name}, indent=2))
        if with_optimizer:
            run.optim.save(folder / _OPTIM_FILE)

    def load(self, model_id: str, folder: Path, with_optimizer: bool, tenant_id: str) -> FullRun:
        """The checkpoint's weights (and optimizer state) into the run, created if it does not exist."""
        meta = json.loads((folder / STATE_FILE).read_text())
        if meta.get("base_model") != self.base.name:
            raise FullParamError(f"checkpoint was trained on {meta.get('base_model')}, not {self.base.name}")
        run = self.adapters.get(model_id) or self.create(model_id, tenant_id)
        index = json.loads((folder / _INDEX_FILE).read_text())["weight_map"]
        weights: dict[str, torch.Tensor] = {}
        for file in sorted(set(index.values())):
            weights.update(load_file(str(folder / file)))
        with torch.no_grad():
            for name, p in zip(run.names, run.params):
                if name not in weights or weights[name].shape != p.shape:
                    raise FullParamError(f"checkpoint tensor {name} is missing or has the wrong shape")
                p.copy_(weights[name])
        run.grads = [None] * len(run.params)
        run.optim = OptimState()
        if with_optimizer:
            if not (folder / _OPTIM_FILE).exists():
                raise FullParamError("checkpoint has no optimizer state (load a training checkpoint)")
            run.optim = OptimState.load(folder / _OPTIM_FILE)
        return run
