"""The outermost look at every HTTP request: its request id, its count in the metrics, its debug log line, and with
tracing on (jobqueue/tracing.py) its span, the root of the request's trace.

The request id (jobqueue/logs.py) is the client's `X-Request-Id` when that is a plain token, else a new one; it is
set for everything the request runs (the jobs it queues carry it to the worker) and answered in `X-Request-Id`.
A request is counted once answered, by the template of its route (the gate puts it in the scope; "unmatched" for a
path no route serves), its method, status and, when it authenticated, its tenant id. Headers and bodies are never
logged.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobqueue import tracing
from jobqueue.logs import REQUEST_ID, request_id_from
from server.api.deps import TENANT
from server.api.gate import ROUTE
from server.services import metrics

log = logging.getLogger("twinkle.http")


class Observe:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                given = value
                break
        rid = request_id_from(given)
        token = REQUEST_ID.set(rid)
        status = 500  # an exception escaping the app is answered 500 by the outermost layer
        started = time.perf_counter() if log.isEnabledFor(logging.DEBUG) else 0.0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = message.get("headers")
                message["headers"] = [*headers, (b"x-request-id", rid.encode())] if headers else \
                    [(b"x-request-id", rid.encode())]
            await send(message)

        span = tracing.start_request(scope["method"]) if tracing.enabled() else None  # jobqueue/tracing.py
        error: BaseException | None = None
        try:
            await self.app(scope, receive, sending)
        except BaseException as e:
            error = e
            raise
        finally:
            route = scope.get(ROUTE) or _fastapi_route(scope)
            metrics.count_request(route, scope["method"], status, scope.get(TENANT))
            if span is not None:
                tracing.end_request(span, route, status, scope.get(TENANT), rid, error)
            if started:
                log.debug("%s %s -> %d in %.1f ms", scope["method"], route, status,
                          (time.perf_counter() - started) * 1000)
            REQUEST_ID.reset(token)


def _fastapi_route(scope: Scope) -> str:
    """The template of a route the gate does not know (docs), or "unmatched"."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
