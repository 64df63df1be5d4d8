"""Turns an asample body into a worker `Sample` payload, or a 400 with a reason (nothing is queued then)."""

from __future__ import annotations

from api_schemas.jobs import Sample, SampleParams, WeightsRef
from api_schemas.losses import stability_refusal
from api_schemas.models import ServedModel
from api_schemas.tinker.sampling import SampleRequest, SamplingParams
from server.config import Settings
from server.errors import BadRequest

MAX_NUM_SAMPLES = 128
MAX_TOPK = 64
MAX_STOP_STRINGS = 16


def prompt_tokens(req: SampleRequest) -> list[int]:
    tokens: list[int] = []
    for chunk in req.prompt.chunks:
        if chunk.type != "encoded_text":
            raise BadRequest(f"{chunk.type} prompt chunks are not supported by this text model")
        tokens += chunk.tokens
    return tokens


def sample_params(p: SamplingParams, served: ServedModel, settings: Settings) -> SampleParams:
    max_tokens = settings.sample_default_max_tokens if p.max_tokens is None else p.max_tokens
    if max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1")
    if max_tokens > served.max_context:
        raise BadRequest(f"max_tokens {max_tokens} exceeds the model's context of {served.max_context}")
    if p.temperature < 0:
        raise BadRequest("temperature must be >= 0 (0 is greedy)")
    if not 0 < p.top_p <= 1:
        raise BadRequest("top_p must be in (0, 1]")
    if p.top_k == 0 or p.top_k < -1:
        raise BadRequest("top_k must be -1 (off) or a positive number")
    if p.seed is not None and p.seed < 0:
        raise BadRequest("seed must be a non-negative integer")
    strings: tuple[str, ...] = ()
    ids: tuple[int, ...] = ()
    stop = p.stop
    if isinstance(stop, str):
        strings = (stop,)
    elif stop and isinstance(stop[0], str):
        strings = tuple(str(s) for s in stop)
    elif stop:
        ids = tuple(int(t) for t in stop)
        if min(ids) < 0 or max(ids) >= served.vocab_size:
            raise BadRequest(f"stop token ids must lie in [0, {served.vocab_size})")
    if any(not s for s in strings) or len(strings) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop strings must be non-empty, at most {MAX_STOP_STRINGS} of them")
    return SampleParams(
        max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
        stop_strings=strings, stop_token_ids=ids, stop_at_eos=stop is None or len(stop) > 0,
    )


def sample_payload(req: SampleRequest, served: ServedModel, settings: Settings, weights: WeightsRef | None) -> Sample:
    if req.record_stability_info and (why := stability_refusal()) is not None:
        raise BadRequest(why)  # the stability records are for stable_reinforce: refused here, before any sampling
    tokens = prompt_tokens(req)
    n = len(tokens)
    if n == 0:
        raise BadRequest("the prompt is empty")
    if n >= served.max_context:
        raise BadRequest(f"the prompt has {n} tokens; the model's context is {served.max_context}")
    if min(tokens) < 0 or max(tokens) >= served.vocab_size:
        raise BadRequest(f"prompt token ids must lie in [0, {served.vocab_size})")
    if not 1 <= req.num_samples <= MAX_NUM_SAMPLES:
        raise BadRequest(f"num_samples must be between 1 and {MAX_NUM_SAMPLES}")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        if not 0 <= getattr(req, name) <= MAX_TOPK:
            raise BadRequest(f"{name} must be between 0 and {MAX_TOPK}")
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and (not req.prompt_logprobs or not 1 <= last_n <= n - 1):
        raise BadRequest("prompt_logprobs_last_n needs prompt_logprobs and must be between 1 and len(prompt) - 1")
    if req.target_prompt_logprobs is not None:
        raise BadRequest("target_prompt_logprobs is not supported by this server")
    if req.prompt_alt_tokens_k:
        raise BadRequest("prompt_alt_tokens_k is not supported by this server")
    return Sample(
        prompt_tokens=tuple(tokens),
        num_samples=req.num_samples,
        params=sample_params(req.sampling_params, served, settings),
        prompt_logprobs=bool(req.prompt_logprobs),
        topk_prompt_logprobs=req.topk_prompt_logprobs,
        prompt_logprobs_last_n=last_n,
        topk_sample_logprobs=req.topk_sample_logprobs,
        weights=weights,
    )
