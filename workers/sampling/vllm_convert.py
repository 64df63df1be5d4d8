"""Translation between a `Sample` job and vLLM: the SamplingParams it runs with, and its RequestOutput as SampleOutput.

Kept apart from the engine wrapper so the mapping can be read (and checked) in one place. The rules are the sampler
contract of workers/sampling/base.py:
- logprobs are vLLM's "raw" logprobs (the model's own log-softmax before temperature / top-k / top-p), which the
  engine is configured for; `logprobs=k` asks for the sampled token plus the top k;
- EOS is handled here, not by vLLM (`ignore_eos`), so `stop_at_eos` and generation_config's end-of-turn ids behave
  exactly as in the torch sampler; stop tokens stay in the returned tokens;
- stop strings are matched on text decoded with special tokens, and the tokens that spelled them are kept; vLLM
  stops generating, then the torch sampler's own rule (select.StopRule) picks the exact last token.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from api_schemas.jobs import TOPK_EMPTY_LOGPROB, Sample
from workers.sampling.base import SampleOutput, SequenceOut
from workers.sampling.select import Detokenizer, StopRule


def sampling_params(spec: Sample, eos: Sequence[int], max_model_len: int) -> SamplingParams:
    """The vLLM SamplingParams of one request (all `num_samples` sequences run as one request with n=...)."""
    p = spec.params
    stop_ids = set(p.stop_token_ids) | (set(eos) if p.stop_at_eos else set())
    wants_prompt = spec.prompt_logprobs or spec.topk_prompt_logprobs > 0
    return SamplingParams(
        n=1 if _greedy(spec) else spec.num_samples,  # vLLM refuses n > 1 with greedy; the copies are identical
        # A sequence also ends when the context is full; vLLM would reject the request instead.
        max_tokens=min(p.max_tokens, max_model_len - len(spec.prompt_tokens)),
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k if p.top_k > 0 else 0,
        seed=p.seed,
        stop=list(p.stop_strings) or None,
        stop_token_ids=sorted(stop_ids),
        ignore_eos=True,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        detokenize=bool(p.stop_strings),
        logprobs=spec.topk_sample_logprobs,
        prompt_logprobs=spec.topk_prompt_logprobs if wants_prompt else None,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def sample_output(spec: Sample, out: Any, detok: Detokenizer | None = None) -> SampleOutput:
    """A finished vLLM RequestOutput as the backend-neutral SampleOutput (`detok`: needed for stop strings)."""
    result = SampleOutput(prompt_cache_hit_tokens=int(getattr(out, "num_cached_tokens", 0) or 0))
    for completion in sorted(out.outputs, key=lambda c: c.index):
        seq = _sequence(completion, spec.topk_sample_logprobs)
        if spec.params.stop_strings and detok is not None:
            _cut_at_stop_string(seq, spec, detok)
        result.sequences.append(seq)
    if _greedy(spec):
        result.sequences = [copy.deepcopy(result.sequences[0]) for _ in range(spec.num_samples)]
    if len(result.sequences) != spec.num_samples:
        raise RuntimeError(f"vLLM returned {len(result.sequences)} sequences for {spec.num_samples} samples")
    if spec.prompt_logprobs or spec.topk_prompt_logprobs > 0:
        _prompt_scores(spec, out.prompt_logprobs, result)
    return result


def _cut_at_stop_string(seq: SequenceOut, spec: Sample, detok: Detokenizer) -> None:
    """End `seq` at the first token whose decoded tail holds a stop string, as the torch sampler's rule does.

    vLLM's incremental detokenizer holds back the bytes of an unfinished UTF-8 character, so a stop string that
    contains U+FFFD (how the full decode shows such bytes) is seen a token later there, never earlier.
    """
    rule = StopRule(frozenset(), spec.params.stop_strings, spec.params.max_tokens)
    for end in range(1, len(seq.tokens) + 1):
        if rule.hit(seq.tokens[:end], detok):
            if end < len(seq.tokens) or seq.stop_reason == "length":
                seq.tokens, seq.logprobs, seq.stop_reason = seq.tokens[:end], seq.logprobs[:end], "stop"
                if seq.topk_ids is not None and seq.topk_logprobs is not None:
                    seq.topk_ids, seq.topk_logprobs = seq.topk_ids[:end], seq.topk_logprobs[:end]
            return


def _greedy(spec: Sample) -> bool:
    return spec.params.temperature < 1e-5  # vLLM's own threshold for greedy sampling


def _sequence(completion: Any, k: int) -> SequenceOut:
    reason = completion.finish_reason
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended a sequence with finish_reason {reason!r}")
    stop_reason: Literal["stop", "length"] = "stop" if reason == "stop" else "length"
    tokens = [int(t) for t in completion.token_ids]
    positions: Sequence[Mapping[int, Any]] = completion.logprobs or []
    if len(positions) != len(tokens):
        raise RuntimeError(f"vLLM returned {len(positions)} logprobs for {len(tokens)} tokens")
    seq = SequenceOut(
        tokens=tokens,
        logprobs=[float(pos[t].logprob) for pos, t in zip(positions, tokens)],
        stop_reason=stop_reason,
    )
    if k > 0:
        seq.topk_ids, seq.topk_logprobs = _topk_table(positions, k, first=0)
    return seq


def _prompt_scores(spec: Sample, positions: Sequence[Mapping[int, Any] | None] | None, result: SampleOutput) -> None:
    """Prompt logprobs, NaN at 0 and before the last N; top-k prompt logprobs with empty slots where not scored."""
    prompt = spec.prompt_tokens
    n = len(prompt)
    if positions is None or len(positions) != n:
        raise RuntimeError("vLLM returned no prompt logprobs for a request that asked for them")
    first = 1 if spec.prompt_logprobs_last_n is None else max(1, n - spec.prompt_logprobs_last_n)
    if spec.prompt_logprobs:
        lp = np.full(n, math.nan, dtype=np.float32)
        for i in range(first, n):
            lp[i] = positions[i][prompt[i]].logprob  # type: ignore[index]
        result.prompt_logprobs = lp
    if spec.topk_prompt_logprobs > 0:
        result.topk_prompt_ids, result.topk_prompt_logprobs = _topk_table(positions, spec.topk_prompt_logprobs, first)


def _topk_table(positions: Sequence[Mapping[int, Any] | None], k: int, first: int) -> tuple[np.ndarray, np.ndarray]:
    """(len, k) ids and logprobs of the k best tokens per position, best first; empty slots 0 / -99999.0.

    vLLM's dict at a position holds the top k plus the scored token itself, each with its vocabulary rank.
    """
    ids = np.zeros((len(positions), k), dtype=np.int32)
    lps = np.full((len(positions), k), TOPK_EMPTY_LOGPROB, dtype=np.float32)
    for i in range(first, len(positions)):
        entries = positions[i] or {}
        ranked = [(t, e) for t, e in entries.items() if e.rank is None or e.rank <= k]
        best = sorted(ranked, key=lambda item: -item[1].logprob)[:k]
        for j, (token, entry) in enumerate(best):
            ids[i, j], lps[i, j] = token, entry.logprob
    return ids, lps
