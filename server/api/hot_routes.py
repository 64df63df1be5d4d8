"""The per-step routes, answered without FastAPI's machinery: forward_backward, optim_step, asample, retrieve_future.

A training step is two of these requests and their two retrieve_future calls, so the gateway's cost per request
is most of its cost per step. The gate (server/api/gate.py) has authenticated the request and read its body
(bounded) as for any route; `answer` then runs the same request model and service function as the FastAPI route,
which stays registered (OpenAPI, and the fallback): only the framework's layers are skipped (dependency
solving, response-model validation), about a third of the gateway's CPU per step.

Anything out of the ordinary goes on to FastAPI, so there is one way to answer it: another content type, or a
body that does not validate (FastAPI then answers its 422).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.types import Scope, Send

from api_schemas.tinker.sampling import SampleRequest
from api_schemas.tinker.types import OptimStepRequest, RetrieveFutureRequest
from server.services import futures, sampling, training
from server.services.context import Context

Answer = tuple[bytes, bytes]  # media type, body

JSON = b"application/json"


async def _optim_step(ctx: Context, tenant: str, req: Any, _: Scope) -> Answer:
    return _model(await training.optim_step(ctx, tenant, req))


async def _forward_backward(ctx: Context, tenant: str, body: Any, scope: Scope) -> Answer:
    encoding, media = _header(scope, b"content-encoding"), _header(scope, b"content-type")
    return _model(await training.forward_backward(ctx, tenant, body, encoding.decode("latin-1") if encoding else None,
                                                  media.decode("latin-1") if media else None))


async def _asample(ctx: Context, tenant: str, req: Any, _: Scope) -> Answer:
    return _model(await sampling.asample(ctx, tenant, req))


async def _retrieve_future(ctx: Context, tenant: str, req: Any, scope: Scope) -> Answer:
    accept = _header(scope, b"accept")
    answer = await futures.retrieve(ctx, tenant, req.request_id, accept.decode("latin-1") if accept else None)
    return answer.media_type.encode(), answer.body


@dataclass(frozen=True)
class HotRoute:
    request: type[BaseModel] | None  # None: the raw body goes to the service (protobuf)
    run: Callable[[Context, str, Any, Scope], Awaitable[Answer]]


ROUTES: dict[str, HotRoute] = {
    "/api/v1/forward_backward": HotRoute(None, _forward_backward),
    "/api/v1/optim_step": HotRoute(OptimStepRequest, _optim_step),
    "/api/v1/asample": HotRoute(SampleRequest, _asample),
    "/api/v1/retrieve_future": HotRoute(RetrieveFutureRequest, _retrieve_future),
}


async def answer(route: HotRoute, ctx: Context, tenant: str, body: bytes, scope: Scope, send: Send) -> bool:
    """Answer an authenticated POST to `route` with its body; False: FastAPI is to answer it. DomainErrors are
    raised for the gate to render."""
    request: Any = body
    if route.request is not None:
        if not _is_json(_header(scope, b"content-type")):
            return False
        try:
            request = route.request.model_validate_json(body)
        except ValidationError:
            return False
    media, content = await route.run(ctx, tenant, request, scope)
    await send_bytes(send, 200, media, content)
    return True


async def send_bytes(send: Send, status: int, media: bytes, body: bytes, headers: dict[str, str] | None = None) -> None:
    raw = [(b"content-type", media), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _model(m: BaseModel) -> Answer:
    return JSON, m.model_dump_json(by_alias=True).encode()


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


def _is_json(content_type: bytes | None) -> bool:
    return content_type is None or content_type.split(b";", 1)[0].strip().lower() == JSON
