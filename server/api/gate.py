"""The gate: one ASGI layer, right in front of FastAPI's routing, that every request to a route passes through.

For the route a request is for (looked up in FastAPI's own route table, read once) the gate
1. authenticates, if the route depends on a tenant (server/api/deps.py): with the headers that dependency
   accepts, through server/auth/credentials.authenticate, before a byte of the body is read; then takes one
   token of the tenant's request rate (server/auth/rate_limits.py; 429 when empty) unless it is not counted
   (`rate_counted`: polling, heartbeats and the native client's routes);
2. reads the body, bounded (settings.max_request_bytes, or the route's own limit): a Content-Length over the limit
   is refused unread, and reading stops at the first chunk past it, with the same 413 JSON as before;
3. answers the per-step routes itself (server/api/hot_routes.py: the gateway's CPU per step), or hands the
   request on to FastAPI with its body replayed and its tenant in the scope.

It is the innermost of the app's middleware (create_app appends it last; `add_middleware` puts later ones
outside it), so every other middleware (metrics, CORS, ...) sees every request, the per-step routes included.
Only FastAPI's own exception layers sit inside it, so the gate renders its errors itself, as app.py's handler does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.dependencies.models import Dependant
from starlette.datastructures import State
from starlette.routing import BaseRoute, compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api import hot_routes
from server.api.deps import KEY_HEADERS, TENANT
from server.auth.credentials import KeyHeaders, authenticate
from server.auth.rate_limits import RequestLimiter
from server.errors import DomainError, PayloadTooLarge, TooManyRequests
from server.services.audit import CALLER


# Routes a tenant's request rate does not count: polling a future and keeping a session alive must never be
# starved by the client's own other requests (each of those counts once, and their results are polled for).
# Nor are the routes of twinkle-kit's native client (tag "twinkle"): it raises on a 429 instead of retrying
# (twinkle_client/http/http_utils.py), so a limit would fail those clients rather than slow them.
UNCOUNTED = frozenset({"/api/v1/retrieve_future", "/api/v1/retrieve_futures", "/api/v1/session_heartbeat",
                       "/api/v1/telemetry"})
UNCOUNTED_TAGS = frozenset({"twinkle"})


def rate_counted(path: str, tags: Iterable[Any]) -> bool:
    """Whether a request to this route takes a token of its tenant's request rate (see UNCOUNTED)."""
    return path not in UNCOUNTED and UNCOUNTED_TAGS.isdisjoint(str(t) for t in tags)
ROUTE = "twinkle.route"  # scope key: the template of the route a request is for (server/api/metrics.py reads it)


@dataclass(frozen=True)
class BodyLimit:
    size: int
    message: str  # the 413's detail


def default_limit(size: int) -> BodyLimit:
    return BodyLimit(size, f"request body exceeds the limit of {size} bytes")


@dataclass(frozen=True)
class _Rule:
    path: str  # the route's template (metrics label requests by it, never by their raw path)
    keys: KeyHeaders | None  # None: the route takes no key (health, ...)
    limit: BodyLimit | None  # None: the gate's default
    hot: bool  # a POST to a path the fast path serves
    counted: bool  # by the tenant's request rate (rate_counted)


