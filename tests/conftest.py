"""Suite-wide pytest setup: offline, quiet thread pools, the `slow` marker and a shared tiny model.

The environment defaults are set at import, before any test module imports torch, tokenizers or
huggingface_hub, because those libraries read them once when they load.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach a model hub; spinning OpenMP threads and tokenizers' fork warnings only slow CI down.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.support.tiny_model import build_tiny_model  # noqa: E402  (after the environment defaults)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a minute; deselect with -m 'not slow'")
    config.addinivalue_line("markers", "vllm: needs vLLM (scripts/test_vllm.sh runs them in their own venv)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a real tokenizer, built once per test session (read-only by convention)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model")
