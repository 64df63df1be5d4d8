"""Memory honesty: what a base model or a full-parameter copy needs, checked before anything is loaded.

A model that does not fit is refused up front with a message that says how much it needs and how much there is,
never an out-of-memory crash in the middle of a step. The need is counted from the safetensors headers (no weights
read): parameters x bytes per parameter in the serving dtype, and, for a full-parameter copy, its gradients and the
optimizer's two fp32 moments too. What there is: the operator's budget (`TWINKLE_MEMORY_BUDGET_BYTES`, for all the
models and copies of one process), less what this process already reserved; without a budget, the memory the
device has free right now (CPU: the kernel's MemAvailable; CUDA: the driver's free bytes).
"""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
_OPTIM_BYTES = 8  # AdamW's two moments, fp32 each (workers/engine/optim_state.py)
GIB = 1024**3


class MemoryRefused(RuntimeError):
    """A model or a full-parameter copy does not fit; the message says what it needs and what is left."""


def parameter_count(folder: Path) -> int:
    """Parameters of the safetensors weights in `folder`, from the files' headers (tied tensors stored once)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for d in entry["shape"]:
                    n *= int(d)
                total += n
    return total


def weights_bytes(folder: Path, dtype: str) -> int:
    return parameter_count(folder) * DTYPE_BYTES[dtype]


def full_copy_bytes(folder: Path, dtype: str) -> int:
    """A private trainable copy: its weights, their gradients (same dtype) and the optimizer's fp32 moments."""
    n = parameter_count(folder)
    return n * (2 * DTYPE_BYTES[dtype] + _OPTIM_BYTES)


def free_bytes(device: str) -> int:
    """What the device has free now."""
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return _ram("MemAvailable", "available")


def total_bytes(device: str) -> int:
    """All the memory the device has (CPU: the machine's RAM)."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return _ram("MemTotal", "total")


def _ram(meminfo_field: str, psutil_field: str) -> int:
    """A /proc/meminfo figure in bytes (not Linux: psutil's, ray's dependency, installed with the server)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{meminfo_field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(getattr(psutil.virtual_memory(), psutil_field))


def default_adapter_budgets(device: str) -> tuple[int, int]:
    """Adapter paging budgets (device tier, host tier) where the operator sets none: adapters attached to the model
    take at most 1/8 of the device's memory, paged-out ones at most 1/4 of the RAM; beyond that they go to disk. So
    a thousand idle adapters never exhaust memory (on a CPU both tiers are RAM: 3/8 of it in all)."""
    return total_bytes(device) // 8, total_bytes("cpu") // 4


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


class MemoryLedger:
    """The memory one process's models and full-parameter copies reserved, against the operator's budget (or,
    without one, against what the device has free when a reservation is asked for)."""

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self._reserved: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values())

    def reservations(self) -> dict[str, int]:
        with self._lock:
            return dict(self._reserved)

    def reserve(self, key: str, what: str, needed: int, device: str) -> None:
        """Reserve `needed` bytes for `key` (described as `what` in a refusal), or raise MemoryRefused."""
        with self._lock:
            if self.budget_bytes is not None:
                left = self.budget_bytes - sum(self._reserved.values())
                source = f"of the memory budget ({_gib(self.budget_bytes)}, TWINKLE_MEMORY_BUDGET_BYTES)"
            else:
                left = free_bytes(device)
                source = f"free on {device}"
            if needed > left:
                raise MemoryRefused(f"{what} needs {_gib(needed)}; only {_gib(max(left, 0))} {source} is left")
            self._reserved[key] = self._reserved.get(key, 0) + needed

    def release(self, key: str) -> None:
        with self._lock:
            self._reserved.pop(key, None)
