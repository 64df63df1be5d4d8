"""Memory honesty (workers/memory.py): parameters counted from safetensors headers, and reservations against a
budget refused with what they need and what is left."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from workers.memory import GIB, MemoryLedger, MemoryRefused, full_copy_bytes, parameter_count, weights_bytes


def test_parameters_are_counted_from_the_headers(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model-00001.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2, dtype=torch.bfloat16)}, str(tmp_path / "model-00002.safetensors"))
    assert parameter_count(tmp_path) == 12 + 5 + 8
    assert weights_bytes(tmp_path, "bfloat16") == 25 * 2
    assert full_copy_bytes(tmp_path, "float32") == 25 * (4 + 4 + 8)  # weights, gradients, two fp32 moments


def test_the_ledger_refuses_past_its_budget_and_frees_on_release() -> None:
    ledger = MemoryLedger(budget_bytes=GIB)
    ledger.reserve("base:a", "base model 'a'", GIB // 2, "cpu")
    with pytest.raises(MemoryRefused, match=r"copy of 'a' needs 0\.60 GiB; only 0\.50 GiB of the memory budget"):
        ledger.reserve("full:x", "a full-parameter copy of 'a'", int(0.6 * GIB), "cpu")
    assert ledger.reserved_bytes == GIB // 2  # a refusal reserves nothing
    ledger.release("base:a")
    ledger.reserve("full:x", "a full-parameter copy of 'a'", int(0.6 * GIB), "cpu")
    assert ledger.reservations() == {"full:x": int(0.6 * GIB)}


def test_without_a_budget_the_free_memory_decides() -> None:
    ledger = MemoryLedger()
    with pytest.raises(MemoryRefused, match="free on cpu"):
        ledger.reserve("huge", "a model", 1 << 60, "cpu")
    ledger.reserve("small", "a model", 1024, "cpu")
