"""OpenAI-compatible chat completions on the same samplers as the Tinker API.

`model` is a served base model, a tinker:// checkpoint path the tenant may read (its own or a published one), or
one of the tenant's sampling session ids. Messages go through the model's chat template here in the gateway
(tokenizers + jinja2, no torch); the sampler sees token ids only, like any Tinker sample request.
Streaming runs the completion as a chain of short sample jobs (STREAM_CHUNK tokens each, every one continuing
from the text so far), so text reaches the client while the rest is still being generated.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass


from api_schemas.jobs import Sample, SampleParams, SampleResult, WeightsRef
from api_schemas.models import ServedModel
from api_schemas.openai import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    ModelCard,
    ModelList,
    Usage,
)
from server.db import repositories as repo
from server.errors import BadRequest, DomainError, NotFound
from server.services import checkpoints as ckpt
from server.services import jobs, sampling
from server.services.chat_template import ChatTokenizer, chat_tokenizer
from server.services.context import Context

STREAM_CHUNK = 16
MAX_WAIT_SECONDS = 600.0


class SamplerFailed(DomainError):
    status, category = 500, "server"


@dataclass
class Prepared:
    served: ServedModel
    weights: WeightsRef | None
    tok: ChatTokenizer
    prompt: list[int]
    limit: int  # completion tokens at most


async def list_models(ctx: Context, tenant_id: str) -> ModelList:
    cards = [ModelCard(id=m.name, created=0, owned_by="twinkle") for m in ctx.models.values()]
    async with ctx.db.session() as s:
        rows = await repo.sampler_checkpoints_of(s, tenant_id)
    cards += [ModelCard(id=r.tinker_path, created=int(r.created_at.timestamp()), owned_by=tenant_id) for r in rows]
    return ModelList(data=cards)


async def resolve_model(ctx: Context, tenant_id: str, model: str) -> tuple[ServedModel, WeightsRef | None]:
    if model in ctx.models:
        return ctx.models[model], None
    if model.startswith(ckpt.SCHEMES):
        base_model, _, weights = await sampling.resolve_path(ctx, tenant_id, model)
        return ctx.served(base_model), weights
    async with ctx.db.session() as s:
        row = await repo.sampling_session_of(s, tenant_id, model)
    if row is None:
        raise NotFound(f"model {model!r} not found; base models served here: {sorted(ctx.models)}, and GET "
                       "/v1/models lists your checkpoints and sampling sessions too")
    return ctx.served(row.base_model), sampling.weights_of(row)


async def prepare(ctx: Context, tenant_id: str, req: ChatCompletionRequest) -> Prepared:
    served, weights = await resolve_model(ctx, tenant_id, req.model)
    tok = chat_tokenizer(served.tokenizer_id)
    try:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    except ValueError as e:
        raise BadRequest(str(e)) from e
    prompt = tok.encode_chat(messages)
    room = served.max_context - len(prompt)
    if room < 1:
        raise BadRequest(f"the messages take {len(prompt)} tokens; the model's context is {served.max_context}")
    if (req.token_limit or 0) > served.max_context:
        raise BadRequest(f"max_tokens {req.token_limit} exceeds the model's context of {served.max_context}")
    limit = min(req.token_limit or ctx.settings.sample_default_max_tokens, room)  # a sequence ends when it is full
    if req.stream and req.n != 1:
        raise BadRequest("streaming serves n=1 only")
    return Prepared(served, weights, tok, prompt, limit)


def _payload(req: ChatCompletionRequest, p: Prepared, prompt: list[int], max_tokens: int, seed: int | None) -> Sample:
    params = SampleParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=seed,
                          stop_strings=req.stop_strings, stop_at_eos=True)
    return Sample(prompt_tokens=tuple(prompt), num_samples=req.n, params=params, weights=p.weights)


async def run_sample(ctx: Context, tenant_id: str, base_model: str, payload: Sample) -> SampleResult:
    """Queue one sample job (no client seq_id: nothing to deduplicate) and wait for its result."""
    job_id = await jobs.queue_oneshot_sample(ctx, tenant_id=tenant_id, base_model=base_model, payload=payload)
    deadline = time.monotonic() + MAX_WAIT_SECONDS
    while time.monotonic() < deadline:
        result = await jobs.wait_result(ctx, job_id, ctx.settings.long_poll_seconds)
        if result is None:
            continue
        if result.error is not None:
            if result.error.category.value == "user":
                raise BadRequest(result.error.message)
            raise SamplerFailed(result.error.message)
        if not isinstance(result.output, SampleResult):
            raise SamplerFailed("the sampler answered without samples")
        return result.output
    raise SamplerFailed("the sampler did not answer in time")


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """OpenAI leaves the stop string out of the content (Tinker keeps its tokens)."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


async def complete(ctx: Context, tenant_id: str, req: ChatCompletionRequest) -> ChatCompletion:
    p = await prepare(ctx, tenant_id, req)
    res = await run_sample(ctx, tenant_id, p.served.name, _payload(req, p, p.prompt, p.limit, req.seed))
    choices, generated = [], 0
    for i, seq in enumerate(res.sequences):
        tokens = list(seq.tokens)
        generated += len(tokens)
        text, _ = _cut_at_stop(p.tok.decode(tokens), req.stop_strings)
        stopped = seq.stop_reason == "stop"
        message = AssistantMessage(content=text)
        choices.append(Choice(index=i, message=message, finish_reason="stop" if stopped else "length"))
    usage = Usage(prompt_tokens=len(p.prompt), completion_tokens=generated, total_tokens=len(p.prompt) + generated)
    return ChatCompletion(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=req.model,
                          choices=choices, usage=usage)


async def stream(ctx: Context, tenant_id: str, req: ChatCompletionRequest, p: Prepared) -> AsyncIterator[bytes]:
    """SSE events of one streamed completion (`prepare` ran first, so request errors were already answered)."""
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def event(delta: dict[str, str], finish: str | None = None) -> bytes:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(body)}\n\n".encode()

    yield event({"role": "assistant", "content": ""})
    generated: list[int] = []
    sent, text, finish, hold = "", "", "length", max((len(s) for s in req.stop_strings), default=1) - 1
    for k in range(0, p.limit, STREAM_CHUNK):
        seed = None if req.seed is None else req.seed + k
        n = min(STREAM_CHUNK, p.limit - k)
        res = await run_sample(ctx, tenant_id, p.served.name, _payload(req, p, p.prompt + generated, n, seed))
        seq = res.sequences[0]
        generated += seq.tokens
        text, stopped = _cut_at_stop(p.tok.decode(generated), req.stop_strings)
        done = stopped or seq.stop_reason == "stop"
        # Hold back what could still become a stop string, and a trailing partial UTF-8 character.
        ready = text if done else text[: max(len(sent), len(text) - hold)].rstrip("\ufffd")
        if len(ready) > len(sent):
            yield event({"content": ready[len(sent) :]})
            sent = ready
        if done:
            finish = "stop"
            break
    if len(text) > len(sent):  # the held-back tail of a completion that ran to its length
        yield event({"content": text[len(sent) :]})
    yield event({}, finish)
    yield b"data: [DONE]\n\n"
