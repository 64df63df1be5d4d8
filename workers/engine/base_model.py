"""The one shared base model of a worker: loaded once, frozen, its linear layers wrapped for multi-LoRA."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from workers.engine.multi_lora import LoraLinear, wrap_linear_layers

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BaseModel:
    def __init__(self, name: str, folder: Path, dtype: str = "float32", device: str = "cpu") -> None:
        self.name = name
        self.folder = folder
        self.dtype = _DTYPES[dtype]
        self.device = torch.device(device)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=self.dtype)
        model.to(self.device).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model
        self.layers: dict[str, LoraLinear] = wrap_linear_layers(model)
        cfg = json.loads((folder / "config.json").read_text())
        self.vocab_size = int(cfg["vocab_size"])
        self.max_context = int(cfg.get("max_position_embeddings", 2048))

    def logprob_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """log-softmax over the vocabulary in float32 (or the model dtype when wider), shape (B, T, V)."""
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return torch.log_softmax(logits.to(wide), dim=-1)
