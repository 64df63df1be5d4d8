"""The native sampler (twinkle_client's vLLMSampler): sample from the base model or the caller's own saved adapter.

Inputs are InputFeatures (their `input_ids` are the prompt) or Trajectories (`messages`, rendered with the served
model's chat template and its generation prompt). Each input is one Sample job (the same lane, immutable weight
versions and backends as Tinker sampling) with `num_samples` sequences; the answer is upstream's shape:
`{"samples": [{"sequences": [...], "prompt_logprobs": ...}]}`, each sequence with `new_input_feature` (the input
with the generated turn appended: ids, shifted labels, and the assistant message when the input had messages).
`adapter_uri` must be a twinkle:// (or tinker://) path of the caller's own checkpoint. `adapter_name` without
`adapter_uri` names a slot the caller's session added with add_adapter_to_sampler, which holds no weights: the base
model is sampled (server/services/native/sampler_adapters.py); with `adapter_uri` it is not looked up; empty, it
means no adapter.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from api_schemas.jobs import Sample, SampledSequence, SampleResult, WeightsRef
from api_schemas.models import ServedModel
from api_schemas.native.features import IGNORE_INDEX, is_feature_list
from api_schemas.tinker.sampling import SamplingParams
from server.errors import BadRequest
from server.services import checkpoints as ckpt
from server.services import sampling
from server.services.chat import run_sample
from server.services.chat_template import chat_tokenizer
from server.services.context import Context
from server.services.native import sampler_adapters
from api_schemas.tinker.json_batch import topk_json
from server.services.sample_validation import MAX_NUM_SAMPLES, MAX_TOPK, sample_params

PARAM_KEYS = {"max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop",
              "logprobs", "prompt_logprobs", "num_samples"}
MAX_INPUTS = 256


async def weights_for(ctx: Context, tenant_id: str, model: str, adapter_uri: object) -> WeightsRef | None:
    if adapter_uri is None or adapter_uri == "":
        return None
    if not isinstance(adapter_uri, str) or not adapter_uri.startswith(ckpt.SCHEMES):
        raise BadRequest("adapter_uri must be a twinkle:// path of one of your saved checkpoints "
                         "(server paths and hub ids are not loaded)")
    base_model, _, weights = await sampling.resolve_path(ctx, tenant_id, adapter_uri)
    if base_model != model:
        raise BadRequest(f"{adapter_uri} was trained on {base_model}, not {model}")
    return weights


def _params(raw: object, top_level_samples: object) -> tuple[dict[str, Any], int]:
    params = dict(raw) if isinstance(raw, Mapping) else {}
    if raw is not None and not isinstance(raw, Mapping):
        raise BadRequest("sampling_params must be an object or null")
    unknown = sorted(set(params) - PARAM_KEYS)
    if unknown:
        raise BadRequest(f"unknown sampling_params {unknown}; accepted: {sorted(PARAM_KEYS)}")
    params = {k: v for k, v in params.items() if v is not None}
    if params.pop("repetition_penalty", 1.0) != 1.0:
        raise BadRequest("repetition_penalty other than 1.0 is not supported")
    n = params.pop("num_samples", top_level_samples if top_level_samples is not None else 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_NUM_SAMPLES:
        raise BadRequest(f"num_samples must be an integer from 1 to {MAX_NUM_SAMPLES}")
    if "max_new_tokens" in params:
        params.setdefault("max_tokens", params.pop("max_new_tokens"))
    return params, n


def _prompt(served: ServedModel, item: object, feature: bool) -> list[int]:
    if not isinstance(item, Mapping):
        raise BadRequest("each input must be an InputFeature or a Trajectory object")
    if feature:
        ids = item.get("input_ids")
        if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
            ids = ids[0]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest("input_ids must be a non-empty list of integers")
        return list(ids)
    messages = item.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("a Trajectory needs a non-empty list of messages")
    text: list[dict[str, str]] = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise BadRequest("each message needs a role and a content")
        content = m.get("content", "")
        if isinstance(content, list):
            if any(isinstance(b, Mapping) and b.get("type") not in (None, "text") for b in content):
                raise BadRequest("the served models take text only (no image, video or audio blocks)")
            content = "".join(str(b.get("text", "")) for b in content if isinstance(b, Mapping))
        text.append({"role": m["role"], "content": str(content or "")})
    return chat_tokenizer(served.tokenizer_id).encode_chat(text)


def _logprobs(seq: SampledSequence, k: int) -> list[list[list[float]]]:
    """Per generated token: [[sampled id, lp]] (k = 1) or the top-k [[id, lp], ...] by logprob."""
    if k > 1 and seq.topk_ids is not None and seq.topk_logprobs is not None:
        ids, lps = seq.topk_ids.numpy(), seq.topk_logprobs.numpy()
        return [[[int(i), float(lp)] for i, lp in zip(ids[t], lps[t])] for t in range(len(seq.tokens))]
    return [[[int(t), float(lp)]] for t, lp in zip(seq.tokens, seq.logprobs)]


def _new_feature(item: Mapping[str, Any], prompt: list[int], tokens: list[int], decoded: str) -> dict[str, Any]:
    """The input with the generated turn appended; labels shifted as twinkle's (position i predicts i + 1)."""
    given = item.get("labels")
    if isinstance(given, list) and len(given) == 1 and isinstance(given[0], list):
        given = given[0]
    head = list(given[: len(prompt) - 1]) if isinstance(given, list) and len(given) == len(prompt) else \
        [IGNORE_INDEX] * (len(prompt) - 1)
    ids = prompt + tokens
    labels = head + tokens + [IGNORE_INDEX] if tokens else head + [IGNORE_INDEX]
    out = {**item, "input_ids": ids, "labels": labels, "attention_mask": [1] * len(ids),
           "position_ids": list(range(len(ids))), "length": len(ids)}
    if isinstance(item.get("messages"), list) and tokens:
        out["messages"] = [*item["messages"], {"role": "assistant", "content": decoded}]
    return out


