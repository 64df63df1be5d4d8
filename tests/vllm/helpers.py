"""Helpers of the vLLM sampler suite: trainer-made adapter folders, Sample jobs, decoded results, PEFT references.

Adapters are written by the training side's own AdapterPool (the PEFT folder format the sampler must serve), with
their B matrices set to seeded random values so every adapter visibly changes the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

from api_schemas.jobs import Sample, SampleParams, SampleResult, WeightsRef
from api_schemas.training import LoraSpec
from api_schemas.tinker.proto import encode_sample_response
from workers.checkpoints.store import CheckpointStore

PROMPT = (5, 17, 99, 23, 40, 41, 7, 120, 64)


@lru_cache(maxsize=2)
def _pool(model_dir: Path) -> Any:
    from workers.engine.adapter_pool import AdapterPool
    from workers.engine.base_model import BaseModel

    return AdapterPool(BaseModel("tiny", model_dir))


def save_adapter(store: CheckpointStore, model_dir: Path, key: str, seed: int, *, unembed: bool = True) -> Path:
    """Write a rank-8 PEFT adapter (lm_head included unless `unembed=False`) to storage key `key`."""
    pool = _pool(model_dir)
    adapter = pool.create(f"m-{seed}", LoraSpec(rank=8, seed=seed, train_unembed=unembed))
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for b in adapter.params[1::2]:
            b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    with store.writing(key) as folder:
        pool.save(adapter, folder, with_optimizer=False)
    pool.drop(adapter.model_id)
    path = store.existing(key)
    assert path is not None
    return path


def spec(
    weights: WeightsRef | None = None,
    *,
    prompt: tuple[int, ...] = PROMPT,
    max_tokens: int = 8,
    temperature: float = 0.0,
    num_samples: int = 1,
    **extra: Any,
) -> Sample:
    """A Sample job; `extra` fills SampleParams fields (seed, top_k, stop_token_ids, ...) and Sample fields."""
    param_fields = set(SampleParams.model_fields)
    params = SampleParams(
        max_tokens=max_tokens, temperature=temperature, **{k: v for k, v in extra.items() if k in param_fields}
    )
    rest = {k: v for k, v in extra.items() if k not in param_fields}
    return Sample(prompt_tokens=prompt, num_samples=num_samples, params=params, weights=weights, **rest)


@dataclass
class Decoded:
    tokens: list[list[int]]
    logprobs: list[np.ndarray]
    stop_reasons: list[str]
    prompt_logprobs: np.ndarray | None
    message: Any


def decode(result: SampleResult) -> Decoded:
    """A sampler's result as the SDK receives it (through the Tinker edge's protobuf encoding)."""
    msg = pb.SampleResponse.FromString(encode_sample_response(result))
    return Decoded(
        tokens=[np.frombuffer(s.tokens, dtype="<i4").tolist() for s in msg.sequences],
        logprobs=[np.frombuffer(s.logprobs, dtype="<f4") for s in msg.sequences],
        stop_reasons=["stop" if s.stop_reason == pb.STOP_REASON_STOP else "length" for s in msg.sequences],
        prompt_logprobs=np.frombuffer(msg.prompt_logprobs, dtype="<f4") if msg.prompt_logprobs else None,
        message=msg,
    )


def topk(table: Any) -> tuple[np.ndarray, np.ndarray]:
    ids = np.frombuffer(table.token_ids, dtype="<i4").reshape(table.length, table.k)
    lps = np.frombuffer(table.logprobs, dtype="<f4").reshape(table.length, table.k)
    return ids, lps


def _reference_model(model_dir: Path, adapter: Path | None) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


def reference_logprobs(model_dir: Path, adapter: Path | None, tokens: tuple[int, ...]) -> np.ndarray:
    """Training-side logprobs (transformers + PEFT, fp32) of tokens[1:], NaN at position 0, like prompt logprobs."""
    model = _reference_model(model_dir, adapter)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
    out = np.full(len(tokens), np.nan, dtype=np.float32)
    out[1:] = logp[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()
    return out


def reference_greedy(model_dir: Path, adapter: Path | None, tokens: tuple[int, ...], n: int) -> list[int]:
    model = _reference_model(model_dir, adapter)
    seq = list(tokens)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(tokens) :]
