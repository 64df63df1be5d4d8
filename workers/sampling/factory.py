"""Builds the configured sampler backend (`--sampler torch|vllm`) for one served base model."""

from __future__ import annotations

from pathlib import Path

from workers.checkpoints.store import CheckpointStore
from workers.engine.base_model import BaseModel
from workers.sampling.base import SamplerBackend, SamplerConfig


def build_sampler(
    kind: str,
    model_name: str,
    model_folder: Path,
    store: CheckpointStore,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    max_batch_rows: int = 64,
    max_loaded_adapters: int = 32,
    max_lora_rank: int = 128,
    shared_base: BaseModel | None = None,
) -> SamplerBackend:
    """`shared_base`: the trainer's loaded model, which the torch sampler reuses instead of loading a copy.
    `max_lora_rank`: the largest rank the server accepts (TWINKLE_MAX_LORA_RANK); vLLM sizes its LoRA slots for it
    (a smaller maximum is faster), the torch sampler serves any rank."""
    config = SamplerConfig(
        model_name=model_name, model_folder=model_folder, dtype=dtype, device=device, max_batch_rows=max_batch_rows,
        max_loaded_adapters=max_loaded_adapters,
    )
    if kind == "torch":
        from workers.sampling.torch_sampler import TorchSampler

        return TorchSampler(config, store, base=shared_base)
    if kind == "vllm":
        from workers.sampling.vllm_sampler import VllmSampler  # needs the `vllm` extra

        return VllmSampler(config, store, max_lora_rank=max_lora_rank)
    raise ValueError(f"unknown sampler backend {kind!r}; choose torch or vllm")
