"""What a gateway keeps in memory for native adapters: one lock per adapter (its operations run one at a time) and
the inputs of a split `forward` waiting for its `calculate_loss` / `backward` (bounded; lost with the process, as
upstream's are)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

MAX_PENDING = 1024  # adapters with a split forward waiting; the oldest is dropped beyond it


class NativeMemory:
    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._pending: OrderedDict[str, Any] = OrderedDict()

    def lock(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            if len(self._locks) > 100_000:  # drop idle locks (none is held by a waiting operation)
                self._locks = {k: v for k, v in self._locks.items() if v.locked()}
            lock = self._locks[key] = asyncio.Lock()
        return lock

    def put_forward(self, model_id: str, value: Any) -> None:
        self._pending.pop(model_id, None)
        self._pending[model_id] = value
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def forward(self, model_id: str) -> Any | None:
        return self._pending.get(model_id)

    def drop_forward(self, model_id: str) -> None:
        self._pending.pop(model_id, None)
