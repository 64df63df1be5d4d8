"""Sampling from full-parameter checkpoints: a sampler built from the checkpoint's own weights.

A full-parameter run saves a whole Hugging Face folder (workers/engine/full_param.py), not a LoRA, so it cannot
ride on the base model's batch like an adapter. `FullCheckpointSampling` wraps the model's sampler backend: a
request whose weights are a full checkpoint goes to a torch sampler built from that folder (its own copy of the
weights, loaded once and kept for the next requests; the least recently used copy is closed when more than
`max_copies` are wanted), every other request to the wrapped backend. A copy's memory is reserved in the process's
MemoryLedger before it is loaded: one that does not fit is a user error saying what it needs.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict

from api_schemas.jobs import Sample, SampleResult
from workers.checkpoints.store import CheckpointStore
from workers.engine.full_param import is_full_checkpoint
from workers.memory import MemoryLedger, MemoryRefused, weights_bytes
from workers.sampling.base import SamplerBackend, SamplerConfig, SamplerUserError


class FullCheckpointSampling(SamplerBackend):
    def __init__(self, inner: SamplerBackend, config: SamplerConfig, store: CheckpointStore,
                 ledger: MemoryLedger | None = None, max_copies: int = 2) -> None:
        self.inner = inner
        self.config = config
        self.store = store
        self.ledger = ledger or MemoryLedger()
        self.max_copies = max_copies
        self._full: dict[str, bool] = {}  # weights version -> is it a full checkpoint (versions are immutable)
        self._copies: OrderedDict[str, SamplerBackend] = OrderedDict()  # version -> its sampler, oldest first
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        for version in list(self._copies):
            await self._drop(version)
        await self.inner.close()

    async def sample(self, spec: Sample) -> SampleResult:
        weights = spec.weights
        if weights is None or not await self._is_full(weights.storage_key, weights.version):
            return await self.inner.sample(spec)
        copy = await self._copy(weights.storage_key, weights.version)
        return await copy.sample(spec.model_copy(update={"weights": None}))  # the copy's own weights are the model

    async def _is_full(self, storage_key: str, version: str) -> bool:
        known = self._full.get(version)
        if known is None:
            folder = await asyncio.to_thread(self.store.existing, storage_key)
            known = self._full[version] = folder is not None and is_full_checkpoint(folder)
        return known

    async def _copy(self, storage_key: str, version: str) -> SamplerBackend:
        from workers.sampling.torch_sampler import TorchSampler

        async with self._lock:  # one load per version, however many requests wait for it
            copy = self._copies.get(version)
            if copy is not None:
                self._copies.move_to_end(version)
                return copy
            folder = await asyncio.to_thread(self.store.existing, storage_key)
            if folder is None:
                raise SamplerUserError("checkpoint files not found (deleted or expired)")
            while len(self._copies) >= self.max_copies:
                await self._drop(next(iter(self._copies)))
            try:
                self.ledger.reserve(f"sample:{version}", "a sampler of a full-parameter checkpoint",
                                    weights_bytes(folder, self.config.dtype), self.config.device)
            except MemoryRefused as e:
                raise SamplerUserError(str(e)) from e
            copy = TorchSampler(dataclasses.replace(self.config, model_folder=folder), self.store)
            try:
                await copy.start()  # loads the checkpoint's weights (off the event loop)
            except BaseException:
                self.ledger.release(f"sample:{version}")
                raise
            self._copies[version] = copy
            return copy

    async def _drop(self, version: str) -> None:
        copy = self._copies.pop(version, None)
        if copy is not None:
            await copy.close()
            self.ledger.release(f"sample:{version}")
