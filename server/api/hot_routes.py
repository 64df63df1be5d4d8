"""The per-step routes, served without FastAPI's machinery: forward_backward, optim_step, asample, retrieve_future.

A training step is two of these requests and their two retrieve_future calls, so the gateway's cost per request
is most of its cost per step. This ASGI middleware answers them with the same request models, the same
authentication (KeyCache), the same service functions and the same error bodies as their FastAPI routes, which
stay registered (OpenAPI, and the fallback): only the framework's layers are skipped (matching through every
router, dependency solving, response-model validation), about half the gateway's CPU per request.

Anything out of the ordinary goes on to FastAPI unchanged, so there is one way to answer it: another method or
content type, or a body that does not validate (FastAPI then answers its 422). The body is read here first,
bounded by `max_request_bytes`, and handed on as it was received.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.datastructures import State
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_schemas.tinker.sampling import SampleRequest
from api_schemas.tinker.types import OptimStepRequest, RetrieveFutureRequest
from server.auth.keys import KeyCache
from server.errors import DomainError, PayloadTooLarge, Unauthorized
from server.services import futures, sampling, training
from server.services.context import Context

Answer = tuple[bytes, bytes]  # media type, body

_JSON = b"application/json"


async def _optim_step(ctx: Context, tenant: str, req: Any, _: Scope) -> Answer:
    return _model(await training.optim_step(ctx, tenant, req))


async def _forward_backward(ctx: Context, tenant: str, body: Any, scope: Scope) -> Answer:
    encoding = _header(scope, b"content-encoding")
    return _model(await training.forward_backward(ctx, tenant, body, encoding.decode("latin-1") if encoding else None))


async def _asample(ctx: Context, tenant: str, req: Any, _: Scope) -> Answer:
    return _model(await sampling.asample(ctx, tenant, req))


async def _retrieve_future(ctx: Context, tenant: str, req: Any, _: Scope) -> Answer:
    answer = await futures.retrieve(ctx, tenant, req.request_id)
    return answer.media_type.encode(), answer.body


@dataclass(frozen=True)
class _Route:
    request: type[BaseModel] | None  # None: the raw body goes to the service (protobuf)
    run: Callable[[Context, str, Any, Scope], Awaitable[Answer]]


ROUTES: dict[str, _Route] = {
    "/api/v1/forward_backward": _Route(None, _forward_backward),
    "/api/v1/optim_step": _Route(OptimStepRequest, _optim_step),
    "/api/v1/asample": _Route(SampleRequest, _asample),
    "/api/v1/retrieve_future": _Route(RetrieveFutureRequest, _retrieve_future),
}


class HotRoutes:
    """ASGI middleware in front of the routers; `state` is the app's (ctx, key_cache)."""

    def __init__(self, app: ASGIApp, state: State) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or (route.request is not None and not _is_json(_header(scope, b"content-type"))):
            await self.app(scope, receive, send)
            return
        ctx: Context = self.state.ctx
        try:
            body = await _read_body(receive, ctx.settings.max_request_bytes)
            if body is None:  # the client went away
                return
            request: Any = body
            if route.request is not None:
                try:
                    request = route.request.model_validate_json(body)
                except ValidationError:
                    await self.app(scope, _replay(body, receive), send)
                    return
            tenant = await _tenant(self.state.key_cache, ctx, _header(scope, b"x-api-key"))
            media, content = await route.run(ctx, tenant, request, scope)
        except DomainError as e:
            status, payload, headers = e.as_json()
            await _send(send, status, _JSON, payload, headers)
            return
        await _send(send, 200, media, content)


async def _tenant(cache: KeyCache, ctx: Context, raw_key: bytes | None) -> str:
    if not raw_key:
        raise Unauthorized("missing X-API-Key header")
    tenant_id = await cache.tenant(ctx.db.session, raw_key.decode("latin-1"))
    if tenant_id is None:
        raise Unauthorized("invalid or revoked API key")
    return tenant_id


def _model(m: BaseModel) -> Answer:
    return _JSON, m.model_dump_json(by_alias=True).encode()


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v  # type: ignore[no-any-return]
    return None


def _is_json(content_type: bytes | None) -> bool:
    return content_type is None or content_type.split(b";", 1)[0].strip().lower() == _JSON


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        if not message.get("more_body", False):
            return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


async def _send(send: Send, status: int, media: bytes, body: bytes, headers: dict[str, str] | None = None) -> None:
    raw = [(b"content-type", media), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})

