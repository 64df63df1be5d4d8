"""Per-request and per-row state of the torch sampler, and the prompt scores computed from a prefill."""

from __future__ import annotations

import asyncio
import math
import secrets
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from api_schemas.jobs import TOPK_EMPTY_LOGPROB, Sample, SampleResult
from workers.sampling.base import SampleOutput, SequenceOut
from workers.sampling.select import Detokenizer, StopRule


def row_generator(seed: int | None, index: int) -> torch.Generator:
    """Sample `index` of a request draws from its own stream: seeded requests repeat, whatever shares the batch."""
    value = secrets.randbits(63) if seed is None else (seed * 1_000_003 + index) % (2**63)
    return torch.Generator().manual_seed(value)


@dataclass
class Row:
    request: ActiveRequest
    index: int
    generator: torch.Generator
    rule: StopRule
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    stop_reason: Literal["stop", "length"] | None = None

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def push(self, token: int, logprob: float, topk: tuple[np.ndarray, np.ndarray] | None, detok: Detokenizer) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if topk is not None:
            self.topk.append(topk)
        if self.rule.hit(self.tokens, detok):
            self.stop_reason = "stop"
        elif len(self.tokens) >= self.rule.max_tokens:
            self.stop_reason = "length"
        elif len(self.request.spec.prompt_tokens) + len(self.tokens) >= self.request.max_context:
            self.stop_reason = "length"  # the context is full: nothing more fits

    def sequence(self) -> SequenceOut:
        out = SequenceOut(tokens=self.tokens, logprobs=self.logprobs, stop_reason=self.stop_reason or "length")
        if self.topk:
            out.topk_ids = np.stack([ids for ids, _ in self.topk]).astype(np.int32)
            out.topk_logprobs = np.stack([lps for _, lps in self.topk]).astype(np.float32)
        return out


@dataclass
class ActiveRequest:
    spec: Sample
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[SampleResult]
    slot: str | None
    eos: tuple[int, ...]
    max_context: int
    output: SampleOutput = field(default_factory=SampleOutput)
    rows: list[Row] = field(default_factory=list)

    def make_rows(self) -> list[Row]:
        p = self.spec.params
        stop_ids = set(p.stop_token_ids) | (set(self.eos) if p.stop_at_eos else set())
        self.rows = [
            Row(self, i, row_generator(p.seed, i), StopRule(frozenset(stop_ids), p.stop_strings, p.max_tokens))
            for i in range(self.spec.num_samples)
        ]
        return self.rows

    @property
    def finished(self) -> bool:
        return all(r.done for r in self.rows)

    def result(self) -> SampleOutput:
        self.output.sequences = [r.sequence() for r in self.rows]
        return self.output


def prompt_scores(spec: Sample, logits: torch.Tensor) -> SampleOutput:
    """Prompt logprobs (NaN at 0 and before the last N) and top-k prompt logprobs from the prefill logits (T, V)."""
    n = len(spec.prompt_tokens)
    # row i predicts prompt position i + 1; log p = logit - logsumexp, never a (T, V) log-softmax beside the logits
    logits = logits[:-1].float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    first = 1 if spec.prompt_logprobs_last_n is None else max(1, n - spec.prompt_logprobs_last_n)
    out = SampleOutput()
    if spec.prompt_logprobs:
        lp = np.full(n, math.nan, dtype=np.float32)
        if n > 1:
            targets = torch.tensor(spec.prompt_tokens[1:], dtype=torch.long, device=logits.device)
            lp[1:] = (logits.gather(1, targets[:, None]) - lse)[:, 0].cpu().numpy()
        lp[:first] = math.nan
        out.prompt_logprobs = lp
    if spec.topk_prompt_logprobs > 0:
        k = min(spec.topk_prompt_logprobs, logits.shape[-1])
        ids = np.zeros((n, k), dtype=np.int32)
        lps = np.full((n, k), TOPK_EMPTY_LOGPROB, dtype=np.float32)
        if n > 1:
            top = logits.topk(k, dim=-1)
            ids[1:], lps[1:] = top.indices.cpu().numpy(), (top.values - lse).cpu().numpy()
        ids[:first], lps[:first] = 0, TOPK_EMPTY_LOGPROB
        out.topk_prompt_ids, out.topk_prompt_logprobs = ids, lps
    return out