class Gate:
    """`state` is the app's (ctx, key_cache, rate_limiter); `routes` its router's routes; `limits` per path
    override `limit`; `hot` the fast path's routes (hot_routes.ROUTES; empty: FastAPI answers everything)."""

    def __init__(self, app: ASGIApp, state: State, routes: Sequence[BaseRoute], limit: BodyLimit,
                 limits: Mapping[str, BodyLimit] | None = None,
                 hot: Mapping[str, hot_routes.HotRoute] = hot_routes.ROUTES) -> None:
        self.app = app
        self.state = state
        self.limit = limit
        self.hot = hot
        self._rules = _Rules(routes, limits or {}, hot)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rule = self._rules.lookup(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if rule is None:  # no such route (FastAPI's 404 / 405), or not a route of ours (docs, openapi.json)
            await self.app(scope, receive, send)
            return
        token = CALLER.set(None)  # authenticate sets it for this request only
        try:
            await self._serve(rule, scope, receive, send)
        finally:
            CALLER.reset(token)

    async def _serve(self, rule: _Rule, scope: Scope, receive: Receive, send: Send) -> None:
        scope[ROUTE] = rule.path
        try:
            if rule.keys is not None:
                ctx = self.state.ctx
                scope[TENANT] = tenant = await authenticate(self.state.key_cache, ctx.db, scope, rule.keys)
                if rule.counted:
                    await _within_rate(self.state.rate_limiter, ctx, tenant)
            body = await read_body(scope, receive, rule.limit or self.limit)
            if body is None:  # the client went away: nothing to answer, nothing queued
                return
            route = self.hot.get(scope["path"]) if rule.hot else None
            if route is not None and await hot_routes.answer(route, self.state.ctx, scope[TENANT], body, scope, send):
                return
        except DomainError as e:
            status, payload, headers = e.as_json()
            await hot_routes.send_bytes(send, status, hot_routes.JSON, payload, headers)
            return
        await self.app(scope, replay(body, receive), send)


async def _within_rate(limiter: RequestLimiter, ctx: Any, tenant: str) -> None:
    """TooManyRequests (429, Retry-After) when the tenant's request bucket is empty; the request is not read."""
    limits = await ctx.admission.limits.get(tenant)
    if limits.requests_per_minute is None:
        return
    wait = await limiter.wait(tenant, limits.requests_per_minute, limits.request_burst)
    if wait > 0:
        raise TooManyRequests(f"request rate limit of {limits.requests_per_minute} per minute reached; retry "
                              f"after {wait:.1f} s", wait)


async def read_body(scope: Scope, receive: Receive, limit: BodyLimit) -> bytes | None:
    """The whole body, never more than `limit.size` plus one chunk of it (PayloadTooLarge past that); None when
    the client disconnects first."""
    declared = _content_length(scope)
    if declared is not None and declared > limit.size:
        raise PayloadTooLarge(limit.message)
    message = await receive()
    if message["type"] == "http.disconnect":
        return None
    first: bytes = message.get("body", b"")
    if len(first) > limit.size:
        raise PayloadTooLarge(limit.message)
    if not message.get("more_body", False):
        return first  # the usual case: one message, no copy
    body = bytearray(first)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if len(body) > limit.size:
            raise PayloadTooLarge(limit.message)
        if not message.get("more_body", False):
            return bytes(body)


def replay(body: bytes, receive: Receive) -> Receive:
    """`receive` as if the body had not been read: the body in one message, then the client's own messages."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses such a request before it gets here
    return None


class _Rules:
    """(method, path) -> the route's rule, in FastAPI's order of matching (the first route that matches)."""

    def __init__(self, routes: Sequence[BaseRoute], limits: Mapping[str, BodyLimit],
                 hot: Mapping[str, Any]) -> None:
        self._static: dict[tuple[str, str], _Rule] = {}
        self._patterns: list[tuple[re.Pattern[str], frozenset[str], _Rule]] = []
        tags = {c.path: getattr(c, "tags", None) or () for c in _route_contexts(routes) if hasattr(c, "path")}
        for path, methods, dependant in api_routes(routes):
            rule = _Rule(path, route_keys(dependant), limits.get(path), "POST" in methods and path in hot,
                         rate_counted(path, tags.get(path, ())))
            if "{" in path:
                self._patterns.append((compile_path(path)[0], frozenset(methods), rule))
                continue
            for method in methods:
                if (method, path) not in self._static and self._pattern(method, path) is None:
                    self._static[(method, path)] = rule

    def lookup(self, method: str, path: str) -> _Rule | None:
        rule = self._static.get((method, path))
        return rule if rule is not None else self._pattern(method, path)

    def _pattern(self, method: str, path: str) -> _Rule | None:
        for regex, methods, rule in self._patterns:
            if method in methods and regex.match(path):
                return rule
        return None


def _route_contexts(routes: Sequence[BaseRoute]) -> Iterator[Any]:
    """FastAPI's routes with included routers resolved: newer FastAPI keeps them nested (`iter_route_contexts`
    walks them); older releases (e.g. the one vLLM pins) copy every included route into the app's own list."""
    try:
        from fastapi.routing import iter_route_contexts  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        yield from routes
        return
    yield from iter_route_contexts(routes)


def api_routes(routes: Sequence[BaseRoute]) -> Iterator[tuple[str, set[str], Dependant]]:
    """Each FastAPI route as (full path, methods, dependant), included routers resolved, in matching order."""
    for context in _route_contexts(routes):
        dependant = getattr(context, "dependant", None)
        if isinstance(dependant, Dependant) and context.path is not None:
            yield context.path, set(context.methods or ()), dependant


def route_keys(dependant: Dependant) -> KeyHeaders | None:
    for sub in dependant.dependencies:
        found = KEY_HEADERS.get(sub.call) if sub.call is not None else None
        if found is None:
            found = route_keys(sub)
        if found is not None:
            return found
    return None