async def sample(ctx: Context, tenant_id: str, model: str, body: dict[str, Any],
                 session_id: str | None = None) -> dict[str, Any]:
    served = ctx.served(model)
    inputs = body.get("inputs")
    items = [inputs] if isinstance(inputs, Mapping) else inputs
    if not isinstance(items, list) or not items or len(items) > MAX_INPUTS:
        raise BadRequest(f"inputs must be a list of 1 to {MAX_INPUTS} InputFeatures or Trajectories")
    feature = is_feature_list(items)
    params, n = _params(body.get("sampling_params"), body.get("num_samples"))
    k = params.pop("logprobs", None)
    prompt_k = params.pop("prompt_logprobs", None)
    for name, v in (("logprobs", k), ("prompt_logprobs", prompt_k)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_TOPK):
            raise BadRequest(f"{name} must be an integer from 0 to {MAX_TOPK}")
    score_only = params.get("max_tokens") == 0
    if score_only:
        params["max_tokens"] = 1  # one token is decoded and dropped: the answer holds the prompt's scores
    try:
        sp = sample_params(SamplingParams(**params), served, ctx.settings)
    except ValidationError as e:
        raise BadRequest(f"sampling_params: {e.errors()[0]['msg']}") from None
    adapter_uri, adapter_name = body.get("adapter_uri"), body.get("adapter_name")
    if adapter_uri in (None, "") and adapter_name not in (None, ""):  # add_adapter_to_sampler's slot: no weights
        await sampler_adapters.check(ctx, tenant_id, session_id, served.name, adapter_name)
    weights = await weights_for(ctx, tenant_id, served.name, adapter_uri)
    prompts = [_prompt(served, item, feature) for item in items]
    for p in prompts:
        if len(p) >= served.max_context or min(p) < 0 or max(p) >= served.vocab_size:
            raise BadRequest(f"a prompt of {len(p)} tokens must fit the context ({served.max_context}) and hold ids "
                             f"inside the vocabulary [0, {served.vocab_size})")
    jobs = [Sample(prompt_tokens=tuple(p), num_samples=n, params=sp, prompt_logprobs=prompt_k is not None,
                   topk_prompt_logprobs=prompt_k if prompt_k and prompt_k > 1 else 0,
                   topk_sample_logprobs=k if k and k > 1 else 0, weights=weights) for p in prompts]
    results = await asyncio.gather(*(run_sample(ctx, tenant_id, served.name, j) for j in jobs))
    tok = chat_tokenizer(served.tokenizer_id)
    return {"samples": [_answer(item, p, r, k, score_only, tok.decode) for item, p, r in zip(items, prompts, results)]}


def _answer(item: Mapping[str, Any], prompt: list[int], result: SampleResult, k: int | None, score_only: bool,
            decode: Any) -> dict[str, Any]:
    sequences = []
    for seq in result.sequences:
        tokens = [] if score_only else list(seq.tokens)
        decoded = decode(tokens) if tokens else ""
        sequences.append({
            "stop_reason": "length" if score_only else seq.stop_reason, "tokens": tokens,
            "logprobs": None if k is None or score_only else _logprobs(seq, k), "decoded": decoded,
            "new_input_feature": _new_feature(item, prompt, tokens, decoded) if isinstance(item, Mapping) else None,
        })
    prompt_lps = None if result.prompt_logprobs is None else [
        None if math.isnan(lp) else float(lp) for lp in result.prompt_logprobs.numpy().tolist()]
    topk = None if result.topk_prompt_ids is None or result.topk_prompt_logprobs is None else topk_json(
        result.topk_prompt_ids.numpy(), result.topk_prompt_logprobs.numpy())
    return {"sequences": sequences, "prompt_logprobs": prompt_lps, "topk_prompt_logprobs": topk}
